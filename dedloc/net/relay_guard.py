"""Keeping an invite-only run's relay for its members.

The p2p daemon's relay service has no access filter: any libp2p peer that reaches a relay can
hold a slot on it and relay through it (bounded by node.RELAY_SERVICE_ARGS). So a relay of an
invite-only run watches its connections. A peer that has not proven membership to it (a valid
invitation in the hello of any dedloc stream, or on a signed DHT request or record: the
Authorizer remembers these) within ``GRACE`` seconds of being seen connected is disconnected,
which ends its reservation and every circuit through it. A peer disconnected once is
disconnected at the next sweep if it comes back still unproven (for ``STRIKE_TTL``), so
reconnecting does not buy another grace period. A member whose invitation is revoked or
expires is dropped at the next sweep.

Members prove themselves without trying: every peer's DHT signs its requests to its initial peers
(the default relays) from the start, and a private peer pings the DHT of each relay it holds a
slot on (``keep_known``).

Guarantees: only this peer's own daemon connections are touched; a sweep that fails (the daemon
is busy) is logged at DEBUG and retried; memory is bounded by the open connections plus
``MAX_STRUCK`` remembered peers. Open runs have no guard: every peer is a member there.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.p2p import P2P, PeerID

from dedloc.auth.authorizer import Authorizer
from dedloc.net import links

logger = logging.getLogger(__name__)
GRACE = 30.0
SWEEP_S = 5.0
STRIKE_TTL = 3600.0
MAX_STRUCK = 4096


class RelayGuard:
    """Disconnects peers that have not proven membership (see the module doc)."""

    def __init__(self, p2p: P2P, authorizer: Authorizer, me: str, grace: float = GRACE):
        self.p2p, self.authorizer, self.me, self.grace = p2p, authorizer, me, grace
        self._first_seen: dict[str, float] = {}
        self._struck: dict[str, float] = {}
        self.dropped: list[str] = []
        """Every disconnection, in order (peer ids)."""

    async def sweep(self) -> list[str]:
        """Look at the daemon's connections once; disconnect the peers due. Returns them."""
        now = time.monotonic()
        connected = await links.connections(self.p2p)
        self._first_seen = {p: t for p, t in self._first_seen.items() if p in connected}
        self._struck = {p: t for p, t in self._struck.items() if now - t < STRIKE_TTL}
        due = []
        for peer in connected:
            if peer == self.me:
                continue
            if self.authorizer.proven(peer):
                self._first_seen.pop(peer, None)
                self._struck.pop(peer, None)
                continue
            first = self._first_seen.setdefault(peer, now)
            if peer in self._struck or now - first >= self.grace:
                due.append(peer)
        for peer in due:
            await self.p2p._client.disconnect(PeerID.from_base58(peer))  # hivemind 1.1.12: no public call
            again = peer in self._struck
            self._struck.pop(peer, None)
            self._struck[peer] = now
            while len(self._struck) > MAX_STRUCK:
                self._struck.pop(next(iter(self._struck)))
            self._first_seen.pop(peer, None)
            self.dropped.append(peer)
            del self.dropped[:-MAX_STRUCK]
            logger.info(f"disconnected {peer}: not a member of this run "
                        + ("(came back without an invitation)" if again else
                           f"(showed no invitation within {self.grace:.0f} s)") + "; it may not use this relay")
        return due

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep()
            except Exception as e:
                logger.debug(f"relay guard sweep failed: {e!r}")


async def keep_known(ping, relays: list[str]) -> None:
    """A private peer's side: ping each relay's DHT (a signed request, which proves membership)
    every ``GRACE / 2`` seconds, so a relay never drops the slot this peer holds on it."""
    while True:
        for relay in relays:
            try:
                await ping(PeerID.from_base58(relay))
            except Exception as e:
                logger.debug(f"membership ping to relay {relay} failed: {e!r}")
        await asyncio.sleep(GRACE / 2)


__all__ = ["RelayGuard", "keep_known", "GRACE"]
