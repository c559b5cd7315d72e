"""The one per-peer "not now" table: peers a side avoids for a while (a direct connection that
failed, a hole punch that did not come). Entries expire on their own; expired ones are forgotten.

Two other "avoid this peer" memories are not health caches but protocol state with the lifetime of
what they belong to, and live there: the leaders a peer passed over in one step's matchmaking (rule
4: every peer that asks one passes it over alike; ``matchmaking._StepMatch.unreachable``) and the
members that took a stream but never answered its hello in one round (``tcp.RoundConnections.silent``:
asked nothing more in that round, asked again in the next)."""

from __future__ import annotations

import time
from typing import Callable, Hashable


class Cooldowns:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._until: dict[Hashable, float] = {}

    def start(self, peer: Hashable, seconds: float) -> None:
        """Avoid ``peer`` for ``seconds`` from now."""
        now = self._clock()
        for old in [p for p, until in self._until.items() if until <= now]:
            del self._until[old]
        self._until[peer] = now + seconds

    def active(self, peer: Hashable) -> bool:
        """Whether ``peer`` is avoided now."""
        until = self._until.get(peer)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[peer]
            return False
        return True


__all__ = ["Cooldowns"]
