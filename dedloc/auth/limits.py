"""Per-remote-peer request limits: a token bucket of new requests, and optionally a cap on how many
are open at once. One mechanism for every place that serves peers (streams, DHT requests).

Guarantees: a peer is never admitted above ``burst`` requests at once after an idle spell, nor above
``rate`` per second sustained, nor (with ``max_open``) above ``max_open`` unreleased ones; the table
forgets idle peers past 4096, so a flood of distinct peer ids cannot grow it without bound.
Not thread-safe: one event loop drives it.
"""

from __future__ import annotations

import time

MAX_TRACKED = 4096


class Budget:
    """One remote peer's budget: open requests and a token bucket of new ones."""

    __slots__ = ("open", "tokens", "at")

    def __init__(self, tokens: float, now: float):
        self.open, self.tokens, self.at = 0, tokens, now


class PeerLimits:
    """``acquire(peer)`` admits one request (None: over a limit); ``release`` ends it (with ``max_open``)."""

    def __init__(self, rate: float, burst: float, max_open: int | None = None):
        self.rate, self.burst, self.max_open = rate, burst, max_open
        self._budgets: dict[str, Budget] = {}

    def describe(self) -> str:
        """The limits, for a refusal message."""
        at_once = f"at most {self.max_open} at once, " if self.max_open is not None else ""
        return f"{at_once}{self.rate:.0f}/s, bursts of {self.burst:.0f}"

    def acquire(self, peer: str) -> Budget | None:
        now = time.monotonic()
        budget = self._budgets.get(peer)
        if budget is None:
            if len(self._budgets) >= MAX_TRACKED:  # forget idle peers (their buckets refill anyway)
                for p in [p for p, b in self._budgets.items() if b.open == 0][:MAX_TRACKED // 2]:
                    del self._budgets[p]
            budget = self._budgets[peer] = Budget(self.burst, now)
        budget.tokens = min(self.burst, budget.tokens + (now - budget.at) * self.rate)
        budget.at = now
        if (self.max_open is not None and budget.open >= self.max_open) or budget.tokens < 1:
            return None
        budget.tokens -= 1
        if self.max_open is not None:
            budget.open += 1
        return budget

    @staticmethod
    def release(budget: Budget) -> None:
        budget.open -= 1


__all__ = ["PeerLimits", "Budget"]
