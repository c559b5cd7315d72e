"""An aggregator's part, reduced segment by segment while its contributions arrive.

The result of segment ``k`` is final as soon as every contributor's segment ``k`` is in, so the
aggregator streams it to the members while later segments are still arriving: the reduce and
the broadcast overlap instead of running as two phases with a barrier between them.

The price is a commitment. The set of contributors is fixed before the first result byte can
go out: when the first segment of every expected sender has arrived (or at the reduce
deadline, with the senders whose contributions are complete by then). Before that, a sender
that leaves, stalls or sends NaN/inf is simply excluded. After it, such a sender cannot be taken
out of bytes already sent: the part is *abandoned* (``failed`` is set), every result stream
must be cut, and the members fail over to the part's backup (docs/averaging.md).

A sender that has not begun sending by the start deadline (``expire_unstarted``) is excluded,
so a member that left after matchmaking delays the part by that much, not until the reduce
deadline.

Guarantees: every produced element is ``sum_k w_k x_k / sum_k w_k`` over exactly the committed
contributors, checked finite; nothing is produced after ``failed`` is set; ``done`` is set once
the whole part is produced or the part failed, at the reduce deadline (``expire``) at the latest.
Not thread-safe: one event loop drives it.
"""

from __future__ import annotations

import asyncio

import torch

from dedloc.averaging.bounds import MAX_WEIGHTED, TOO_LARGE
from dedloc.numerics import bounded

SEGMENT_BYTES = 1 << 20


class PartAbandoned(Exception):
    """The part failed after (or before) its contributors were fixed; the reason is the message."""


class StreamedPart:
    """Weighted mean of one part, produced into ``out`` in segments; a :class:`dedloc.net.bulk.Supply`
    of ``wire``'s bytes (``wire`` is ``out`` itself for float32, else ``out`` rounded to the wire dtype)."""

    def __init__(self, expected: set[int], out: torch.Tensor, wire: torch.Tensor):
        if out.dtype != torch.float32 or wire.numel() != out.numel():
            raise ValueError("out must be float32 and wire the same size")
        self.out, self.wire, self.numel = out, wire, out.numel()
        self.segment = max(1, SEGMENT_BYTES // wire.element_size())
        self.pending = set(expected)
        """Expected senders not yet accounted for (before the commitment)."""
        self.contributors: list[int] | None = None
        """The committed contributors, in index order (None until committed)."""
        self.total_weight = 0.0
        self.rejected: dict[int, str] = {}
        self.produced = 0
        """Elements of ``out`` (and ``wire``) that are final."""
        self.failed: str | None = None
        self.done = asyncio.Event()
        self._inputs: dict[int, tuple[float, torch.Tensor]] = {}
        self._received: dict[int, int] = {}
        self._checked: dict[int, int] = {}
        self._changed = asyncio.Event()

    # ---- inputs ------------------------------------------------------------------------------
    def begin(self, k: int, weight: float, buf: torch.Tensor) -> bool:
        """Sender ``k``'s contribution starts arriving into ``buf`` (report it with ``progress``).
        False if ``k`` is not (or no longer) expected: the caller refuses it."""
        if k not in self.pending or k in self._inputs or self.contributors is not None or self.done.is_set():
            return False
        if buf.numel() != self.numel:
            raise ValueError(f"contribution buffer has {buf.numel()} elements, the part {self.numel}")
        self._inputs[k] = (weight, buf)
        self._received[k] = 0
        self._advance()
        return True

    def weight_of(self, k: int) -> float:
        """The weight contributor ``k`` was reduced with (0 if it contributed nothing)."""
        return self._inputs[k][0] if k in self._inputs else 0.0

    def add_local(self, k: int, weight: float, data: torch.Tensor) -> None:
        """This aggregator's own contribution, whole."""
        if self.begin(k, weight, data):
            self.progress(k, self.numel)

    def progress(self, k: int, elements: int) -> None:
        """The first ``elements`` of ``k``'s contribution have arrived."""
        if k in self._received:
            self._received[k] = elements
            self._advance()

    def reject(self, k: int, reason: str) -> None:
        """Take sender ``k`` out: excluded before the commitment, the part abandoned after it (if
        ``k`` is a contributor whose data is still needed)."""
        if self.done.is_set():
            return
        if self.contributors is None:
            if k in self.pending:
                self._exclude(k, reason)
                self._advance()
        elif k in self.contributors and self._received[k] < self.numel:
            self._fail(f"contributor {k} failed after the part's contributors were fixed ({reason})", k, reason)

    def expire_unstarted(self) -> None:
        """The start deadline: exclude expected senders that have not begun sending (a member that
        left after matchmaking must not hold the commitment, and so every result, until the
        reduce deadline)."""
        if self.done.is_set() or self.contributors is not None:
            return
        for k in sorted(self.pending):
            if k not in self._inputs:
                self._exclude(k, "did not start sending")
        self._advance()

    def expire(self) -> None:
        """The reduce deadline: commit to the complete contributions if not yet committed; abandon
        the part if a committed contribution is still incomplete."""
        if self.done.is_set():
            return
        if self.contributors is None:
            for k in sorted(self.pending):
                if self._received.get(k, -1) < self.numel:
                    self._exclude(k, "timed out")
            self._advance(force=True)
        else:
            late = [k for k in self.contributors if self._received[k] < self.numel]
            if late:
                self._fail(f"contributor {late[0]} did not finish before the reduce deadline", late[0], "timed out")

    def abandon(self, why: str) -> None:
        """Give the part up (the round ended without it): waiters get PartAbandoned."""
        if not self.done.is_set():
            self._fail(why)

    # ---- consumers ---------------------------------------------------------------------------
    async def committed(self) -> None:
        """Return once the contributors are fixed; raise PartAbandoned if the part failed (before or after)."""
        while self.contributors is None and self.failed is None:
            await self._changed.wait()
        if self.failed is not None:
            raise PartAbandoned(self.failed)

    def ready(self) -> int:
        """Bytes of ``wire`` that are final (bulk.Supply)."""
        return self.produced * self.wire.element_size()

    async def wait(self, beyond: int) -> None:
        """Return once more than ``beyond`` bytes are final; raise PartAbandoned if the part fails
        first (bulk.Supply)."""
        while self.failed is None and self.ready() <= beyond:
            await self._changed.wait()
        if self.failed is not None:
            raise PartAbandoned(self.failed)

    # ---- internals ---------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _exclude(self, k: int, reason: str) -> None:
        self.pending.discard(k)
        self._inputs.pop(k, None)
        self._received.pop(k, None)
        self.rejected[k] = reason

    def _fail(self, why: str, k: int | None = None, reason: str | None = None) -> None:
        if k is not None and reason is not None:
            self.rejected[k] = reason
        self.failed = why
        self.done.set()
        self._notify()

    def _advance(self, force: bool = False) -> None:
        if self.done.is_set():
            return
        if self.contributors is None and not self._commit(force):
            return
        while self.produced < self.numel:
            a, b = self.produced, min(self.produced + self.segment, self.numel)
            if any(self._received[k] < b for k in self.contributors):
                break
            for k in self.contributors:
                if self._checked[k] < b:
                    if not bounded(self._inputs[k][1][self._checked[k]:b], self._limit(k)):
                        self._fail(f"contributor {k} sent NaN, inf or values too large for its weight after the "
                                   f"part's contributors were fixed", k, TOO_LARGE)
                        return
                    self._checked[k] = b
            self._reduce(a, b)
            self.produced = b
        if self.produced == self.numel:
            self.done.set()
        self._notify()

    def _limit(self, k: int) -> float:
        """The largest magnitude sender ``k`` may send: its values times its weight stay below
        MAX_WEIGHTED, so the part's sum cannot overflow (averaging/bounds.py)."""
        return MAX_WEIGHTED / max(1.0, self._inputs[k][0])

    def _commit(self, force: bool) -> bool:
        """Fix the contributors once every expected sender has sent its first segment (``force``:
        now, with those still expected). Returns whether the part is committed."""
        first = min(self.segment, self.numel)
        if not force and any(self._received.get(k, -1) < first for k in self.pending):
            return False
        for k in sorted(self.pending):
            if not bounded(self._inputs[k][1][:self._received[k]], self._limit(k)):
                self._exclude(k, TOO_LARGE)
        self._checked = {k: self._received[k] for k in self.pending}
        self.contributors = sorted(self.pending)
        self.pending.clear()
        self.total_weight = sum(self._inputs[k][0] for k in self.contributors)
        if self.total_weight <= 0:
            self._fail("no contribution with positive weight arrived for this part")
            return False
        self._notify()
        return True

    def _reduce(self, a: int, b: int) -> None:
        o = self.out[a:b]
        for i, k in enumerate(self.contributors):
            weight, data = self._inputs[k]
            if i == 0:
                o.copy_(data[a:b]).mul_(weight)
            else:
                o.add_(data[a:b], alpha=weight)
        o.div_(self.total_weight)
        if self.wire is not self.out:
            self.wire[a:b].copy_(o)
            o.copy_(self.wire[a:b])  # keep exactly what the members receive


__all__ = ["PartAbandoned", "StreamedPart", "SEGMENT_BYTES"]
