"""Light active bandwidth probes between peers (protocol ``dedloc.{run}.probe``).

A probe is one stream: the prober sends ``{v, dir, n}``; for ``push`` it then streams ``n``
bytes and the probed peer answers with the seconds between the first and the last byte it
received; for ``pull`` the probed peer streams ``n`` bytes and the prober times them. Timing at
the receiving end measures the path, not the sender's buffers. Probes to several peers run at
once, so their sum bounds this peer's own uplink or downlink rather than the slowest path.

A peer serves at most ``MAX_SERVED`` probes at once (more get ``busy``) and refuses probes
above ``MAX_PROBE_BYTES``; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from dedloc.averaging.wire import VERSION
from dedloc.errors import ProtocolError
from dedloc.net import rpc
from dedloc.net.node import Node

logger = logging.getLogger(__name__)
MAX_PROBE_BYTES = 64 << 20
MAX_SERVED = 2
CHUNK = 1 << 20
_ZEROS = bytes(CHUNK)


@dataclass
class ProbeResult:
    """Rates in bytes/s: per peer (``pushed`` to it, ``pulled`` from it) and all streams together."""

    pushed: dict[str, float] = field(default_factory=dict)
    pulled: dict[str, float] = field(default_factory=dict)
    upload: float = 0.0
    download: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)


async def _send(writer: asyncio.StreamWriter, n: int) -> None:
    view = memoryview(_ZEROS)
    while n > 0:
        k = min(n, CHUNK)
        writer.write(view[:k])
        await writer.drain()
        n -= k


async def _receive(reader: asyncio.StreamReader, n: int) -> float:
    """Read ``n`` bytes; seconds from the first byte to the last."""
    first = None
    while n > 0:
        data = await reader.read(min(n, CHUNK))
        if not data:
            raise ConnectionError("stream ended early")
        if first is None:
            first = time.perf_counter()
        n -= len(data)
    return time.perf_counter() - first


class ProbeServer:
    """Answers other peers' probes."""

    def __init__(self, node: Node):
        self.node = node
        self.proto = f"dedloc.{node.config.run_id}.probe"
        self._served = asyncio.Semaphore(MAX_SERVED)

    async def start(self) -> None:
        if not self.node.config.client_mode:
            await self.node.p2p.add_binary_stream_handler(self.proto, self._on_stream)

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            req = await asyncio.wait_for(rpc.read_message(reader), 10)
            if not isinstance(req, dict) or req.get("v") != VERSION or req.get("dir") not in ("push", "pull") \
                    or not isinstance(req.get("n"), int) or not 0 < req["n"] <= MAX_PROBE_BYTES:
                raise ProtocolError(f"malformed probe request (protocol {VERSION}, at most {MAX_PROBE_BYTES} bytes)")
            if self._served.locked():
                await rpc.write_message(writer, {"busy": True})
                return
            async with self._served:
                await rpc.write_message(writer, {"ok": True})
                async with asyncio.timeout(120):
                    if req["dir"] == "push":
                        await rpc.write_message(writer, {"s": await _receive(reader, req["n"])})
                    else:
                        await _send(writer, req["n"])
                        await reader.read(1)  # the prober closes once it has everything
        except ProtocolError as e:
            logger.warning(f"refused a probe from {peer}: {e}")
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
            logger.debug(f"probe stream with {peer} ended early: {e!r}")
        finally:
            writer.close()


async def _one(node: Node, proto: str, peer: str, direction: str, n: int) -> float:
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), proto)
    try:
        await rpc.write_message(writer, {"v": VERSION, "dir": direction, "n": n})
        head = await rpc.read_message(reader)
        if not isinstance(head, dict) or not head.get("ok"):
            raise ProtocolError("busy" if isinstance(head, dict) and head.get("busy") else f"refused: {head!r}")
        if direction == "push":
            await _send(writer, n)
            answer = await rpc.read_message(reader)
            seconds = answer.get("s") if isinstance(answer, dict) else None
            if not isinstance(seconds, float) or not 0 < seconds < 3600:
                raise ProtocolError(f"malformed probe answer {answer!r}")
            return seconds
        return await _receive(reader, n)
    finally:
        writer.close()


async def probe(node: Node, peers: list[str], nbytes: int, timeout: float = 60.0) -> ProbeResult:
    """Push ``nbytes`` to every peer at once, then pull as much from every peer at once."""
    proto = f"dedloc.{node.config.run_id}.probe"
    result = ProbeResult()
    for direction, rates in (("push", result.pushed), ("pull", result.pulled)):
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(asyncio.wait_for(_one(node, proto, p, direction, nbytes), timeout)
                                          for p in peers), return_exceptions=True)
        wall = time.perf_counter() - start
        done = 0
        for peer, out in zip(peers, outcomes):
            if isinstance(out, BaseException):
                result.failed[peer] = f"{type(out).__name__}: {out}"
            else:
                rates[peer] = nbytes / out
                done += 1
        total = done * nbytes / wall if done else 0.0
        if direction == "push":
            result.upload = total
        else:
            result.download = total
    return result
