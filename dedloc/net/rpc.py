"""Small request/response messages over libp2p streams: length-prefixed msgpack.

Guarantees: a message above ``MAX_MESSAGE`` bytes or one that is not valid msgpack raises
:class:`ProtocolError`; every call has a deadline; the remote peer id given to handlers is
the one libp2p authenticated, never a claim from the message.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import msgpack
from hivemind.p2p import P2P, PeerID

from dedloc.errors import ProtocolError

logger = logging.getLogger(__name__)
MAX_MESSAGE = 1 << 20

Handler = Callable[[PeerID, Any], Awaitable[Any]]


async def write_message(writer: asyncio.StreamWriter, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()


async def read_message(reader: asyncio.StreamReader) -> Any:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_MESSAGE:
        raise ProtocolError(f"message of {size} bytes exceeds {MAX_MESSAGE}")
    data = await reader.readexactly(size)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from None


async def wait_peer_closed(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Wait (bounded) until the peer closes its side of the stream; discard anything it still sends.

    Whoever writes last on a stream must call this before closing: if we close first, the p2p
    daemon may reset the stream and drop the tail of what we wrote that is still in flight.
    The reading side closes as soon as it has read everything, so this returns once our data
    has arrived. Returns False on timeout or error (the caller closes anyway).
    """
    try:
        async with asyncio.timeout(max(0.0, timeout)):
            while await reader.read(1 << 16):
                pass
        return True
    except (TimeoutError, ConnectionError, OSError):
        return False


async def reply_last(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, obj: Any,
                     timeout: float = 10.0) -> None:
    """Write a final message, then wait (bounded) for the peer to close (see ``wait_peer_closed``)."""
    await write_message(writer, obj)
    await wait_peer_closed(reader, timeout)


PUNCH_WAIT = 3.0
"""Longest a stream waits for a hole-punched direct connection when the only one is relayed."""
UNPUNCHED_S = 60.0
"""After a wait that brought no direct connection, streams to that peer go through the relay at
once for this long (a NAT that punching cannot pass would otherwise cost every stream the wait)."""
_POLL = 0.1
_unpunched: dict[PeerID, float] = {}
"""Peer -> until when (loop time) its streams skip the wait. Lives in the runtime process."""


def relayed(addr: Any) -> bool:
    """The multiaddr goes through a relay (a circuit address)."""
    return "/p2p-circuit" in str(addr)


async def connections(p2p: P2P) -> dict[str, list[str]]:
    """The daemon's open connections: peer id -> the remote address of each connection to it."""
    out: dict[str, list[str]] = {}
    for info in await p2p.list_peers():
        out.setdefault(info.peer_id.to_base58(), []).extend(map(str, info.addrs))
    return out


async def _relayed_only(p2p: P2P, peer_id: PeerID) -> bool:
    addrs = (await connections(p2p)).get(peer_id.to_base58(), [])
    return bool(addrs) and all(map(relayed, addrs))


async def open_stream(p2p: P2P, peer_id: PeerID, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to ``peer_id`` under protocol ``name``: the one way every dedloc stream is opened.

    When the only connection to the peer goes through a relay (it is behind NAT and was dialled
    through its circuit address), this waits up to ``PUNCH_WAIT`` seconds for the direct connection
    that hole punching (DCUtR) brings, so that the stream's bytes do not stay on the relay; if none
    comes, the stream goes through the relay, and so do the peer's streams for ``UNPUNCHED_S``
    seconds without waiting. Each outcome is logged at INFO. Raises the daemon's error if the peer
    is unreachable."""
    loop = asyncio.get_running_loop()
    if _unpunched.get(peer_id, -1.0) < loop.time() and await _relayed_only(p2p, peer_id):
        started = loop.time()
        relayed = True
        while relayed and loop.time() < started + PUNCH_WAIT:
            await asyncio.sleep(_POLL)  # the daemon has no event for a new connection
            relayed = await _relayed_only(p2p, peer_id)
        if relayed:
            _unpunched[peer_id] = loop.time() + UNPUNCHED_S
            for peer in [p for p, until in _unpunched.items() if until < loop.time()]:
                del _unpunched[peer]
            logger.info(f"no direct path to {peer_id} after {PUNCH_WAIT:.0f} s of hole punching: its streams go "
                        f"through the relay")
        else:
            logger.info(f"direct connection to {peer_id} after hole punching ({loop.time() - started:.2f} s)")
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, name)
    return reader, writer


async def call(p2p: P2P, peer_id: PeerID, name: str, request: Any, timeout: float) -> Any:
    """Send one request and wait for one response; raises TimeoutError, ConnectionError or ProtocolError."""

    async def _call() -> Any:
        reader, writer = await open_stream(p2p, peer_id, name)
        try:
            await write_message(writer, request)
            return await read_message(reader)
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(_call(), timeout)
    except asyncio.IncompleteReadError:
        raise ConnectionError(f"peer {peer_id} closed the stream on {name}") from None


async def serve(p2p: P2P, name: str, handler: Handler, *, stream_info: bool = False) -> None:
    """Register ``handler(remote_peer_id, request) -> response`` under protocol ``name``.

    With ``stream_info``, the handler gets the stream's ``StreamInfo`` (the authenticated peer id
    and the address its connection comes from) instead of the peer id."""

    async def _on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(read_message(reader), 10.0)
            response = await handler(info if stream_info else info.peer_id, request)
            await reply_last(reader, writer, response)
        except ProtocolError as e:
            logger.warning(f"rejected {name} request from {info.peer_id}: {e}")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            logger.debug(f"{name} stream from {info.peer_id} closed early")
        except Exception:
            logger.exception(f"handler {name} failed on a request from {info.peer_id}")
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(name, _on_stream)
