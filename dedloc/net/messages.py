"""Messages on a stream: length-prefixed msgpack, and the close rule's wait.

Guarantees: a message above its limit (``MAX_MESSAGE`` bytes by default) or one that is not valid
msgpack raises :class:`ProtocolError` before anything is allocated for it. Opening and serving
streams is net/serve.py's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack

from dedloc.errors import ProtocolError

logger = logging.getLogger(__name__)
MAX_MESSAGE = 1 << 20

async def write_message(writer: asyncio.StreamWriter, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()


async def read_message(reader: asyncio.StreamReader, limit: int = MAX_MESSAGE) -> Any:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > limit:
        raise ProtocolError(f"message of {size} bytes exceeds {limit}")
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
