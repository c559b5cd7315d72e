"""Bounds on what a member may claim in a round: no single claim steers the mean.

- ``MAX_WEIGHT``: no weight above 2^40 samples is accepted anywhere (join requests, ready records,
  contribution headers): a weight of 10^39 made honest senders' sums overflow.
- ``MAX_WEIGHTED``: a contribution whose largest magnitude times its weight exceeds 10^30 is
  refused, so that the sum over a group (at most 64 members per part) stays finite in float32
  (3.4e38), and the peer that sent it is named instead of an honest one.
- :class:`WeightBounds`: per peer, what it could plausibly have computed toward the step (the
  training loop derives them from the progress records, optim/claims.py). A leader refuses a join
  above its bound; a follower refuses a group whose leader admitted a weight above twice its own
  bound for that member (the views of two peers differ a little).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dedloc.records import MAX_WEIGHT, weight_ok

__all__ = ["MAX_WEIGHT", "MAX_WEIGHTED", "FOLLOWER_TOLERANCE", "TOO_LARGE", "WeightBounds", "weight_ok"]

MAX_WEIGHTED = 1e30
FOLLOWER_TOLERANCE = 2.0
TOO_LARGE = "contains NaN or inf values, or values whose product with its weight exceeds 1e30"


@dataclass(frozen=True)
class WeightBounds:
    """The largest weight each peer may bring to one step's round; ``default`` for peers not listed."""

    limits: dict[str, float] = field(default_factory=dict)
    default: float = MAX_WEIGHT

    def of(self, peer: str) -> float:
        return self.limits.get(peer, self.default)

    def excess(self, peer: str, weight: float, tolerance: float = 1.0) -> str | None:
        """Why ``weight`` is implausible for ``peer`` (None if it is not)."""
        bound = self.of(peer)
        if weight > tolerance * bound:
            return (f"weight {weight:.0f} is above what {peer} could plausibly have computed for this step "
                    f"({tolerance * bound:.0f} samples, from the speed it published)")
        return None
