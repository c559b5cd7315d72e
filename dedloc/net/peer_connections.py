"""A peer's streams outside rounds (state transfer, bandwidth probes): direct TCP where the other
peer offers it, libp2p streams otherwise. The same Transport as a round's connections, for
protocols that have no round to hand out a secret.

**Who may connect.** Admission to direct connections is granted over the control plane: the
opener asks the peer, on a libp2p stream of protocol ``dedloc.{run}.direct`` (which checks
membership like every libp2p stream, net/serve.py), for a grant. The peer answers with its data
endpoint (address and certificate fingerprint, net/tcp.py), a 16-byte grant id and a 32-byte
secret, valid for ``GRANT_TTL`` seconds, for that opener and the protocols this object serves
only; or ``{none: reason}`` when it takes no direct connections. The opener then connects as to
a round (the grant id in place of the round id): the hello's MAC under the grant's secret admits
it, TLS pinned to the fingerprint the grant named. A peer removed from the run keeps a grant it
already holds until the grant expires (at most ``GRANT_TTL``), as it keeps a round's key for
that round.

**Fallback**, per pair and automatic: no grant (the peer is unreachable, in client mode, or runs
with ``transport="libp2p"``), an endpoint in plaintext when this peer requires encryption, a
failed connection or a refused hello all make the stream a libp2p one, and skip the direct path
to that peer for ``RETRY_AFTER_S`` (net/tcp.py): a peer that grants nothing is not asked again at
every stream.

``counts`` says how many streams went each way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from dedloc.errors import ProtocolError
from dedloc.net.serve import Streams
from dedloc.net.tcp import GRANT_TTL, DirectTCP, Endpoint, open_with_fallback
from dedloc.net.transport import Handler, StreamPair, Transport

logger = logging.getLogger(__name__)
VERSION = 1
GRANT_WAIT = 5.0
"""Longest the opener waits for a grant before it uses a libp2p stream instead."""
RENEW_BEFORE = 10.0
"""A cached grant is renewed when less than this is left of it (a connection needs a few seconds)."""


class PeerConnections(Transport):
    """Streams to other peers for protocols outside rounds (module doc); serves its protocols on
    both paths. ``start()`` serves grants; the DirectTCP's owner closes it."""

    def __init__(self, streams: Streams, tcp: DirectTCP | None, run_id: str, encryption: bool):
        self.streams, self.tcp, self.encryption = streams, tcp, encryption
        self.proto = f"dedloc.{run_id}.direct"
        self.counts: dict[str, int] = {"direct": 0, "libp2p": 0}
        self._served: set[str] = set()
        self._grants: dict[str, tuple[Endpoint, bytes, bytes, float]] = {}
        """Per peer: the grant it gave us (endpoint, id, secret, monotonic expiry)."""

    async def start(self) -> None:
        await self.streams.serve_requests(self.proto, self._on_grant_request)

    async def serve(self, protocol: str, handler: Handler) -> None:
        self._served.add(protocol)
        await self.streams.serve(protocol, handler)
        if self.tcp is not None:
            await self.tcp.serve(protocol, handler)

    async def _on_grant_request(self, peer_id: Any, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict) or request.get("v") != VERSION:
            raise ProtocolError(f"malformed grant request (version {VERSION} expected)")
        if self.tcp is None or self.tcp.endpoint is None:
            return {"none": "this peer takes no direct connections"}
        grant_id, key = self.tcp.grant(peer_id.to_base58(), frozenset(self._served), GRANT_TTL)
        return {"e": self.tcp.endpoint.to_wire(), "r": grant_id, "k": key, "ttl": GRANT_TTL}

    async def open(self, peer_id: str, protocol: str) -> StreamPair:
        """A direct stream if the peer grants one and it connects, else a libp2p stream (which
        raises as net/serve.Streams.open does)."""
        direct = self.tcp is not None and self.tcp.usable(peer_id)
        return await open_with_fallback(peer_id, protocol, functools.partial(self._direct, peer_id, protocol)
                                        if direct else None, self.streams, self.counts)

    async def _direct(self, peer_id: str, protocol: str) -> StreamPair:
        assert self.tcp is not None
        try:
            endpoint, grant_id, key = await self._grant(peer_id)
        except (ConnectionError, ProtocolError, asyncio.TimeoutError) as e:
            self.tcp.avoid(peer_id, f"no grant: {e}")  # not asked again at every stream
            raise
        try:
            return await self.tcp.open(peer_id, protocol, endpoint, grant_id, key, self.encryption)
        except BaseException:
            self._grants.pop(peer_id, None)
            raise

    async def _grant(self, peer_id: str) -> tuple[Endpoint, bytes, bytes]:
        """The peer's grant (cached until shortly before it expires); raises ConnectionError if
        it gives none, ProtocolError if the answer is malformed."""
        cached = self._grants.get(peer_id)
        if cached is not None and cached[3] - time.monotonic() > RENEW_BEFORE:
            return cached[:3]
        answer = await self.streams.call(peer_id, self.proto, {"v": VERSION}, GRANT_WAIT)
        if isinstance(answer, dict) and isinstance(answer.get("none"), str):
            raise ConnectionError(f"{peer_id} grants no direct connections: {answer['none'][:200]}")
        if not isinstance(answer, dict):
            raise ProtocolError(f"malformed grant from {peer_id}")
        e, r, k, ttl = (answer.get(x) for x in ("e", "r", "k", "ttl"))
        if not (isinstance(e, str) and isinstance(r, bytes) and len(r) == 16 and isinstance(k, bytes)
                and len(k) == 32 and isinstance(ttl, (int, float)) and 0 < ttl <= 24 * 3600):
            raise ProtocolError(f"malformed grant from {peer_id}")
        endpoint = Endpoint.parse(e)
        self._grants[peer_id] = (endpoint, r, k, time.monotonic() + float(ttl))
        return endpoint, r, k


__all__ = ["PeerConnections"]
