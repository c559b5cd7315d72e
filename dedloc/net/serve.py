"""Opening and serving dedloc's stream protocols: the one place every stream goes through.

Every stream starts with a hello: the opener sends ``{"v": STREAM_VERSION, "c": credential}``
(msgpack, at most ``MAX_HELLO`` bytes) and the server answers ``{"ok": true}`` or
``{"refused": reason}`` before either side sends anything else. The server decides, in this order,
and reads nothing more from a peer it refuses:

1. the hello arrives within ``HELLO_WAIT`` and is well formed, with our protocol version;
2. the remote peer (its id from libp2p's authenticated channel) is a member: the authorizer
   checks the credential it presented (auth/authorizer.py);
3. the peer is within its limits: at most ``MAX_STREAMS_PER_PEER`` streams open at once and
   ``RATE_PER_PEER`` new ones per second (bursts of ``BURST_PER_PEER``), over all protocols.

Then the protocol's handler runs. The error ladder is here, once: a ProtocolError (including
Unauthorized) is logged at WARNING with the peer id (once per peer and protocol per minute; the rest
at DEBUG),
a broken or timed-out stream at DEBUG, anything else with its traceback. The close rule is here
too: a handler that wrote last returns True, and the stream stays open (bounded) until the opener
has closed its side, so the daemon cannot drop the tail of what it wrote.

The opener's side (:meth:`Streams.open`) raises Unauthorized or ProtocolError with the server's
reason, ConnectionError if no answer comes within ``ACK_WAIT``, and waits (bounded) for a
hole-punched direct connection when the only one is relayed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from dedloc.auth.authorizer import Authorizer, OpenRun
from dedloc.errors import ProtocolError, Unauthorized
from dedloc.logs import PerPeerWarnings
from dedloc.auth.limits import PeerLimits
from dedloc.net.transport import PeerSilent, Refused, Transport, serve_stream
from dedloc.net.messages import read_message, reply_last, write_message
from dedloc.net.links import connections, relayed
from dedloc.net.cooldowns import Cooldowns

logger = logging.getLogger(__name__)
STREAM_VERSION = 1
MAX_HELLO = 4096
HELLO_WAIT = 10.0
ACK_WAIT = 5.0
"""Longest an opener waits for the server's answer to its hello: the daemon accepts a stream for a
peer whose process is frozen, and every caller must see that as the broken connection it is."""
MAX_STREAMS_PER_PEER = 32
RATE_PER_PEER = 50.0
BURST_PER_PEER = 200.0
CLOSE_WAIT = 60.0
"""Longest a handler that wrote last waits for the opener to close."""
PUNCH_WAIT = 3.0
"""Longest a stream waits for a hole-punched direct connection when the only one is relayed."""
UNPUNCHED_S = 60.0
"""After a wait that brought no direct connection, streams to that peer go through the relay at
once for this long (a NAT that punching cannot pass would otherwise cost every stream the wait)."""
_POLL = 0.1

StreamHandler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]
"""``handler(info, reader, writer)``: ``info.peer_id`` is the authenticated remote peer, ``info.addr``
where its connection comes from. Returns True if it wrote last (see the close rule)."""
RequestHandler = Callable[[PeerID, Any], Awaitable[Any]]


class Streams(Transport):
    """This peer's stream transport over the libp2p daemon: opens streams to peers and serves
    protocols, with membership and per-peer limits checked on every inbound stream."""

    def __init__(self, p2p: P2P, authorizer: Authorizer | None = None):
        self.p2p = p2p
        self.authorizer = authorizer or OpenRun()
        self.limits = PeerLimits(RATE_PER_PEER, BURST_PER_PEER, MAX_STREAMS_PER_PEER)
        self._unpunched = Cooldowns()
        self.warnings = PerPeerWarnings(logger)

    # ---- the opener's side ------------------------------------------------------------------------
    async def open(self, peer_id: PeerID | str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to ``peer_id`` under protocol ``name``, admitted by the peer. Raises ConnectionError
        if the peer cannot be reached, Unauthorized / ProtocolError with the peer's reason if it refuses.
        Callers bound it with their own deadline."""
        if isinstance(peer_id, str):
            peer_id = PeerID.from_base58(peer_id)
        await self._await_direct(peer_id)
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, name)
        except P2PDaemonError as e:
            raise ConnectionError(f"cannot reach {peer_id}: {type(e).__name__}: {e}") from None
        try:
            await write_message(writer, {"v": STREAM_VERSION, "c": self.authorizer.credential()})
            answer = await asyncio.wait_for(read_message(reader), ACK_WAIT)
        except asyncio.IncompleteReadError:
            writer.close()
            raise ConnectionError(f"peer {peer_id} closed the stream on {name}") from None
        except asyncio.TimeoutError:  # a frozen peer (a stopped laptop): its daemon took the stream, it is silent
            writer.close()
            raise PeerSilent(f"peer {peer_id} did not answer the hello on {name} within {ACK_WAIT:.0f} s") from None
        except BaseException:
            writer.close()
            raise
        if isinstance(answer, dict) and answer.get("ok") is True:
            return reader, writer
        writer.close()
        reason = answer.get("refused") if isinstance(answer, dict) else None
        if isinstance(reason, str) and answer.get("member") is False:
            raise Unauthorized(f"peer {peer_id} refused {name}: {reason[:300]}")
        raise ProtocolError(f"peer {peer_id} refused {name}: {str(reason)[:300] if reason else repr(answer)[:100]}")

    async def _await_direct(self, peer_id: PeerID) -> None:
        """When the only connection to the peer goes through a relay (it is behind NAT and was dialled
        through its circuit address), wait up to ``PUNCH_WAIT`` seconds for the direct connection that
        hole punching (DCUtR) brings, so that the stream's bytes do not stay on the relay; if none
        comes, the peer's streams go through the relay for ``UNPUNCHED_S`` seconds without waiting.
        Each outcome is logged at INFO."""
        loop = asyncio.get_running_loop()
        if self._unpunched.active(peer_id) or not await self._relayed_only(peer_id):
            return
        started, still = loop.time(), True
        while still and loop.time() < started + PUNCH_WAIT:
            await asyncio.sleep(_POLL)  # the daemon has no event for a new connection
            still = await self._relayed_only(peer_id)
        if still:
            self._unpunched.start(peer_id, UNPUNCHED_S)
            logger.info(f"no direct path to {peer_id} after {PUNCH_WAIT:.0f} s of hole punching: its streams go "
                        f"through the relay")
        else:
            logger.info(f"direct connection to {peer_id} after hole punching ({loop.time() - started:.2f} s)")

    async def _relayed_only(self, peer_id: PeerID) -> bool:
        addrs = (await connections(self.p2p)).get(peer_id.to_base58(), [])
        return bool(addrs) and all(map(relayed, addrs))

    async def call(self, peer_id: PeerID | str, name: str, request: Any, timeout: float) -> Any:
        """Send one request and wait for one response (a ``serve_requests`` protocol); raises
        TimeoutError, ConnectionError, Unauthorized or ProtocolError."""

        async def _call() -> Any:
            reader, writer = await self.open(peer_id, name)
            try:
                await write_message(writer, request)
                return await read_message(reader)
            finally:
                writer.close()

        try:
            return await asyncio.wait_for(_call(), timeout)
        except asyncio.IncompleteReadError:
            raise ConnectionError(f"peer {peer_id} closed the stream on {name}") from None

    # ---- the server's side --------------------------------------------------------------------------
    async def serve(self, name: str, handler: StreamHandler, close_wait: float = CLOSE_WAIT) -> None:
        """Serve protocol ``name``: every stream is admitted (module docstring), then handled."""

        async def _on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async def admit() -> tuple[Any, Callable[[], None]]:
                peer = info.peer_id.to_base58()
                refusal, member = await self._admit(peer, reader)
                budget = self.limits.acquire(peer) if refusal is None else None
                if refusal is None and budget is None:
                    refusal = f"too many streams from this peer ({self.limits.describe()})"
                if refusal is not None:
                    raise Refused(peer, refusal, lambda: reply_last(reader, writer, {"refused": refusal,
                                                                                    "member": member}, HELLO_WAIT))
                await write_message(writer, {"ok": True})
                return info, lambda: self.limits.release(budget)

            try:
                await serve_stream(name, admit, handler, reader, writer, close_wait, self.warnings, logger)
            except asyncio.CancelledError:
                # The daemon's task for this stream is cancelled when the peer shuts down. Python 3.11's
                # stream callback then logs a traceback ("Exception in callback"), as if it crashed: the
                # task ends here instead, quietly (nothing awaits its outcome).
                writer.close()

        await self.p2p.add_binary_stream_handler(name, _on_stream)

    async def _admit(self, peer: str, reader: asyncio.StreamReader) -> tuple[str | None, bool]:
        """(None, True) if the hello admits the peer; else (the reason, whether it is a member)."""
        try:
            hello = await asyncio.wait_for(read_message(reader, MAX_HELLO), HELLO_WAIT)
        except ProtocolError as e:
            return f"malformed hello: {e}", True
        if not isinstance(hello, dict) or hello.get("v") != STREAM_VERSION:
            theirs = hello.get("v") if isinstance(hello, dict) else None
            return f"stream protocol version mismatch: ours is {STREAM_VERSION}, theirs is {theirs!r}", True
        credential = hello.get("c")
        if credential is not None and not isinstance(credential, str):
            return "malformed hello: the credential is not a string", True
        try:
            self.authorizer.admit(peer, credential)
        except Unauthorized as e:
            return str(e), False
        return None, True

    async def serve_requests(self, name: str, handler: RequestHandler, *, stream_info: bool = False,
                             read_wait: float = 10.0) -> None:
        """Serve ``handler(remote_peer_id, request) -> response`` under ``name`` (one msgpack message
        each way). With ``stream_info`` the handler gets the stream's info (the authenticated peer id
        and the address its connection comes from) instead of the peer id."""

        async def _on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            request = await asyncio.wait_for(read_message(reader), read_wait)
            response = await handler(info if stream_info else info.peer_id, request)
            await write_message(writer, response)
            return True

        await self.serve(name, _on_stream, close_wait=10.0)
