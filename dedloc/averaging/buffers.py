"""Reusable scratch tensors for averaging rounds.

Fresh memory is expensive here: first-touch page faults cost ~0.15 s per 256 MB, paid again every
round because large allocations go back to the OS when freed. Rounds take their receive buffers and
partial sums from a pool instead, and give them back when done with them.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Idle CPU tensors by (numel, dtype), holding at most ``max_idle_bytes`` in all.

    ``take`` returns a tensor with undefined contents (or zeros with ``zero=True``); a tensor given
    back must no longer be used by its taker. Not thread-safe: one event loop uses it.
    """

    def __init__(self, max_idle_bytes: int = 1 << 30):
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._idle_bytes = 0

    def take(self, numel: int, dtype: torch.dtype = torch.float32, zero: bool = False) -> torch.Tensor:
        free = self._idle.get((numel, dtype))
        if free:
            t = free.pop()
            self._idle_bytes -= t.numel() * t.element_size()
            return t.zero_() if zero else t
        return torch.zeros(numel, dtype=dtype) if zero else torch.empty(numel, dtype=dtype)

    def give(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1 or t._base is not None:
            return
        if self._idle_bytes + nbytes > self.max_idle_bytes:
            return
        self._idle.setdefault((t.numel(), t.dtype), []).append(t)
        self._idle_bytes += nbytes
