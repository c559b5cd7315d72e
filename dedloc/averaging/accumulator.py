"""Sample-weighted accumulation of one part, with per-sender accounting and a deadline."""

from __future__ import annotations

import asyncio

import torch

from dedloc.errors import AveragingError


class PartAccumulator:
    """Collects ``sum_k w_k * x_k`` over the expected senders of one part.

    Guarantees: each sender counts at most once; nothing is added after ``finish()``; a sender
    is either a contributor, rejected (with its reason) or timed out, never two of these.
    """

    def __init__(self, expected: set[int], numel: int, zeros: torch.Tensor | None = None,
                 optional: set[int] = frozenset()):
        """``zeros``: a float32 buffer of ``numel`` zeros to accumulate in (default: a new one).
        ``optional``: senders taken if they arrive in time, but never waited for."""
        if zeros is not None and (zeros.numel() != numel or zeros.dtype != torch.float32):
            raise ValueError(f"accumulator buffer must be {numel} float32 zeros")
        self.sum = zeros if zeros is not None else torch.zeros(numel, dtype=torch.float32)
        self.total_weight = 0.0
        self.pending = set(expected)
        self.optional = set(optional) - self.pending
        self.contributors: list[int] = []
        self.rejected: dict[int, str] = {}
        self.closed = False
        self._changed = asyncio.Event()

    def add(self, sender: int, weight: float, data: torch.Tensor) -> bool:
        if self.closed or (sender not in self.pending and sender not in self.optional):
            return False
        self.sum.add_(data, alpha=weight)
        self.total_weight += weight
        self.pending.discard(sender)
        self.optional.discard(sender)
        self.contributors.append(sender)
        self._changed.set()
        return True

    def reject(self, sender: int, reason: str) -> None:
        if self.closed or sender not in self.pending:
            return
        self.pending.discard(sender)
        self.rejected[sender] = reason
        self._changed.set()

    async def wait(self, deadline: float) -> None:
        """Return once every expected sender is accounted for, or at ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        while self.pending and loop.time() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                break

    def finish(self) -> torch.Tensor:
        """Close and return the weighted mean; raises AveragingError if nobody contributed."""
        self.closed = True
        for sender in self.pending:
            self.rejected[sender] = "timed out"
        self.pending.clear()
        if self.total_weight <= 0:
            raise AveragingError("no contribution with positive weight arrived for this part")
        return self.sum.div_(self.total_weight)
