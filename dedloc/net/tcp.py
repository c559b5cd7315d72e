"""Direct TCP connections for a round's tensor streams: the data plane between peers that can
reach each other. libp2p stays the control plane (discovery, DHT, NAT traversal, identity,
membership); only round streams take this path, and only between members of one round.

**Who may connect.** A round's leader draws a 32-byte secret for the round and hands it to every
member over the authenticated, encrypted libp2p join stream (``Group.key``). A connection's first
message, before any payload, is a hello ``{v, r: round id, f: from, t: to, n: 16 random bytes,
p: protocol, m: HMAC-SHA256(key, "dedloc tcp hello" | r | p | f | t | n), s: f's Ed25519
signature over the same}``. The server checks, in this order: that ``t`` is itself; the signature,
against the key inside ``f`` (every member shares the round's secret, so the MAC alone let a
member claim another's id: an aggregator then refused the real member's contribution as late);
that ``f`` is a member of the run (its invitation, auth/authorizer.py); that the nonce ``n`` was
not seen in the last ``NONCE_TTL`` seconds (a hello replayed byte for byte on a plaintext
connection let a non-member download the state); ``f``'s connection budget; and only then that
the round is one it serves (it may wait briefly for it to start, holding one of ``f``'s
connections), that ``f`` is a member of it, and the MAC (which covers the protocol ``p`` too).
It answers ``{ok: HMAC(key, "dedloc tcp ok" | n)}`` (the client checks it) or ``{refused:
reason}``. A refusal before ``f`` is proven a member is logged under the connecting address, not
the claimed id: invented ids cost one WARNING per address per minute.

Streams outside rounds (state transfer, probes) are admitted the same way under a **grant**: a
secret this peer draws for one peer and a set of protocols, handed to it over an authenticated
libp2p stream, valid ``GRANT_TTL`` seconds (net/peer_connections.py); its id takes the round id's
place in the hello.

**Encryption.** By default every connection is TLS 1.3. Each peer makes a throwaway self-signed
certificate when it starts, and publishes its SHA-256 fingerprint with its data endpoint in its
join request, so the group pins it: the client compares the server's certificate with the
fingerprint the leader's group names, before it sends the hello. ``AveragingConfig.encryption =
False`` (a trusted network only) makes a peer listen in plaintext; a member whose group asks for
encryption never sends to a plaintext endpoint (it falls back to libp2p for that pair).

**Fallback.** :class:`RoundConnections` is one round's Transport (net/transport.py): it opens a
direct connection where the group names an endpoint, and a stream of its fallback transport
(libp2p) where it names none or the direct connection fails (connect, TLS, fingerprint, refusal);
it then skips the direct path to that peer for ``RETRY_AFTER_S``.

Payloads are received straight into their destination (net/direct_stream.py).

The server owns one task per connection; ``close()`` stops listening, cancels them and waits.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import functools
import hashlib
import hmac
import logging
import os
import socket
import ssl
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hivemind.p2p import PeerID

from dedloc.errors import ProtocolError
from dedloc.framing import framed
from dedloc.logs import PerPeerWarnings
from dedloc.net.cooldowns import Cooldowns
from dedloc.net.direct_stream import DirectProtocol
from dedloc.auth.identity import public_key_of
from dedloc.auth.limits import PeerLimits
from dedloc.net.messages import read_message, wait_peer_closed, write_message
from dedloc.net.transport import Handler, PeerSilent, Refused, StreamPair, Transport, serve_stream
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
VERSION = 1
KEY_BYTES = 32
MAX_HELLO = 1024
CONNECT_WAIT = 3.0
"""Longest a connection (TCP and TLS handshake) may take before the pair falls back to libp2p."""
HELLO_WAIT = 5.0
NONCE_TTL = 600.0
"""How long a hello's nonce is remembered (longer than a round or a grant lives)."""
MAX_NONCES = 1 << 20
RETRY_AFTER_S = 60.0
READ_LIMIT = 1 << 20
"""asyncio's reader buffer before it pauses the socket (its 64 KiB default cost TLS reads a pause per 128 KiB)."""
CLOSE_WAIT = 60.0
MAX_CONNECTIONS_PER_PEER = 64
RATE_PER_PEER = 100.0
BURST_PER_PEER = 400.0
GRANT_TTL = 120.0
"""How long a grant (net/peer_connections.py) admits its peer's connections."""
_HELLO, _OK, _SIGNED = b"dedloc tcp hello\x00", b"dedloc tcp ok\x00", b"dedloc tcp hello signed\x00"

RoundKeys = Callable[[bytes], Awaitable["tuple[bytes, frozenset[str]] | None"]]
"""``keys(round_id)``: the round's secret and its members' peer ids, once this peer serves the round
(waiting briefly for it to start), or None if it does not."""


@dataclass(frozen=True)
class Endpoint:
    """Where a peer accepts direct connections: ``host:port/<sha256 of its certificate>`` (or
    ``/plain`` for a plaintext endpoint)."""

    host: str
    port: int
    fingerprint: str | None

    def to_wire(self) -> str:
        return f"{self.host}:{self.port}/{self.fingerprint or 'plain'}"

    @classmethod
    def parse(cls, text: str) -> "Endpoint":
        """The endpoint ``text`` names; ProtocolError if it is malformed."""
        try:
            where, fp = text.rsplit("/", 1)
            host, port = where.rsplit(":", 1)
            port_n = int(port)
        except (ValueError, AttributeError):
            raise ProtocolError(f"malformed data endpoint {text!r}") from None
        if not (0 < port_n < 65536) or not host or len(text) > 200:
            raise ProtocolError(f"malformed data endpoint {text!r}")
        if fp != "plain" and (len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp)):
            raise ProtocolError(f"malformed certificate fingerprint in data endpoint {text!r}")
        return cls(host.strip("[]"), port_n, None if fp == "plain" else fp)


class _Certificate:
    """A throwaway self-signed certificate (ECDSA P-256) and the TLS 1.3 contexts that use it."""

    def __init__(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dedloc data plane")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=3650))
                .sign(key, hashes.SHA256()))
        self.fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
        self.server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server.minimum_version = ssl.TLSVersion.TLSv1_3
        with tempfile.TemporaryDirectory(prefix="dedloc-tls-") as scratch:  # ssl loads keys from files only
            cert_path, key_path = os.path.join(scratch, "cert.pem"), os.path.join(scratch, "key.pem")
            with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
            with open(cert_path, "wb") as f:
                f.write(cert.public_bytes(serialization.Encoding.PEM))
            self.server.load_cert_chain(cert_path, key_path)
        self.client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.client.minimum_version = ssl.TLSVersion.TLSv1_3
        self.client.check_hostname = False
        self.client.verify_mode = ssl.CERT_NONE  # pinned below, by fingerprint, against the group's


def _mac(key: bytes, *parts: bytes | str) -> bytes:
    return hmac.new(key, framed(*parts), hashlib.sha256).digest()


@dataclass(frozen=True)
class _Info:
    """What a stream handler learns about the remote peer (as from a libp2p stream)."""

    peer_id: PeerID
    addr: Any


def _signed(r: bytes, p: str, f: str, t: str, n: bytes) -> bytes:
    return framed(_SIGNED, r, p, f, t, n)


class DirectTCP:
    """This peer's direct connections: a listener (if it is reachable) and the client side.

    ``sign``: this peer's identity key's signing function (its hellos carry the signature, and
    hellos it serves must carry their sender's); None only for the transport's own tests, which
    run without identities. ``admits(peer)``: whether a peer is a member of the run."""

    def __init__(self, me: str, encryption: bool = True, sign: Callable[[bytes], bytes] | None = None,
                 admits: Callable[[str], bool] | None = None):
        self.me, self.encryption = me, encryption
        self._sign, self._admits = sign, admits or (lambda peer: True)
        self._nonces: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._cert = _Certificate()
        self.endpoint: Endpoint | None = None
        """Where others connect (None: this peer does not listen, e.g. in client mode)."""
        self._server: asyncio.Server | None = None
        self._tasks = Tasks("direct connections")
        self._failed = Cooldowns()
        self._handlers: dict[str, Handler] = {}
        self._limits = PeerLimits(RATE_PER_PEER, BURST_PER_PEER, MAX_CONNECTIONS_PER_PEER)
        self._warnings = PerPeerWarnings(logger)
        self._grants: dict[bytes, tuple[bytes, str, frozenset[str], float]] = {}
        """Grants outside rounds: id -> (secret, peer, protocols, monotonic expiry); one per peer."""

    # ---- serving ------------------------------------------------------------------------------------
    async def serve(self, protocol: str, handler: Handler) -> None:
        """Hand admitted direct connections for ``protocol`` to ``handler(info, reader, writer)``;
        the connection is closed when it returns (after the close rule's wait if it wrote last)."""
        self._handlers[protocol] = handler

    async def listen(self, bind: str, announce: str, port: int, keys: RoundKeys) -> Endpoint:
        """Accept direct connections on ``bind:port`` (0: any free port), announced as ``announce``,
        for the rounds ``keys`` knows."""
        loop = asyncio.get_running_loop()
        ctx = self._cert.server if self.encryption else None

        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._tasks.spawn(self._serve(reader, writer, keys), name="dedloc-direct-serve")

        self._server = await loop.create_server(lambda: DirectProtocol(loop, READ_LIMIT, connected), bind, port,
                                                ssl=ctx, ssl_handshake_timeout=CONNECT_WAIT if ctx else None)
        bound = self._server.sockets[0].getsockname()[1]
        self.endpoint = Endpoint(announce, bound, self._cert.fingerprint if self.encryption else None)
        logger.info(f"direct data connections on {bind}:{bound} ({'TLS 1.3' if self.encryption else 'plaintext'}), "
                    f"announced as {self.endpoint.host}:{bound}")
        return self.endpoint

    def grant(self, peer_id: str, protocols: frozenset[str], lifetime: float) -> tuple[bytes, bytes]:
        """Admit ``peer_id``'s connections for ``protocols`` for ``lifetime`` seconds, outside any
        round: (grant id, secret), to be handed to it over an authenticated channel. It replaces the
        peer's previous grant, so there is at most one per peer."""
        now = time.monotonic()
        for gid, (_, peer, _, until) in list(self._grants.items()):
            if peer == peer_id or until <= now:
                del self._grants[gid]
        grant_id, key = os.urandom(16), os.urandom(KEY_BYTES)
        self._grants[grant_id] = (key, peer_id, protocols, now + lifetime)
        return grant_id, key

    async def _admission(self, r: bytes, p: str, keys: RoundKeys) -> tuple[bytes, frozenset[str]]:
        """The secret and the admitted peers for round (or grant) ``r`` and protocol ``p``; raises
        ProtocolError if there are none."""
        granted = self._grants.get(r)
        if granted is not None:
            key, peer, protocols, until = granted
            if until <= time.monotonic() or p not in protocols:
                raise ProtocolError("the grant has expired" if until <= time.monotonic()
                                    else f"the grant does not cover {p!r}")
            return key, frozenset((peer,))
        found = await keys(r)
        if found is None:
            raise ProtocolError("unknown round or grant (missed or expired)")
        return found

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keys: RoundKeys) -> None:
        addr = writer.get_extra_info("peername")
        handler: Handler | None = None

        async def admit() -> tuple[Any, Callable[[], None]]:
            nonlocal handler
            claimed = f"address {addr[0] if addr else 'unknown'}"  # who is refused, until a signature says
            budget = None
            try:
                _tune(writer)
                hello = await asyncio.wait_for(read_message(reader, MAX_HELLO), HELLO_WAIT)
                if not isinstance(hello, dict) or hello.get("v") != VERSION:
                    raise ProtocolError(f"not a dedloc direct-connection hello (version {VERSION})")
                r, p, f, t, n, m, s = (hello.get(k) for k in ("r", "p", "f", "t", "n", "m", "s"))
                if not (isinstance(r, bytes) and isinstance(p, str) and isinstance(f, str) and isinstance(t, str)
                        and isinstance(n, bytes) and isinstance(m, bytes) and len(r) == 16 and len(n) == 16
                        and len(f) <= 128 and len(p) <= 128 and (s is None or isinstance(s, bytes) and len(s) <= 64)):
                    raise ProtocolError("malformed hello")
                if t != self.me:
                    raise ProtocolError(f"the hello is addressed to {t}, not to this peer")
                if self._sign is not None:
                    try:
                        public_key_of(f).verify(s or b"", _signed(r, p, f, t, n))
                    except (ValueError, InvalidSignature):
                        raise ProtocolError(f"the hello is not signed by {f}, the peer it names") from None
                if not self._admits(f):
                    raise ProtocolError(f"{f} is not a member of this run (no invitation it has shown this peer)")
                if self._sign is not None:
                    claimed = f  # a member, proven by its signature
                self._remember(r + n)
                budget = self._limits.acquire(f)
                if budget is None:
                    raise ProtocolError(f"too many direct connections from this peer ({self._limits.describe()})")
                handler = self._handlers.get(p)
                if handler is None:
                    raise ProtocolError(f"this peer serves no {p!r} over direct connections")
                key, members = await self._admission(r, p, keys)
                if f not in members:
                    raise ProtocolError(f"{f} is not a member of this round (or the holder of this grant)")
                if not hmac.compare_digest(m, _mac(key, _HELLO, r, p, f, t, n)):
                    raise ProtocolError("the hello's MAC does not check with the round's (or grant's) key")
                claimed = f
            except ProtocolError as e:
                if budget is not None:
                    self._limits.release(budget)

                async def answer(why: str = str(e)) -> None:
                    await write_message(writer, {"refused": why})
                    await wait_peer_closed(reader, HELLO_WAIT)

                raise Refused(claimed, f"{e} (connection from {addr[0] if addr else 'an unknown address'})",
                              answer) from None
            await write_message(writer, {"ok": _mac(key, _OK, n)})
            return _Info(PeerID.from_base58(f), addr), lambda: self._limits.release(budget)

        async def handle(info: Any, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool | None:
            return await handler(info, r, w)

        await serve_stream("direct", admit, handle, reader, writer, CLOSE_WAIT, self._warnings, logger)

    def _remember(self, nonce: bytes) -> None:
        """Admit a hello's (round or grant id, nonce) once within NONCE_TTL (ProtocolError for a replay;
        a full memory refuses too, rather than forget a nonce still in its window)."""
        now = time.monotonic()
        while self._nonces and next(iter(self._nonces.values())) < now:
            self._nonces.popitem(last=False)
        if nonce in self._nonces:
            raise ProtocolError("the hello was already received (a replay)")
        if len(self._nonces) >= MAX_NONCES:
            raise ProtocolError(f"this peer remembers {MAX_NONCES} recent hellos already")
        self._nonces[nonce] = now + NONCE_TTL

    # ---- connecting ---------------------------------------------------------------------------------
    def usable(self, peer_id: str) -> bool:
        """False for a while after a direct connection to ``peer_id`` failed (libp2p is used then)."""
        return not self._failed.active(peer_id)

    async def open(self, peer_id: str, protocol: str, endpoint: Endpoint, round_id: bytes, key: bytes,
                   require_encryption: bool) -> StreamPair:
        """A stream to ``peer_id`` for round ``round_id``, admitted by it. Raises ConnectionError
        naming the reason on any failure (the caller falls back to libp2p; so will later calls,
        for RETRY_AFTER_S)."""
        try:
            if endpoint.fingerprint is None and require_encryption:
                raise ConnectionError("its data endpoint is plaintext and this round requires encryption")
            ctx = self._cert.client if endpoint.fingerprint is not None else None
            loop = asyncio.get_running_loop()
            transport, proto = await asyncio.wait_for(
                loop.create_connection(lambda: DirectProtocol(loop, READ_LIMIT), endpoint.host, endpoint.port,
                                       ssl=ctx, server_hostname="dedloc" if ctx else None), CONNECT_WAIT)
            reader, writer = proto.reader, asyncio.StreamWriter(transport, proto, proto.reader, loop)
        except (OSError, asyncio.TimeoutError, ssl.SSLError, ConnectionError) as e:
            self._give_up(peer_id, f"cannot connect to {endpoint.host}:{endpoint.port}: {e!r}")
        try:
            _tune(writer)
            if ctx is not None:
                der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                if hashlib.sha256(der or b"").hexdigest() != endpoint.fingerprint:
                    raise ProtocolError("its certificate is not the one its group names")
            nonce = os.urandom(16)
            hello = {"v": VERSION, "r": round_id, "p": protocol, "f": self.me, "t": peer_id, "n": nonce,
                     "m": _mac(key, _HELLO, round_id, protocol, self.me, peer_id, nonce)}
            if self._sign is not None:
                hello["s"] = self._sign(_signed(round_id, protocol, self.me, peer_id, nonce))
            await write_message(writer, hello)
            answer = await asyncio.wait_for(read_message(reader, MAX_HELLO), HELLO_WAIT)
            if isinstance(answer, dict) and isinstance(answer.get("refused"), str):
                raise ProtocolError(f"it refused: {answer['refused'][:200]}")
            if not (isinstance(answer, dict) and isinstance(answer.get("ok"), bytes)
                    and hmac.compare_digest(answer["ok"], _mac(key, _OK, nonce))):
                raise ProtocolError("its answer does not prove it holds the round's key")
            return reader, writer
        except BaseException as e:
            writer.close()
            if isinstance(e, (ProtocolError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                              ssl.SSLError)):
                self._give_up(peer_id, f"{type(e).__name__}: {e}")
            raise

    def avoid(self, peer_id: str, why: str) -> None:
        """Use libp2p streams to ``peer_id`` for ``RETRY_AFTER_S`` (``usable`` is False until then);
        logged at INFO, once per peer and minute."""
        self._failed.start(peer_id, RETRY_AFTER_S)
        self._warnings.warn(f"{peer_id} open", f"direct connection to {peer_id} failed ({why}); using libp2p "
                                               f"streams to it for {RETRY_AFTER_S:.0f} s", level=logging.INFO)

    def _give_up(self, peer_id: str, why: str) -> None:
        self.avoid(peer_id, why)
        raise ConnectionError(f"direct connection to {peer_id} failed: {why}")

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop listening and end every connection being served."""
        if self._server is not None:
            self._server.close()
        await self._tasks.close()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5)
            except asyncio.TimeoutError:
                pass


class RoundConnections(Transport):
    """One round's streams: direct where the group names the member's endpoint and a direct
    connection works, else the ``fallback`` transport's (module doc). Counts both in ``counts``.

    A member that took a stream but never answered its hello (PeerSilent: frozen, a sleeping laptop)
    is asked nothing more in this round: ``open`` raises PeerSilent for it at once, so the round's
    next fallback (a part's aggregator instead of its frozen backup) starts without another wait:
    a frozen peer that aggregates one part and backs up another would otherwise cost a wait on the
    pull of its part and another on the failover to it, past the round's deadline. A later round
    asks the member again."""

    def __init__(self, tcp: DirectTCP | None, round_id: bytes, key: bytes, endpoints: dict[str, str],
                 encryption: bool, fallback: Transport, counts: dict[str, int]):
        self.tcp, self.round_id, self.key, self.endpoints = tcp, round_id, key, endpoints
        self.encryption, self.fallback, self.counts = encryption, fallback, counts
        self.silent: dict[str, str] = {}
        """Members that did not answer a hello in this round, with the first failure's message."""

    async def open(self, peer_id: str, protocol: str) -> StreamPair:
        why = self.silent.get(peer_id)
        if why is not None:
            raise PeerSilent(f"{why}, earlier in this round: not asked again")
        data = self.endpoints.get(peer_id, "")
        direct = self.tcp is not None and self.key and data and self.tcp.usable(peer_id)
        try:
            return await open_with_fallback(peer_id, protocol, functools.partial(self._direct, peer_id, protocol,
                                                                                 data) if direct else None,
                                            self.fallback, self.counts)
        except PeerSilent as e:
            self.silent.setdefault(peer_id, str(e))
            raise

    async def _direct(self, peer_id: str, protocol: str, data: str) -> StreamPair:
        assert self.tcp is not None
        return await self.tcp.open(peer_id, protocol, Endpoint.parse(data), self.round_id, self.key, self.encryption)

    async def serve(self, protocol: str, handler: Handler) -> None:
        raise NotImplementedError("a round's connections only open streams; DirectTCP and the node serve them")


async def open_with_fallback(peer_id: str, protocol: str, direct: Callable[[], Awaitable[StreamPair]] | None,
                             fallback: Transport, counts: dict[str, int]) -> StreamPair:
    """The per-pair fallback, for every transport that prefers direct connections: ``direct()``'s
    stream (None: no direct path to this peer now), else, or when it fails (ConnectionError,
    ProtocolError, a timeout), ``fallback``'s; counted in ``counts["direct"]`` / ``counts["libp2p"]``."""
    if direct is not None:
        try:
            stream = await direct()
            counts["direct"] = counts.get("direct", 0) + 1
            return stream
        except (ConnectionError, ProtocolError, asyncio.TimeoutError) as e:
            logger.debug(f"no direct stream to {peer_id} for {protocol} ({e}); a libp2p stream instead")
    stream = await fallback.open(peer_id, protocol)
    counts["libp2p"] = counts.get("libp2p", 0) + 1
    return stream


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


__all__ = ["DirectTCP", "Endpoint", "RoundConnections", "open_with_fallback", "KEY_BYTES", "RETRY_AFTER_S",
           "GRANT_TTL"]
