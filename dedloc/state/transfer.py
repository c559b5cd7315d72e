"""Serving and downloading training states between peers (runs in the runtime process).

Protocol ``dedloc.{run}.state``, over a direct connection where the donor grants one, else a
libp2p stream (net/peer_connections.py): the requester sends ``{"v", "min_step"}`` (msgpack, as in
net/messages.py); the donor answers ``{"step", "size"}`` then ``size`` raw bytes paced by the
requester's credits (net/bulk.py, as every bulk payload), or ``{"busy"}`` / ``{"error"}``. The
header also carries the state's ``lineage`` (state/lineage.py), so a requester refuses a fork before
reading its bytes. Guarantees:
- a donor serves at most ``max_uploads`` requesters at once and answers ``busy`` beyond that, so
  newcomers spread over donors (they try donors in random order);
- when a requester wants a newer state than the donor has cached, the donor flags it as wanted;
  the training process sees the flag at its next report and offers a fresh state. The donor waits
  for that offer (at most ``FRESH_WAIT``) without holding an upload slot, and answers ``behind`` at
  once when it cannot produce the state: its training loop is behind ``min_step``, or is itself
  downloading or resyncing (two peers that both wait for the other's newer state never deadlock).
  A requester already waiting is answered as soon as that becomes true (e.g. a forked peer that
  steps back: it would never produce the step it published);
- a download has a deadline, checks the announced size against what the requester expects
  (``max_bytes``, sized from its own model; at most ``MAX_STATE_BYTES``) before reading any of
  it, and takes memory only as the bytes arrive (``_reserve``), so memory is never sized by a
  donor's claim; it refuses a state above ``max_step`` (past the step the run attests: one
  member's claim, records.py) at its header, and tries the next donor on any failure. Each donor's answer must come within ``HEADER_WAIT`` (a donor that never answers
  costs that much, not the whole deadline); the bytes then get what is left of the deadline, but
  a donor that sends nothing for ``STALL_WAIT`` is given up. It raises StateError naming every
  donor tried when none succeeded (ForkError, with the forked donors in ``peers``, when some
  were refused as forks: the requester leaves them out of its target, see optim/optimizer.py).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import sys
import time
from dataclasses import dataclass

from dedloc.averaging.wire import VERSION
from dedloc.errors import ForkError, ProtocolError, StateError
from dedloc.net import bulk, messages
from dedloc.net.node import Node
from dedloc.net.transport import Transport
from dedloc.state import lineage

logger = logging.getLogger(__name__)
UPLOAD_GRACE = 300.0
CHUNK = 4 << 20
MAX_STATE_BYTES = 64 << 30
FRESH_WAIT = 15.0
HEADER_WAIT = FRESH_WAIT + 10.0
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
STALL_WAIT = 20.0
"""A donor whose bytes stop arriving for this long is given up (and the next one tried)."""


async def _receive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> bytes:
    """A state's ``size`` bytes (already checked against what this peer accepts), read through the
    paced bulk path (credits back to the donor, zero-copy reads); a donor that sends nothing for
    ``STALL_WAIT`` (frozen mid-transfer) raises StateError, however slow but steady it is otherwise."""
    buf = _reserve(size)
    seen = [time.monotonic(), 0]

    def progress(done: int) -> None:
        seen[0], seen[1] = time.monotonic(), done

    task = asyncio.ensure_future(bulk.recv_into(reader, writer, memoryview(buf), progress))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=min(1.0, STALL_WAIT))
            if not task.done() and time.monotonic() - seen[0] > STALL_WAIT:
                raise StateError(f"sent nothing for {STALL_WAIT:.0f} s ({seen[1]} of {size} bytes in)")
        task.result()
        return bytes(buf)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _reserve(size: int) -> bytearray | mmap.mmap:
    """Room for ``size`` bytes that takes memory only as bytes arrive (Linux: an anonymous mapping
    without reserve), so a donor announcing a huge state and sending little costs what it sent.
    StateError, naming the size, if even that cannot be mapped. Unmapped once the last view of it
    is gone (a cancelled read may hold one a moment longer)."""
    try:
        if sys.platform.startswith("linux"):
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        return bytearray(size)
    except (OSError, MemoryError, OverflowError) as e:
        raise StateError(f"cannot make room for its announced {size} bytes: {e}") from None


@dataclass
class _Cached:
    step: int
    blob: bytes
    history: tuple[str, ...] = ()
    """The state's lineage (``"t:h"`` per step, oldest first, its own fingerprint last)."""


class StateServer:
    def __init__(self, node: Node, transport: Transport, max_uploads: int = 2):
        """``transport``: how states travel (net/peer_connections.py: direct TCP where the donor
        offers it, else libp2p)."""
        self.node, self.transport = node, transport
        self.proto = f"dedloc.{node.config.run_id}.state"
        self.cached: _Cached | None = None
        self.training_step = -1
        self.syncing = False
        """The training loop is resyncing (state/optimizer): it offers no state until it holds a new one."""
        self.wanted = False
        self.downloading = 0
        """Downloads this peer has under way: while it waits for a state, it offers no newer one."""
        self._offered = asyncio.Condition()
        self._uploads = asyncio.Semaphore(max_uploads)

    async def start(self) -> None:
        if not self.node.config.client_mode:
            await self.transport.serve(self.proto, self._on_stream)

    async def offer(self, step: int, blob: bytes, history: list[str] | tuple[str, ...] = ()) -> None:
        """Serve ``blob``, the state of ``step``; ``history``: its lineage (state/lineage.py), sent in the
        header so that a requester can refuse a fork before its bytes."""
        history = tuple(history)[-lineage.KEEP:]
        async with self._offered:
            # a newer state, or one of another history: this peer stepped back from a fork (the cached
            # state of a higher step would be served, and refused by all, until it moved past that step)
            if self.cached is None or step >= self.cached.step or \
                    lineage.divergence(lineage.from_list(list(history)) or {},
                                       lineage.from_list(list(self.cached.history)) or {}) is not None:
                self.cached = _Cached(step, blob, history)
            self.wanted = False
            self._offered.notify_all()

    async def progress(self, step: int, syncing: bool) -> None:
        """The training loop's step and whether it is resyncing (each progress report): a requester
        waiting for a state the loop can no longer produce is answered ``behind`` at once."""
        async with self._offered:
            self.training_step, self.syncing = step, syncing
            self._offered.notify_all()

    def _cannot_produce(self, min_step: int) -> bool:
        return self.training_step < min_step or self.downloading > 0 or self.syncing

    async def _fresh(self, min_step: int) -> _Cached | None:
        """The cached state if it is at ``min_step`` or later; else wait (bounded) for the training
        loop to offer one, while it can (it may start resyncing meanwhile: e.g. a forked peer that
        steps back); None if not."""
        def ready() -> bool:
            return self.cached is not None and self.cached.step >= min_step

        if ready():
            return self.cached
        if self._cannot_produce(min_step):
            return None
        self.wanted = True
        async with self._offered:
            try:
                await asyncio.wait_for(self._offered.wait_for(lambda: ready() or self._cannot_produce(min_step)),
                                       FRESH_WAIT)
            except asyncio.TimeoutError:
                return None
        return self.cached if ready() else None

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one state request (net/serve.py has admitted the peer); True once it wrote last."""
        request = await asyncio.wait_for(messages.read_message(reader), 10)
        if not isinstance(request, dict) or request.get("v") != VERSION or not isinstance(request.get("min_step"), int):
            raise ProtocolError(f"malformed state request (protocol {VERSION} expected)")
        state = await self._fresh(request["min_step"])  # waits without holding an upload slot
        if state is None:
            await messages.write_message(writer, {"error": f"no state at step >= {request['min_step']}", "behind": True})
            return True
        if self._uploads.locked():
            await messages.write_message(writer, {"busy": True})
            return True
        async with self._uploads:
            await messages.write_message(writer, {"step": state.step, "size": len(state.blob), "lineage": list(state.history)})
            await bulk.send_paced(writer, reader, memoryview(state.blob), CHUNK)  # paced by the newcomer's credits
            await messages.wait_peer_closed(reader, UPLOAD_GRACE)  # the newcomer closes once it has it all
            logger.info(f"sent the state of step {state.step} ({len(state.blob) / 1e6:.1f} MB) to {info.peer_id}")
        return False

    async def download(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                       votes: dict[str, str] | None = None, max_step: int | None = None) -> tuple[int, bytes, str]:
        """Fetch a state at step >= min_step from the first donor that has one, trying them in order.
        ``votes``: the live peers' fingerprints (state/lineage.py); a donor whose header lineage they
        outvote (a fork), or that announces a step above ``max_step`` (past what the run attests: one
        member's claim), is refused before any byte of its state is read, and the next one tried."""
        deadline = time.monotonic() + timeout
        limit = min(max_bytes or MAX_STATE_BYTES, MAX_STATE_BYTES)
        reasons: list[str] = []
        forks: list[str] = []
        async with self._offered:  # a requester waiting on this peer's next state is answered at once
            self.downloading += 1
            self._offered.notify_all()
        try:
            for donor in donors:
                left = deadline - time.monotonic()
                if left <= 0:
                    reasons.append(f"{donor}: deadline passed")
                    break
                try:
                    step, blob = await asyncio.wait_for(
                        self._download_from(donor, min_step, deadline, limit, votes, max_step), left)
                    return step, blob, donor
                except Exception as e:  # any failure of one donor: try the next
                    if isinstance(e, ForkError):
                        forks.append(donor)
                    reasons.append(f"{donor}: {type(e).__name__}: {e}")
                    logger.debug(f"state download from {donor} failed: {e!r}")
        finally:
            self.downloading -= 1
        why = f"could not download the state at step >= {min_step}: " + ("; ".join(reasons) if reasons else
                                                                          "no donor is advertising it")
        raise ForkError(why, peers=tuple(forks)) if forks else StateError(why)

    async def _download_from(self, donor: str, min_step: int, deadline: float, limit: int,
                             votes: dict[str, str] | None, max_step: int | None) -> tuple[int, bytes]:
        header_by = min(deadline, time.monotonic() + HEADER_WAIT)
        reader, writer = await asyncio.wait_for(
            self.transport.open(donor, self.proto),
            max(0.1, header_by - time.monotonic()))
        try:
            await messages.write_message(writer, {"v": VERSION, "min_step": min_step})
            try:
                head = await asyncio.wait_for(messages.read_message(reader), max(0.1, header_by - time.monotonic()))
            except asyncio.TimeoutError:
                raise StateError(f"no answer within {HEADER_WAIT:.0f} s") from None
            if not isinstance(head, dict):
                raise ProtocolError("malformed answer")
            if head.get("busy"):
                raise StateError("busy")
            if "error" in head:
                raise StateError(str(head["error"]))
            step, size = head.get("step"), head.get("size")
            if not isinstance(step, int) or not isinstance(size, int) or step < min_step or size <= 0:
                raise ProtocolError(f"bad state header {head!r}")
            if max_step is not None and step > max_step:
                raise ProtocolError(f"it announces a state of step {step}, past step {max_step}: the run's other "
                                    f"peers attest no such step (records.py ``global_step``)")
            if size > limit:
                raise ProtocolError(f"it announces a state of {size} bytes, more than this peer accepts "
                                    f"({limit} bytes: its own model's state, with room for the optimizer's)")
            history = lineage.from_list(head.get("lineage", []))
            if history is None:
                raise ProtocolError(f"malformed lineage in the state header of step {step}")
            if votes and lineage.votes_of(history, votes).outvoted(own=donor):
                raise ForkError(f"its state of step {step} rewrites step {lineage.first_conflict_of(history, votes)}, "
                                    f"which the collaboration took with other parameters (a fork): refused before "
                                    f"its {size} bytes")
            return step, await _receive(reader, writer, size)
        finally:
            writer.close()
