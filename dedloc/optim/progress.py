"""Progress reporting: what a trainer publishes about its step, and the collaboration's view it reads back.

Every micro-batch, a trainer publishes its progress record (step, samples, speed, fingerprint) and
reads everyone's (``CollaborationView``). Near the target it waits for that read, so that it
starts a micro-batch only while the collaboration is below the target (the bounded-batch
guarantee, optim/optimizer.py). Far from it (``far``: at the measured speeds the target cannot be
reached before a report sent now comes back, plus two micro-batches, with a margin) the report
goes in the background, one at a time, and the last view read stands in.

Every view read passes through two filters before anyone decides on it: the records of peers whose
state this peer refused as a fork are left out (until they publish another), and each peer's
sample count is bounded by what it could have computed (optim/claims.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from dedloc.errors import ForkError
from dedloc.optim.claims import ClaimBounds
from dedloc.optim.port import PeerPort
from dedloc.records import CollaborationView, ProgressRecord, Role

logger = logging.getLogger(__name__)

FAR_MARGIN = 2.0
MAX_VIEW_AGE = 5.0


def far_from_target(view: CollaborationView, me: str, step: int, samples: int, speed: float, age: float,
                    latency: float, mb_time: float, target: int, now: float) -> bool:
    """Whether, at the measured speeds, the collaboration cannot reach ``target`` for ``step``
    before a report sent now comes back, plus two of this peer's micro-batches, with a margin of
    FAR_MARGIN and 0.25 s: then this peer need not wait for a fresh view. ``view``: the last one
    read, ``age`` seconds ago; ``samples``, ``speed``, ``latency``, ``mb_time``: this peer's own
    (in hand, samples/s, a report's round trip, a micro-batch's seconds); ``now``: the wall clock
    the others' record times are on."""
    if view.global_step != step or age > MAX_VIEW_AGE:
        return False
    total, rate = float(samples), speed
    for r in view.trainers_at(step):  # (a loop without calls: 1,000 records per micro-batch at 1,000 peers)
        if r.peer_id != me:
            lag = now - r.time
            total += r.samples + (r.samples_per_second * lag if lag > 0 else 0.0)
            rate += r.samples_per_second
    if rate <= 0:
        return False
    horizon = FAR_MARGIN * (age + latency + 2 * mb_time) + 0.25
    return total + rate * horizon < target


class Ema:
    def __init__(self, alpha: float = 0.2):
        self.alpha, self.value = alpha, 0.0

    def update(self, x: float) -> float:
        self.value = x if self.value == 0 else (1 - self.alpha) * self.value + self.alpha * x
        return self.value


@dataclass
class Seen:
    view: CollaborationView
    at: float
    """``time.monotonic()`` when the read completed."""


@dataclass(frozen=True)
class Facts:
    """What a progress record says about this peer besides its speed and loss (the optimizer's)."""

    step: int
    samples: int
    fingerprint: str
    resyncs: int
    catchups: int
    syncing: bool


class Progress:
    """Publishes this peer's progress and keeps the view of the collaboration it reads back."""

    def __init__(self, peer: PeerPort, target_batch_size: int, run_hash: str = ""):
        self.peer, self.target = peer, target_batch_size
        self.run_hash = run_hash
        """Published with every record (``OptimizerConfig.run_hash``)."""
        self.sps, self.mb_time, self.latency = Ema(), Ema(), Ema()
        self.claims = ClaimBounds(target_batch_size)
        """Bounds each peer's sample count and round weight by what it could have computed (claims.py)."""
        self.seen: Seen | None = None
        self._pending: tuple[cf.Future, float] | None = None
        self.blocking = self.background = 0
        """Progress reports the training loop waited for, and ones sent in the background."""
        self._last_end: float | None = None
        self.loss: tuple[int, float, int] = (-1, 0.0, 0)
        """(step, mean loss, samples) of this peer's last finished step (``note_loss``)."""
        self.forks: dict[str, str] = {}
        """Peer id -> the fingerprint it published (a backbone: its step) when its state was refused as a fork: that record
        is left out of every view (it is not the collaboration's step) until the peer publishes
        another (it stepped back, or moved on)."""
        self.forks_refused = 0
        self.wanted = False
        """A peer asked for a newer state than ours; offered once this peer holds a complete one."""

    # ---- speed ---------------------------------------------------------------------------------------
    def micro_batch(self, batch_size: int) -> None:
        """A micro-batch of ``batch_size`` samples ended now: update the measured speed."""
        now = time.monotonic()
        if self._last_end is not None:
            dt = max(now - self._last_end, 1e-6)
            self.mb_time.update(dt)
            self.sps.update(batch_size / dt)

    def ended(self) -> None:
        """The training loop's step call returns: the next micro-batch's time counts from here."""
        self._last_end = time.monotonic()

    def note_loss(self, step: int, mean_loss: float, samples: int) -> None:
        if samples > 0 and math.isfinite(mean_loss) and mean_loss >= 0:
            self.loss = (step, mean_loss, samples)

    # ---- reports -------------------------------------------------------------------------------------
    def record(self, facts: Facts, busy: bool) -> ProgressRecord:
        now = time.time()
        loss_step, loss, loss_samples = self.loss
        return ProgressRecord(self.peer.peer_id, facts.step, facts.samples, self.sps.value,
                              self.peer.role, 0.0, now, now + self.mb_time.value if busy else 0.0,
                              facts.fingerprint, loss, loss_step, loss_samples, facts.resyncs, facts.catchups,
                              facts.syncing, self.run_hash)

    def report(self, record: ProgressRecord) -> CollaborationView:
        """Publish this peer's progress and read everyone's, waiting for the DHT."""
        sent = time.monotonic()
        view, wanted = self.peer.report(record)
        self.blocking += 1
        return self._saw(view, sent, wanted)

    def _saw(self, view: CollaborationView, sent: float, wanted: bool) -> CollaborationView:
        """Take in a view just read (each peer's samples bounded by what it could have computed)."""
        now = time.monotonic()
        self.latency.update(now - sent)
        view = self.without_forks(view)
        view = self.claims.observe(view, now)
        self.seen = Seen(view, now)
        self.wanted = self.wanted or wanted
        return view

    def cached_view_if_far(self, facts: Facts, busy_record: Callable[[], ProgressRecord]) -> CollaborationView | None:
        """The last view read, if the target is far enough that this micro-batch need not wait for a
        fresh one (a background report of ``busy_record()`` is then sent, one at a time); None if it must."""
        if self._pending is not None and self._pending[0].done():
            (future, sent), self._pending = self._pending, None
            try:
                view, wanted = future.result()
            except Exception as e:
                logger.debug(f"background progress report failed: {e!r}")
                return None  # the synchronous report that follows raises or recovers
            self._saw(view, sent, wanted)
        seen = self.seen
        if seen is None or not self.far(seen, facts):
            return None
        if self._pending is None:
            self._pending = (self.peer.report_async(busy_record()), time.monotonic())
            self.background += 1
        return seen.view

    def far(self, seen: Seen, facts: Facts) -> bool:
        """``far_from_target`` for this peer now."""
        return far_from_target(seen.view, self.peer.peer_id, facts.step, facts.samples, self.sps.value,
                               time.monotonic() - seen.at, self.latency.value, self.mb_time.value, self.target,
                               time.time())

    # ---- forks ---------------------------------------------------------------------------------------
    def without_forks(self, view: CollaborationView) -> CollaborationView:
        """``view`` less the records whose state this peer refused as a fork (``forks``)."""
        if not self.forks:
            return view
        published = {r.peer_id: _fork_key(r) for r in view.peers}
        self.forks = {p: f for p, f in self.forks.items() if published.get(p) == f}
        return view.without(set(self.forks))

    def refused_forks(self, error: Exception, view: CollaborationView) -> CollaborationView:
        """Remember the donors that ``error`` (if a ForkError) refused as forks, at the fingerprint
        they publish in ``view`` (a backbone, which publishes none: at its step); returns ``view``
        without them, until they publish another."""
        if isinstance(error, ForkError):
            published = {r.peer_id: _fork_key(r) for r in view.peers}
            for donor in error.peers:
                self.forks_refused += 1
                if published.get(donor):
                    self.forks[donor] = published[donor]
        return self.without_forks(view)


def _fork_key(record: ProgressRecord) -> str:
    """What a donor refused as a fork is remembered by: the fingerprint it publishes, or, for a
    backbone (which publishes none), its step. Left in the view, a backbone holding a forked
    checkpoint would keep every resync's target at its step (a backbone's step is the run's), where
    every donor is refused, until the resync gives up."""
    return record.fingerprint or (f"{record.step}:" if record.role == Role.BACKBONE else "")


__all__ = ["Progress", "Facts", "far_from_target", "Seen", "Ema", "FAR_MARGIN", "MAX_VIEW_AGE"]
