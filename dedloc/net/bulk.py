"""Bulk payloads over streams (libp2p's, or direct TCP): paced writes and zero-copy reads.

**Pacing.** The receiver of a payload writes one credit byte back on the same stream for every
``UNIT`` bytes it has consumed (and one for a final partial unit). The sender keeps at most a
window of uncredited bytes in flight; the window follows the measured delivery rate so that
about ``TARGET_DELAY`` seconds of data are queued, between ``MIN_WINDOW`` and ``MAX_WINDOW``.
Why: the p2p daemon multiplexes every stream to a peer over one connection, and its multiplexer
resets the whole connection when a keepalive waits behind more than ~10 s of queued data. Unpaced,
that happened to every peer on 10 Mbit/s links as soon as several streams shared a link (measured:
docs/wire.md). For its first ``MIN_SPAN`` seconds a payload's window only doubles per round trip
(slow start): a rate taken over milliseconds measures buffers, not the link. On fast links the
window still reaches ``MAX_WINDOW`` within a few round trips, and pacing costs nothing measurable.

**Produced while sent.** A payload can be written while it is still being produced (an
averaged part, reduced as its contributions arrive): the sender then writes only what its
``Supply`` reports ready, and an error from the supply abandons the payload mid-way.

**Zero-copy reads.** A payload of at least ``ZEROCOPY_MIN`` bytes is read straight from the
stream's socket into the destination buffer (what the stream reader already buffered is copied
first), instead of through asyncio's reader, which copies every byte three times: from the
daemon's Unix socket, or, on a direct connection, by its protocol (net/direct_stream.py: the
kernel or OpenSSL writes into the buffer).

Failure behaviour: a peer that closes mid-payload raises ``asyncio.IncompleteReadError``; one that
answers something other than credits while we send raises :class:`ProtocolError`; transport
errors propagate as ``ConnectionError``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from dedloc.errors import ProtocolError

CREDIT = 0xC5
UNIT = 16 << 10
TARGET_DELAY = 1.0
MIN_WINDOW = 4 * UNIT
MAX_WINDOW = 64 << 20
FIRST_WINDOW = 16 * UNIT
RATE_SPAN = 2.0
MIN_SPAN = 0.25
ZEROCOPY_MIN = 1 << 20


@dataclass(frozen=True)
class Transfer:
    """One payload's timing (``time.monotonic``): from its first byte written (sender) or read
    (receiver) to its last byte credited (sender) or read (receiver)."""

    nbytes: int
    start: float
    end: float
    queue_s: float = 0.0
    """Sender only: the longest time from writing a chunk to its last credit (queueing delay)."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def busy_seconds(transfers: "list[Transfer]") -> float:
    """Seconds during which at least one of ``transfers`` was under way (the union of their spans)."""
    total, end = 0.0, float("-inf")
    for t in sorted(transfers, key=lambda t: t.start):
        if t.end > end:
            total += t.end - max(t.start, end)
            end = t.end
    return total


def credits_for(nbytes: int) -> int:
    """How many credit bytes the receiver of an ``nbytes`` payload sends."""
    return -(-nbytes // UNIT)


class _Window:
    """The sender's window: delivery rate over the last ``RATE_SPAN`` seconds times the target delay
    (slow start before ``MIN_SPAN``)."""

    def __init__(self, now: float | None = None) -> None:
        self.size = FIRST_WINDOW
        self._samples: collections.deque[tuple[float, int]] = collections.deque(
            [(time.monotonic() if now is None else now, 0)])

    def credited(self, total: int, now: float | None = None) -> None:
        """``total`` bytes are credited so far (at ``now``, default the clock)."""
        now = time.monotonic() if now is None else now
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_SPAN:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        if now - t0 < MIN_SPAN:  # too early to tell a link from a burst into buffers: slow start
            self.size = min(MAX_WINDOW, max(self.size, 2 * total))
        elif total > b0:
            rate = (total - b0) / (now - t0)
            self.size = int(min(MAX_WINDOW, max(MIN_WINDOW, rate * TARGET_DELAY)))


class ReceiverAnswered(ProtocolError):
    """The receiver wrote something other than credits before reading the whole payload (usually
    a refusal). What it wrote is left unread on the stream, so the caller can read the answer."""


async def _take_credits(reader: asyncio.StreamReader, limit: int) -> int:
    """Read 1..limit credit bytes (waits for at least one)."""
    data = await reader.read(limit)
    if not data:
        raise asyncio.IncompleteReadError(b"", limit)
    if data.count(CREDIT) != len(data):
        k = len(data) - len(data.lstrip(bytes([CREDIT])))
        buffer = getattr(reader, "_buffer", None)
        if isinstance(buffer, bytearray):  # put the answer back for the caller (asyncio internals, see _socket_of)
            buffer[:0] = data[k:]
        raise ReceiverAnswered("the receiver answered before reading the whole payload")
    return len(data)


class Supply(Protocol):
    """Bytes of a payload that are produced while it is sent (a result reduced as its inputs
    arrive): the sender writes only what is ready."""

    def ready(self) -> int:
        """How many bytes from the payload's start may be sent now."""

    async def wait(self, beyond: int) -> None:
        """Return once ``ready() > beyond``; raise to abandon the payload (the caller then closes
        the stream, and its reader sees the payload cut short)."""


class _Shifted:
    """``supply`` seen from byte ``offset`` of its payload."""

    def __init__(self, supply: Supply, offset: int):
        self.supply, self.offset = supply, offset

    def ready(self) -> int:
        return self.supply.ready() - self.offset

    async def wait(self, beyond: int) -> None:
        await self.supply.wait(beyond + self.offset)


def shifted(supply: Supply | None, offset: int) -> Supply | None:
    return None if supply is None or offset == 0 else _Shifted(supply, offset)


async def _unless(failed: "asyncio.Task[None]", wait: Callable[[], Awaitable[Any]]) -> None:
    """Await ``wait()``, but raise at once if the task ``failed`` ends with an error first (if it
    ends cleanly, ``wait()`` is simply awaited)."""
    if failed.done():
        failed.result()
        await wait()
        return
    job = asyncio.ensure_future(wait())
    try:
        await asyncio.wait({job, failed}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            failed.result()
        await job
    finally:
        if not job.done():
            job.cancel()


async def send_paced(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, view: memoryview,
                     chunk_bytes: int, supply: Supply | None = None) -> Transfer:
    """Write ``view`` (bytes) paced by the receiver's credits; returns once all of it is credited,
    with its timing and the queueing delay it saw. With ``supply``, only the bytes it reports
    ready are written (the rest as they become ready); its errors propagate.

    Credits are read as they arrive, by a task of their own, so a sender blocked on a full
    transport still times them (and still learns at once that the receiver answered)."""
    total = len(view)
    need = credits_for(total)
    window = _Window()
    written: collections.deque[tuple[int, float]] = collections.deque()  # (end offset, when written)
    sent = got = 0
    delay = 0.0
    start = time.monotonic()
    more = asyncio.Event()

    async def take() -> None:
        nonlocal got, delay
        while got < need:
            got += await _take_credits(reader, need - got)
            done = min(got * UNIT, total)
            if done > sent:
                raise ProtocolError("the receiver credited bytes that were not sent yet")
            window.credited(done)
            now = time.monotonic()
            while written and written[0][0] <= done:
                delay = max(delay, now - written.popleft()[1])
            more.set()

    credits = asyncio.create_task(take())
    out = _plain_socket(writer) if total >= ZEROCOPY_MIN else None
    dup = socket.socket(fileno=os.dup(out.fileno())) if out is not None else None
    loop = asyncio.get_running_loop()
    try:
        if dup is not None:
            dup.setblocking(False)
        while sent < total:
            room = window.size - (sent - min(got * UNIT, total))
            if room <= 0:
                more.clear()
                await _unless(credits, more.wait)
                continue
            ready = total if supply is None else min(total, supply.ready())
            if ready <= sent:
                await _unless(credits, lambda: supply.wait(sent))
                continue
            n = min(chunk_bytes, room, ready - sent)
            piece = view[sent:sent + n]
            sent += n
            written.append((sent, time.monotonic()))
            if dup is not None:  # straight from the tensor into the socket
                await _unless(credits, lambda: loop.sock_sendall(dup, piece))
            else:
                writer.write(piece)
                await _unless(credits, writer.drain)
        await credits
    finally:
        if dup is not None:
            dup.close()
        if not credits.done():
            credits.cancel()
        # retrieved even when the write failed first (else asyncio logs "exception was never retrieved")
        await asyncio.gather(credits, return_exceptions=True)
    return Transfer(total, start, time.monotonic(), delay)


def _plain_socket(writer: asyncio.StreamWriter) -> socket.socket | None:
    """The writer's socket if a payload can be sent from its memory straight into it: a plain (not
    TLS) socket transport with nothing of its own left to send. Else None (the transport writes,
    copying what the kernel does not take at once into its buffer, and moving the rest of that
    buffer down after each partial send: about ten copies of a 4 MiB chunk on the daemon's socket)."""
    transport = writer.transport
    if transport is None or transport.is_closing() or transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
        return None
    if transport.get_write_buffer_size():
        return None
    return sock


def _socket_of(reader: asyncio.StreamReader):
    """The reader's transport and socket if zero-copy reads can be used on it, else (None, None).

    Uses asyncio's StreamReader internals (``_buffer``, ``_transport``), stable since Python 3.7;
    anything unexpected falls back to ordinary reads."""
    transport = getattr(reader, "_transport", None)
    buffer = getattr(reader, "_buffer", None)
    if transport is None or not isinstance(buffer, bytearray) or not hasattr(transport, "pause_reading"):
        return None, None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None, None
    return transport, sock


async def recv_into(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, view: memoryview,
                    on_progress: Callable[[int], None] | None = None) -> Transfer:
    """Fill ``view`` (writable bytes) from the stream, sending credits through ``writer`` (None: none).

    ``on_progress(bytes so far)`` is called after every read. Returns the payload's timing, from
    the call (the header that precedes a payload has just been read) to its last byte."""
    total = len(view)
    done = credited = 0
    start = time.monotonic()

    def progress(n: int) -> None:
        nonlocal done, credited
        done += n
        units = credits_for(done) if done == total else done // UNIT
        if writer is not None and units > credited:
            writer.write(bytes([CREDIT]) * (units - credited))
            credited = units
        if on_progress is not None:
            on_progress(done)

    def take_buffered() -> None:
        """What the reader already holds goes first (a zero-copy read starts after it)."""
        exc = reader.exception()
        if exc is not None:
            raise exc
        buffered = reader._buffer  # noqa: SLF001 (see _socket_of)
        n = min(len(buffered), total)
        if n:
            view[:n] = buffered[:n]
            del buffered[:n]
            progress(n)

    direct = getattr(reader, "_dedloc_direct", None) if total >= ZEROCOPY_MIN else None
    if direct is not None:
        take_buffered()
        await direct.read_into(view[done:], progress)
        return Transfer(total, start, time.monotonic())
    transport, sock = _socket_of(reader) if total >= ZEROCOPY_MIN else (None, None)
    if transport is None:
        while done < total:
            data = await reader.read(min(total - done, 1 << 20))
            if not data:
                raise asyncio.IncompleteReadError(b"", total - done)  # expected: the bytes still missing
            view[done:done + len(data)] = data
            progress(len(data))
        return Transfer(total, start, time.monotonic())
    take_buffered()
    if done == total:
        return Transfer(total, start, time.monotonic())
    if reader.at_eof():
        raise asyncio.IncompleteReadError(b"", total - done)  # expected: the bytes still missing
    loop = asyncio.get_running_loop()
    transport.pause_reading()
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as dup:
            dup.setblocking(False)
            while done < total:
                got = await loop.sock_recv_into(dup, view[done:])
                if got == 0:
                    reader.feed_eof()
                    raise asyncio.IncompleteReadError(b"", total - done)  # expected: the bytes still missing
                progress(got)
    finally:
        reader._paused = False  # noqa: SLF001: the reader's own pause (if any) ended with its buffer
        transport.resume_reading()
    return Transfer(total, start, time.monotonic())
