"""Light active bandwidth probes between peers (protocol ``dedloc.{run}.probe``).

A probe is one stream: the prober sends ``{v, dir, n}``; for ``push`` it then streams ``n``
bytes and the probed peer answers with the seconds between the first and the last byte it
received; for ``pull`` the probed peer streams ``n`` bytes and the prober times them. The bytes
are paced by the receiver's credits like every payload (dedloc.net.bulk), so a probe on a slow
uplink never queues more than about a second of data in front of other traffic. Timing at
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


from dedloc.averaging.wire import VERSION
from dedloc.errors import ProtocolError
from dedloc.net import bulk, messages
from dedloc.net.node import Node
from dedloc.net.transport import Transport

logger = logging.getLogger(__name__)
MAX_PROBE_BYTES = 64 << 20
MAX_SERVED = 2
CHUNK = 1 << 20


@dataclass
class ProbeResult:
    """Rates in bytes/s: per peer (``pushed`` to it, ``pulled`` from it) and all streams together."""

    pushed: dict[str, float] = field(default_factory=dict)
    pulled: dict[str, float] = field(default_factory=dict)
    upload: float = 0.0
    download: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)
    queue_s: float = 0.0
    """The longest queueing delay a pushed probe saw (write to credit; dedloc.net.bulk)."""


Trace = list[tuple[float, int]]


async def _send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> float:
    """Write ``n`` paced bytes; returns the queueing delay they saw."""
    return (await bulk.send_paced(writer, reader, memoryview(bytes(n)), CHUNK)).queue_s


async def _receive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int,
                   trace: Trace | None = None) -> float:
    """Read ``n`` paced bytes; seconds from the first byte to the last. ``trace`` gets (time, bytes so far)."""
    trace = [] if trace is None else trace
    await bulk.recv_into(reader, writer, memoryview(bytearray(n)),
                         on_progress=lambda done: trace.append((time.perf_counter(), done)))
    (t0, b0), (t1, _) = trace[0], trace[-1]
    # the first read's bytes arrived before the clock started: time only the rest
    return (t1 - t0) * n / (n - b0) if t1 > t0 and b0 < n else max(t1 - t0, 1e-6)


def _bytes_at(trace: Trace, t: float) -> float:
    """Bytes a stream had received at time ``t`` (linear between samples)."""
    prev_t, prev_b = trace[0]
    for tt, b in trace:
        if tt >= t:
            return prev_b + (b - prev_b) * ((t - prev_t) / (tt - prev_t) if tt > prev_t else 1.0)
        prev_t, prev_b = tt, b
    return trace[-1][1]


def concurrent_rate(traces: list[Trace]) -> float | None:
    """Total bytes/s while every stream was receiving at once (None if that window is too short).

    Streams from slow and fast peers finish at different times; only the window in which all
    were active shows what this peer's own link carries when it is the bottleneck.
    """
    traces = [t for t in traces if len(t) > 1]
    if not traces:
        return None
    start, end = max(t[0][0] for t in traces), min(t[-1][0] for t in traces)
    if end - start < 0.1:  # shorter windows are dominated by bursts (tbf buckets, socket buffers)
        return None
    return sum(_bytes_at(t, end) - _bytes_at(t, start) for t in traces) / (end - start)


class ProbeServer:
    """Answers other peers' probes."""

    def __init__(self, node: Node, transport: Transport):
        self.node, self.transport = node, transport
        self.proto = f"dedloc.{node.config.run_id}.probe"
        self._served = asyncio.Semaphore(MAX_SERVED)

    async def start(self) -> None:
        if not self.node.config.client_mode:
            await self.transport.serve(self.proto, self._on_stream)

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        req = await asyncio.wait_for(messages.read_message(reader), 10)
        if not isinstance(req, dict) or req.get("v") != VERSION or req.get("dir") not in ("push", "pull") \
                or not isinstance(req.get("n"), int) or not 0 < req["n"] <= MAX_PROBE_BYTES:
            raise ProtocolError(f"malformed probe request (protocol {VERSION}, at most {MAX_PROBE_BYTES} bytes)")
        if self._served.locked():
            await messages.write_message(writer, {"busy": True})
            return True
        async with self._served:
            await messages.write_message(writer, {"ok": True})
            async with asyncio.timeout(120):
                if req["dir"] == "push":
                    await messages.write_message(writer, {"s": await _receive(reader, writer, req["n"])})
                else:
                    await _send(reader, writer, req["n"])
                await messages.wait_peer_closed(reader, 60)  # we wrote last: the prober closes first
        return False


async def _one(transport: Transport, proto: str, peer: str, direction: str, n: int, trace: Trace,
               result: ProbeResult) -> float:
    """One probe stream; the seconds the receiving end timed."""
    reader, writer = await transport.open(peer, proto)
    try:
        await messages.write_message(writer, {"v": VERSION, "dir": direction, "n": n})
        head = await messages.read_message(reader)
        if not isinstance(head, dict) or not head.get("ok"):
            raise ProtocolError("busy" if isinstance(head, dict) and head.get("busy") else f"refused: {head!r}")
        if direction == "push":
            result.queue_s = max(result.queue_s, await _send(reader, writer, n))
            answer = await messages.read_message(reader)
            seconds = answer.get("s") if isinstance(answer, dict) else None
            if not isinstance(seconds, float) or not 0 < seconds < 3600:
                raise ProtocolError(f"malformed probe answer {answer!r}")
            return seconds
        return await _receive(reader, writer, n, trace)
    finally:
        writer.close()


async def probe(transport: Transport, run_id: str, push_to: list[str], pull_from: list[str], nbytes: int,
                timeout: float = 60.0) -> ProbeResult:
    """Push ``nbytes`` to every peer of ``push_to`` at once, then pull as much from every peer of
    ``pull_from``, over ``transport`` (the path round streams take: direct where granted)."""
    proto = f"dedloc.{run_id}.probe"
    result = ProbeResult()
    for direction, rates, peers in (("push", result.pushed, push_to), ("pull", result.pulled, pull_from)):
        start = time.perf_counter()
        traces: list[Trace] = [[] for _ in peers]
        outcomes = await asyncio.gather(*(asyncio.wait_for(_one(transport, proto, p, direction, nbytes, tr, result),
                                                           timeout)
                                          for p, tr in zip(peers, traces)), return_exceptions=True)
        wall = time.perf_counter() - start
        done = 0
        for peer, out in zip(peers, outcomes):
            if isinstance(out, BaseException):
                result.failed[peer] = f"{type(out).__name__}: {out}"
            else:
                rates[peer] = nbytes / out
                done += 1
        # lower bounds of our own link: all streams over the whole wall time, the fastest one alone
        total = max([done * nbytes / wall] + list(rates.values())) if done else 0.0
        if direction == "pull" and done:
            total = max(total, concurrent_rate([tr for tr, out in zip(traces, outcomes)
                                                if not isinstance(out, BaseException)]) or 0.0)
        if direction == "push":
            result.upload = total
        else:
            result.download = total
    return result
