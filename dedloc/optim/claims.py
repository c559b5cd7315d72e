"""What each peer could plausibly have computed toward a step, from the progress records it published.

A member's progress record (its sample count) decides when the collaboration takes a step, and
its weight in the round decides how much its gradients count; both are its own claims. This
bounds them. For peer ``i`` at step ``s``, read at time ``now`` by this peer:

    bound_i = SLACK * v_i * (now - t_s) + share_s

- ``t_s``: the earliest the step can have begun as this peer saw it: when it last read the
  collaboration still at step ``s - 1`` (a peer that was frozen or slow to look errs generous);
- ``share_s = target_batch_size / (training peers at s)``: one fair share, for the micro-batch a
  peer had in flight when the step began and for a newcomer's first one (counted before any
  speed of its own is known);
- ``v_i``: the speed peer ``i`` may claim: the speed it published before ``s`` began (itself
  at most ``NEW_SPEED`` times the fastest speed another peer published then: a member that
  published 1e9 samples/s once had it committed, and every step closed on its claim), or, if
  higher, its published speed up to ``NEW_SPEED`` times the fastest speed another peer published
  before ``s`` began (a newcomer, or a peer that sped up). When no peer had published a speed
  before ``s``, speeds are taken as published.

A step this peer did not see begin (it joined or resynced into it) is bounded by ``UNSEEN``
target batches per peer: it cannot tell how long the others have been computing for it.

A record claiming more samples is counted at its bound (logged once per peer per minute), and a
weight above its bound is refused in the round (averaging/bounds.py). What is left: a member that
keeps publishing a speed up to ``NEW_SPEED`` times the fastest honest one can claim that much
work without doing it. Its claimed speed is visible to everyone (the progress table).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from dedloc.averaging.bounds import MAX_WEIGHT, WeightBounds
from dedloc.logs import PerPeerWarnings
from dedloc.records import CollaborationView

logger = logging.getLogger(__name__)
SLACK = 2.0
NEW_SPEED = 2.0
UNSEEN = 4.0
KEEP_STEPS = 8


class ClaimBounds:
    """Tracks published speeds across steps and bounds each peer's claims (module docstring)."""

    def __init__(self, target_batch_size: int):
        self.target = target_batch_size
        self._step: int | None = None
        self._looked = 0.0
        """When this peer last read a view (a step seen now began at the earliest then)."""
        self._began: dict[int, float] = {}
        """Step -> when this peer first saw the collaboration at it (time.monotonic)."""
        self._committed: dict[int, dict[str, float]] = {}
        """Step -> the speed each peer had published before the step began."""
        self._latest: dict[str, float] = {}
        self._warnings = PerPeerWarnings(logger)

    def observe(self, view: CollaborationView, now: float | None = None) -> CollaborationView:
        """Take in a fresh view; return it with each sample count above its bound counted at the bound."""
        now = time.monotonic() if now is None else now
        step = view.global_step
        if self._step is None or step > self._step:
            if self._step is not None and step == self._step + 1:  # seen begin (not joined or resynced into)
                self._began[step] = self._looked  # the earliest it can have begun (a frozen peer: long ago)
            self._step = step
            self._committed[step] = _committed({p: v for p, v in self._latest.items() if v > 0})
            for old in [s for s in self._began if s < step - KEEP_STEPS]:
                self._began.pop(old, None)
                self._committed.pop(old, None)
        self._looked = now
        records, changed = [], False
        for r in view.peers:
            if r.role.trains:
                self._latest[r.peer_id] = r.samples_per_second
                if r.step > step + 1:
                    self._warnings.warn(f"{r.peer_id} step", f"peer {r.peer_id} publishes step {r.step}, past step "
                                                             f"{step} that the run attests: its claim alone moves "
                                                             f"nothing (records.py ``global_step``)")
            bound = self.bound(r.step, r.peer_id, r.samples_per_second, view, now) if r.role.trains else 0.0
            if r.samples > bound:
                self._warnings.warn(r.peer_id, f"peer {r.peer_id} claims {r.samples} samples toward step {r.step}, "
                                               f"more than it could plausibly have computed ({bound:.0f}); "
                                               f"counted as {int(bound)}")
                r, changed = replace(r, samples=int(bound)), True
            records.append(r)
        if len(self._latest) > 4096:
            live = {r.peer_id for r in view.peers}
            self._latest = {p: v for p, v in self._latest.items() if p in live}
        return CollaborationView(tuple(records), view.now) if changed else view

    def bound(self, step: int, peer: str, published: float, view: CollaborationView, now: float) -> float:
        began = self._began.get(step)
        if began is None:  # a step this peer joined or resynced into: it did not see it begin
            return UNSEEN * self.target
        trainers = max(1, len(view.trainers_at(step)))
        share = self.target / trainers
        return SLACK * self.speed(step, peer, published) * max(0.0, now - began) + share

    def speed(self, step: int, peer: str, published: float) -> float:
        committed = self._committed.get(step, {})
        if not committed:
            return published
        own = committed.get(peer, 0.0)
        others = max((v for p, v in committed.items() if p != peer), default=own)
        return max(own, min(published, NEW_SPEED * others))

    def weights(self, step: int, view: CollaborationView, now: float | None = None) -> WeightBounds:
        """The bounds on every peer's weight in ``step``'s round (peers not in ``view``: a newcomer's)."""
        now = time.monotonic() if now is None else now
        limits = {r.peer_id: self.bound(step, r.peer_id, r.samples_per_second, view, now)
                  for r in view.peers if r.role.trains}
        committed = self._committed.get(step, {})
        fastest = max(committed.values(), default=0.0)
        default = self.bound(step, "", NEW_SPEED * fastest, view, now) if fastest else UNSEEN * self.target
        return WeightBounds({p: min(b, MAX_WEIGHT) for p, b in limits.items()}, min(default, MAX_WEIGHT))


def _committed(speeds: dict[str, float]) -> dict[str, float]:
    """Each peer's published speed, at most ``NEW_SPEED`` times the fastest another peer published
    (as published when it is the only one)."""
    if len(speeds) < 2:
        return dict(speeds)
    ranked = sorted(speeds.values(), reverse=True)
    return {p: min(v, NEW_SPEED * (ranked[1] if v == ranked[0] else ranked[0])) for p, v in speeds.items()}
