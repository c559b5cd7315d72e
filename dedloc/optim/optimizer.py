"""The collaborative optimizer: many peers' micro-batches become one large-batch optimizer step.

Usage (an ordinary training loop, plus two lines)::

    opt = CollaborativeOptimizer(torch.optim.AdamW(model.parameters()), peer,
                                 OptimizerConfig(target_batch_size=4096), scheduler=sched, model=model)
    for batch in loader:
        model(**batch).loss.backward()
        opt.step(batch_size=len(batch["input_ids"]))   # accumulates; steps when the collaboration is full

Guarantees:
- *Large-batch equivalence.* Each global step applies the gradient of the mean loss over exactly
  the samples the collaboration processed for it (micro-batch gradients weighted by size), once,
  with the same optimizer, scheduler and clipping on every peer.
- *Bounded batch.* Near the target, a peer starts a micro-batch only after reading (from the DHT,
  after publishing its own count) that the collaboration is below ``target_batch_size``; so a
  step's realised batch is in ``[B, B + one micro-batch per peer)`` unless peers fail or the
  collaboration suddenly runs more than twice as fast as measured. Far from the target (when, at
  the measured speeds, it cannot be reached within twice the time a report takes to come back plus
  two micro-batches, plus a quarter second), the count is published and read in the background instead:
  the training loop does not wait for the DHT on every micro-batch.
- *Identical parameters.* All peers in a round apply the same averaged gradient. A peer that
  missed a round, failed one, or whose parameter hash disagrees with the majority drops its local
  gradients and downloads the state (parameters, optimizer, scheduler, scale, step) from a peer.
- *Delayed updates* (``delay_updates``): the round for step s runs in the background while step
  s+1's micro-batches are computed; the update is applied between micro-batches, and always
  before step s+2's micro-batches are computed (staleness at most one step).
- *Catching up* (delayed updates only): a peer whose round for step s failed or closed without it
  (typically a newcomer, whose downloaded state is one step behind a round already in flight) keeps
  its gradients for step s+1 -- computed on step s's parameters, as everyone's are while round s is in
  flight -- and downloads the state of step s+1 in the background in place of round s's update. It
  joins round s+1 with those gradients, and waits for the download before computing step s+2's.
  Only its contribution to step s is lost. A state of step s+2, arriving after it joined round
  s+1, already holds that round: the peer takes it as is. Anything newer means the collaboration
  moved on without it: its gradients are dropped, as in a resync. While catching up it does not
  take a step ahead of every other reachable trainer (it could not hand that step on); it holds
  the round, gradients kept, until another one reaches its step.
- *Only peers that can hand the state on lead* (``CollaborationView.global_step``): a client-mode
  peer never takes a step that no reachable trainer has reached; it holds its round meanwhile.
- The scheduler and the logs follow the global step.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dedloc.averaging.outcome import RoundOutcome
from dedloc.config import OptimizerConfig
from dedloc.errors import (AveragingError, DedlocError, ForkError, MatchmakingError, ProtocolError, RuntimeClosedError,
                           StateError)
from dedloc.logs import OncePerStep
from dedloc.state import lineage
from dedloc.optim.accumulator import GradientAccumulator
from dedloc.optim.claims import ClaimBounds
from dedloc.optim.hand_on import hand_on
from dedloc.optim import step_rules
from dedloc.optim.scaling import CollaborativeScale
from dedloc.optim.step_rules import FRESH_GRACE
from dedloc.peer import Peer
from dedloc.records import CollaborationView, ProgressRecord, Role
from dedloc.state import snapshot

logger = logging.getLogger(__name__)


class StepOutcome(str, enum.Enum):
    ACCUMULATED = "accumulated"  # the micro-batch was added; the global batch is not full yet
    STEPPED = "stepped"  # the micro-batch closed a global step (applied now, or later with delayed updates)
    SKIPPED = "skipped"  # the round ran, but every member's gradient overflowed: all skipped the update
    RESYNCED = "resynced"  # this peer was out of sync: local gradients dropped, state downloaded


@dataclass
class RoundRecord:
    """One global step as this peer saw it."""

    step: int
    local_samples: int
    batch: float
    """Samples in the averaged gradient: the realised global batch."""
    group_size: int
    averaging_s: float
    skipped: bool
    contributors: tuple[str, ...] = ()
    """Peer ids with weight > 0 that no part this member saw excluded. Until the parts agree on one
    contributor set, a sender that died mid-round can be in some parts and not others."""
    members: tuple[str, ...] = ()
    """Peer ids of the round's group (contributing or not); the next round expects them."""


@dataclass
class _Seen:
    view: CollaborationView
    at: float
    """``time.monotonic()`` when the read completed."""


FAR_MARGIN = 2.0
MAX_VIEW_AGE = 5.0


@dataclass
class _CatchUp:
    min_step: int
    future: cf.Future
    """Of ``Peer.download_state``'s (step, blob, donor)."""
    started: float
    heard: dict[str, float] = field(default_factory=dict)
    """Each peer's record's publish time in the view read at the start (step_rules.heard_from_others)."""
    missed_until: float | None = None
    """Until when (wall clock) the round of ``min_step - 1`` that this peer missed may still run, read
    once from its closed records (``_waits_for_missed_round``); 0.0 if none runs."""


@dataclass
class _Inflight:
    step: int
    vector: torch.Tensor
    future: cf.Future
    finish: Callable[[], RoundOutcome]
    local_samples: int
    started: float
    overflowed: bool = False


class _Ema:
    def __init__(self, alpha: float = 0.2):
        self.alpha, self.value = alpha, 0.0

    def update(self, x: float) -> float:
        self.value = x if self.value == 0 else (1 - self.alpha) * self.value + self.alpha * x
        return self.value


def _ceiling(view: CollaborationView, wanted: int) -> int:
    """The newest step a download for ``wanted`` accepts: one past the step the run attests
    (``CollaborationView.global_step``; a catch-up is one step behind a round that just ended), so
    a member publishing a far step of its own serves it to nobody."""
    return max(view.global_step, wanted) + 1


class CollaborativeOptimizer:
    """Wraps any ``torch.optim`` optimizer (and its scheduler) for a collaboration; see module docs."""

    def __init__(self, optimizer: torch.optim.Optimizer, peer: Peer, config: OptimizerConfig | None = None, *,
                 scheduler: Any = None, scaler: "torch.amp.GradScaler | None" = None,
                 model: torch.nn.Module | None = None,
                 on_contribute: Callable[[int, int], None] | None = None):
        """``on_contribute(step, samples)`` is called just before this peer sends its gradients for
        ``step`` (all micro-batches accumulated since the last round or drop), from the training
        thread; an exception in it propagates."""
        self.opt, self.peer = optimizer, peer
        self.on_contribute = on_contribute
        self.config = (config or OptimizerConfig()).validate()
        self.scheduler, self.model = scheduler, model
        self.scale = CollaborativeScale(scaler) if scaler is not None else None
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.acc = GradientAccumulator(self.params)
        tensors = list(model.parameters()) + list(model.buffers()) if model is not None else self.params
        self._max_state_bytes = self.config.max_state_bytes or (
            4 * sum(t.numel() * t.element_size() for t in tensors) + (64 << 20))
        """A donor announcing a bigger state is refused before its bytes are read."""
        self.global_step = 0
        """The global step this peer's micro-batches currently count toward."""
        self.applied_step = 0
        """How many global updates the parameters have received (== global_step unless one is in flight)."""
        self.history: list[RoundRecord] = []
        self.resyncs = 0
        """State downloads that dropped this peer's gradients (joining counts as one)."""
        self.catchups = 0
        """Missed updates replaced by a state downloaded in the background, gradients kept (delayed updates)."""
        self.skipped_steps = 0
        """Steps whose round failed for every member (delayed updates): skipped by all, parameters unchanged."""
        self.forks_refused = 0
        """Downloaded states refused because they rewrite steps the collaboration took otherwise."""
        self._forks: dict[str, str] = {}
        """Peer id -> the fingerprint it published when its state was refused as a fork: that record
        is left out of every view (it is not the collaboration's step) until the peer publishes
        another (it stepped back, or moved on)."""
        self._inflight: _Inflight | None = None
        self._catchup: _CatchUp | None = None
        self._syncing = False
        """Inside ``_resync`` (published: such a peer takes no round before it holds a state)."""
        self._wanted = False
        """A peer asked for a newer state than ours; offered once this peer holds a complete one."""
        self._offered: tuple[int, str] | None = None
        """The state last offered (``_fingerprint_of_state``): a resync offers the one it holds unless it did."""
        self._sps, self._mb_time, self._latency = _Ema(), _Ema(), _Ema()
        self._claims = ClaimBounds(self.config.target_batch_size)
        """Bounds each peer's sample count and round weight by what it could have computed (claims.py)."""
        self._seen: _Seen | None = None
        self._pending: tuple[cf.Future, float] | None = None
        self.blocking_reports = self.background_reports = 0
        """Progress reports the training loop waited for, and ones sent in the background."""
        self._last_end: float | None = None
        self._fingerprint = self._hash()
        self._loss: tuple[int, float, int] = (-1, 0.0, 0)
        """(step, mean loss, samples) of this peer's last finished step (note_loss)."""
        self._lineage = lineage.extend({}, self._fingerprint)
        """Fingerprints of the recent steps these parameters went through (travels with the state)."""
        self._closed = False
        self._noted = OncePerStep(logger)
        """Conditions met again and again within a step (held back, already holds the state): INFO once."""
        view = self._report(busy=False)
        if view.global_step > self.global_step or self._disagrees(view):
            self._resync(view, "joining a collaboration at step %d" % view.global_step)

    # ---- the training loop's entry points ----------------------------------------------------------------
    def step(self, batch_size: int) -> StepOutcome:
        """Add this micro-batch's gradients (call after ``backward``); take the global step when it is due.

        Returns what happened. Raises StateError if this peer is out of sync and no peer can send
        the state, RuntimeClosedError if the peer was closed.
        """
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if self._closed:
            raise RuntimeClosedError("the collaborative optimizer is closed")
        now = time.monotonic()
        if self._last_end is not None:
            dt = max(now - self._last_end, 1e-6)
            self._mb_time.update(dt)
            self._sps.update(batch_size / dt)
        try:
            self.acc.add(batch_size, self.scale.current() if self.scale else 1.0)
            self._zero_grads()
            if self._catchup is not None and self._catchup.future.done() and not self._land_catchup(wait=False):
                return StepOutcome.RESYNCED
            if self._inflight is not None and self._inflight.future.done() and not self._finish_inflight():
                return StepOutcome.RESYNCED
            view = self._cached_view_if_far()
            if view is None:
                view = self._report(busy=True)
            checkpointed = step_rules.checkpointed_past(view, self.global_step)
            if view.global_step > self.global_step + 1 or checkpointed or self._disagrees(view):
                self._resync(view, f"the collaboration is at step {view.global_step}" if
                             view.global_step > self.global_step + 1 else checkpointed or self._disagreement(view))
                return StepOutcome.RESYNCED
            if view.samples_at(self.global_step) < self.config.target_batch_size and \
                    view.global_step <= self.global_step:
                return StepOutcome.ACCUMULATED
            if self._held_back_alone(view) or self._waits_for_missed_round(view):
                return StepOutcome.ACCUMULATED
            return self._round(view)
        finally:
            self._last_end = time.monotonic()

    def offer_state(self) -> None:
        """Make the current state downloadable right away (e.g. before a planned stop, for a backbone)."""
        if self._inflight is not None:
            self._finish_inflight()
        self._wanted = False
        self.peer.offer_state(self.applied_step, snapshot.encode(self.state_dict()),
                              [f for _, f in sorted(self._lineage.items())])
        self._offered = self._fingerprint_of_state()

    def report(self) -> CollaborationView:
        """Publish this peer's progress now (step, samples, parameter hash) and read everyone's.

        The training loop's ``step`` does this by itself; call it when the loop has stopped but the
        peer stays, e.g. before leaving, so that the others (a backbone) see the step it holds: the
        record sent before its last round still names the step before."""
        return self._report(busy=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grads()

    def close(self) -> None:
        """Apply an update still in flight; if this trainer holds a step no other peer that serves
        its state holds yet, serve it until one does (``hand_on_timeout``, optim/hand_on.py); then
        tell the others this peer left. A KeyboardInterrupt during that wait ends it, and is raised
        again once the others were told. Does not close the peer."""
        if self._closed:
            return
        if self._inflight is not None:
            self._finish_inflight(resync=False)
        self._catchup = None  # the download, if any, finishes in the background and is ignored
        interrupted = None
        if self.peer.role == Role.TRAINER and self.config.hand_on_timeout > 0:
            try:
                hand_on(self, self.config.hand_on_timeout)
            except KeyboardInterrupt as e:
                logger.info(f"interrupted: leaving at step {self.applied_step} without handing it on")
                interrupted = e
            except Exception as e:
                logger.debug(f"could not hand the state on: {e!r}")
        self._closed = True
        try:
            self.peer.leave()
        except Exception as e:
            logger.debug(f"could not announce leaving: {e!r}")
        if interrupted is not None:
            raise interrupted

    @property
    def view(self) -> CollaborationView | None:
        """The collaboration's progress as this peer last read it (None before the first read)."""
        return self._seen.view if self._seen is not None else None

    @property
    def _windows(self) -> step_rules.Windows:
        avg = self.peer.averaging
        return step_rules.Windows(avg.matchmaking_time, avg.averaging_timeout, self.config.state_timeout)

    @property
    def samples_per_second(self) -> float:
        """This peer's smoothed training speed (what it publishes)."""
        return self._sps.value

    # ---- one global step ---------------------------------------------------------------------------------
    def _round(self, view: CollaborationView) -> StepOutcome:
        if self._inflight is not None:  # delayed updates: the previous step must land first
            if not self._finish_inflight():
                return StepOutcome.RESYNCED
        step = self.global_step
        peers = view.trainers_at(step)
        me = self.peer.peer_id
        busy_until = max((r.busy_until for r in peers if r.peer_id != me), default=0.0)
        gather = min(self.config.max_gather_wait,
                     max(self.peer.averaging.matchmaking_time, busy_until - time.time() + 1.0))
        vector, finite = self.acc.export()
        weight = float(self.acc.samples)
        if not finite:  # its samples leave the step; the others' still make it (no member can veto a step)
            logger.warning(f"step {step}: this peer's accumulated gradient has NaN/inf values"
                           + (" (its loss scale backs off)" if self.scale is not None else "")
                           + f"; its {self.acc.samples} samples are left out of this step")
            vector.zero_()
            weight = 0.0
        local_samples = self.acc.samples if finite else 0
        if self.on_contribute is not None:
            self.on_contribute(step, local_samples if weight > 0 else 0)
        started = time.monotonic()
        last = self.history[-1] if self.history else None
        expected = view.expected_at(step, me, last.members if last and last.step == step - 1 else ()) \
            + len(view.aggregators)
        kwargs = dict(step=step, weight=weight, expected_peers=expected, gather_time=gather,
                      bounds=self._claims.weights(step, view))
        if self.config.delay_updates:
            future, finish = self.peer.average_async(vector, **kwargs)
            self._inflight = _Inflight(step, vector, future, finish, local_samples, started, not finite)
            self.global_step = step + 1
            self.acc.reset()
            # step's gradients were computed on step-1's parameters while step-1's update was being
            # downloaded; step+1's need it: wait for it now that this round is under way
            if self._catchup is not None and not self._land_catchup():
                return StepOutcome.RESYNCED
            return StepOutcome.STEPPED
        try:
            stats = self.peer.average(vector, **kwargs)
        except (MatchmakingError, AveragingError) as e:
            self._resync(self.peer.collaboration(), f"step {step} failed: {e}")
            return StepOutcome.RESYNCED
        return self._apply(step, vector, stats, local_samples, started, not finite)

    def _finish_inflight(self, resync: bool = True) -> bool:
        """Wait for the background round and apply it. On failure, catch up in the background
        (gradients kept, returns True), or, when ``resync`` is False, just log it (returns False)."""
        inflight, self._inflight = self._inflight, None
        try:
            stats = inflight.finish()
        except (MatchmakingError, AveragingError) as e:
            if resync:
                self._start_catchup(inflight.step + 1, f"step {inflight.step} failed: {e}")
                return True
            logger.warning(f"step {inflight.step} failed while leaving: {e}")
            return False
        self._apply(inflight.step, inflight.vector, stats, inflight.local_samples, inflight.started, inflight.overflowed)
        return True

    def _start_catchup(self, step: int, reason: str) -> None:
        """Download the state of ``step`` (or later) in the background, in place of the update that
        this peer's parameters lack; keep accumulating for ``step`` meanwhile."""
        view = self.peer.collaboration()
        donors = self._donors(view, step)
        logger.info(f"{reason}; catching up: downloading the state of step >= {step} in the background, "
                    f"still accumulating for step {self.global_step}")
        self._catchup = _CatchUp(step, self.peer.download_state_async(donors, step, self.config.state_timeout,
                                                                      self._max_state_bytes, self._votes(view),
                                                                      _ceiling(view, step)),
                                 time.monotonic(), {r.peer_id: r.time for r in view.peers})
        self.catchups += 1

    def _land_catchup(self, wait: bool = True) -> bool:
        """Load the catch-up download; False if the gradients in hand were dropped. With ``wait``
        False (the download failed but may yet succeed), a retry goes on in the background.

        If no peer has the state (the round failed for every member), the members agree that the
        step is lost: each skips it, parameters unchanged, once no live peer shows the update
        applied, no training peer is still at that step (it may yet take it: e.g. the others, whose
        round had not started when this peer's failed; this wait is bounded by a round's length,
        ``2 * matchmaking_time + averaging_timeout + FRESH_GRACE``, and by ``state_timeout``), no
        group that closed the step may still finish its round (its leader's deadline, published in
        its closed record, plus ``CLOSED_GRACE``; bounded by ``state_timeout``), the round's
        stragglers have had ``2 * matchmaking_time + FRESH_GRACE`` to publish it, and the view brings
        a record from another peer published since the catch-up started (not a stale local copy;
        bounded by ``state_timeout``). ``_why_skip_waits`` checks these."""
        catchup, self._catchup = self._catchup, None
        while True:
            downloaded = False
            try:
                step, blob, donor = catchup.future.result(self.config.state_timeout + 30)
                downloaded = True
                state = snapshot.decode(blob)
                self._check_lineage(state, donor, self.peer.collaboration())
                break
            except (StateError, ProtocolError, cf.TimeoutError) as e:
                view = self._refused_forks(e, self._report(busy=False))
                lost = catchup.min_step - 1
                if self.config.verify_sync and step_rules.skip_published(view, self.peer.peer_id, catchup.min_step,
                                                                         self._fingerprint):  # another member concluded first
                    self._skip_lost_step(lost, view, followed=True)
                    return True
                if isinstance(e, ProtocolError) and downloaded:  # its bytes are not a state, or a fork: start over
                    self._resync(view, f"catching up failed: {e}")
                    return False
                # (forks refused at their header are left out of the view now: no longer donors, nor "held")
                why = self._why_skip_waits(view, catchup)
                if why is not None:
                    logger.debug(f"step {lost}: lost so far, not skipped yet: {why}")
                    if wait:
                        time.sleep(0.5)  # a member whose round succeeded may not have published it yet
                    catchup = _CatchUp(catchup.min_step, self.peer.download_state_async(
                        self._donors(view, catchup.min_step), catchup.min_step, FRESH_GRACE, self._max_state_bytes,
                        self._votes(view), _ceiling(view, catchup.min_step)), catchup.started, catchup.heard)
                    if not wait:
                        self._catchup = catchup
                        return True
                    continue
                self._skip_lost_step(lost, view)
                return True
        inflight, global_step = self._inflight, self.global_step
        self.load_state_dict(state)  # sets both steps to the state's
        kept = True
        if inflight is not None and step == inflight.step:  # the round under way applies on top of it
            self.global_step = global_step
        elif step == global_step:  # it opens the step being accumulated (and holds any round before it)
            self._drop_inflight()
        else:  # the collaboration moved on without this peer: its work in hand is for an older state
            self._drop_inflight()
            self.acc.reset()
            self._zero_grads()
            self.resyncs += 1
            kept = False
        logger.info(f"caught up: state of step {step} downloaded from {donor} ({len(blob) / 1e6:.1f} MB, "
                    f"{time.monotonic() - catchup.started:.2f} s)" +
                    ("" if kept else f"; the collaboration had moved on, so the gradients for step "
                                     f"{global_step} were dropped"))
        return kept

    def _why_skip_waits(self, view: CollaborationView, catchup: _CatchUp) -> str | None:
        """Why the step that ``catchup`` replaces may not be skipped yet (None: it is lost for every
        peer alive): step_rules.skip_waits, then whether a round of it may still finish
        (``_round_may_finish``). ``_land_catchup`` states the conditions and their bounds."""
        waited = time.monotonic() - catchup.started
        why = step_rules.skip_waits(view, self.peer.peer_id, catchup.min_step, waited, catchup.heard, self._windows)
        if why is None and self._round_may_finish(catchup.min_step - 1, waited):
            return "a round of it may still finish"
        return why

    def _round_may_finish(self, step: int, waited: float) -> bool:
        """Whether a group that closed ``step`` may still finish its round (step_rules.round_may_finish),
        read from the step's closed records; bounded by ``state_timeout`` from the catch-up's start;
        a DHT that cannot be read counts as "may"."""
        if waited >= self.config.state_timeout:
            return False
        try:
            until = self.peer.round_deadline(step)
        except (DedlocError, cf.TimeoutError) as e:
            logger.debug(f"step {step}: could not read its closed rounds ({e!r}); waiting on")
            return True
        if step_rules.round_may_finish(until, time.time()):
            self._noted.log(step, "round runs", f"step {step}: a round of it may still finish (its deadline is "
                            f"{until - time.time():.0f} s ahead): waiting for it before skipping the step")
            return True
        return False

    def _held_back_alone(self, view: CollaborationView) -> bool:
        """Whether this peer holds back its round (step_rules.held_back_alone: a client-mode peer, or
        one still catching up, would take the step ahead of every reachable trainer); INFO once per step."""
        why = step_rules.held_back_alone(view, self.peer.peer_id, self.global_step, self.peer.role == Role.CLIENT,
                                         self._catchup is not None)
        if why is None:
            self._noted.forget(self.global_step, "held back")
            return False
        self._noted.log(self.global_step, "held back", why)
        return True

    def _waits_for_missed_round(self, view: CollaborationView) -> bool:
        """Whether to hold back this step's round (keeping the gradients) because the others at the
        step are still in the round of the step before, which this peer missed (delayed updates: it
        catches up on that step). They publish this step while that round runs (each accumulates for
        the next step meanwhile), but none can join a round of it before its own round ends: a round
        started now would close without them, and they would miss it: the step would be both taken
        (by this peer alone) and skipped (by them), a fork.

        Holds while a group that closed that step may still finish (its closed record's deadline,
        read once per catch-up), no peer that serves its state publishes that step's update applied,
        and no peer is ready for this step's round yet (its ready record: a member starts this round
        the moment its own ends, and publishes its progress only after its next micro-batch); at
        most a round's length from the catch-up's start. A DHT that cannot be read does not hold it
        back."""
        catchup, step = self._catchup, self.global_step
        if catchup is None or not step_rules.others_in_missed_round(view, self.peer.peer_id, step, catchup.min_step,
                                                                    time.monotonic() - catchup.started, self._windows):
            return False
        if catchup.missed_until is None:
            try:
                catchup.missed_until = self.peer.round_deadline(step - 1) or 0.0
            except (DedlocError, cf.TimeoutError) as e:
                logger.debug(f"step {step - 1}: could not read its closed rounds ({e!r}); not waiting for them")
                catchup.missed_until = 0.0
        if time.time() >= catchup.missed_until:
            return False
        try:
            if self.peer.pending_round(step) > 0:
                return False
        except (DedlocError, cf.TimeoutError) as e:
            logger.debug(f"step {step}: could not read its ready records ({e!r}); not waiting")
            return False
        self._noted.log(step, "missed round runs", f"step {step}: the others at it are still in the round of step "
                        f"{step - 1} that this peer missed; it keeps accumulating until they can join a round of "
                        f"step {step}")
        return True

    def _skip_lost_step(self, step: int, view: CollaborationView, followed: bool = False) -> None:
        """Every member lost the round of ``step``: count it as taken without an update, as they all do
        (``followed``: another peer concluded so first). The log names what ``view`` showed."""
        self.applied_step = step + 1
        self._fingerprint = self._hash()
        self._lineage = lineage.extend(self._lineage, self._fingerprint)
        self.skipped_steps += 1
        self.history.append(RoundRecord(step, 0, 0.0, 0, 0.0, True))
        others = [r for r in view.peers if r.peer_id != self.peer.peer_id]
        newest = max((a for r in others if (a := r.applied_step) is not None), default=None)
        why = "another peer skipped it" if followed else \
            f"none of the {len(others)} other peers in view holds its update; the newest holds step {newest}"
        logger.warning(f"step {step} was lost by every member ({why}): skipped by all, parameters unchanged; "
                       f"still accumulating for step {self.global_step}")

    def _apply(self, step: int, vector: torch.Tensor, stats: RoundOutcome, local_samples: int,
               started: float, overflowed: bool = False) -> StepOutcome:
        """Apply the averaged gradient of ``step``; skipped (parameters unchanged) only when no member
        contributed to it (``total_weight`` 0: every member's gradient overflowed), which every
        member sees alike. The vector's last entry, once an overflow flag any member could set to
        make all skip, is ignored. The loss scale follows this peer's own overflows
        (``overflowed``), as a GradScaler does."""
        overflow = stats.total_weight <= 0
        if not overflow:
            self.acc.load_grads(vector)
            if self.config.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.config.clip_grad_norm)
            self.opt.step()
            if self.scheduler is not None:
                self.scheduler.step()
        if self.scale is not None:
            self.scale.update(overflowed)
        self._zero_grads()
        self.applied_step = step + 1
        if not self.config.delay_updates:
            self.global_step = step + 1
            self.acc.reset()
        self._fingerprint = self._hash()
        self._lineage = lineage.extend(self._lineage, self._fingerprint)
        if self._wanted and self._catchup is None:
            # a peer waits for a newer state: offer it between applying this update and starting the
            # next round (when rounds outlast compute, no report falls in that gap)
            self.offer_state()
        contributors = stats.contributors if stats.contributors is not None else tuple(
            p for p, w in zip(stats.peers, stats.weights) if w > 0 and p not in stats.excluded)
        record = RoundRecord(step, local_samples, stats.total_weight, stats.group_size, time.monotonic() - started,
                             overflow, contributors, stats.peers)
        self.history.append(record)
        logger.info(f"step {step} averaged with {record.group_size} peers, batch {record.batch:.0f} samples, "
                    f"in {record.averaging_s:.2f} s" + (" (no member's gradient was finite: step skipped by all)"
                                                        if overflow else ""))
        return StepOutcome.SKIPPED if overflow else StepOutcome.STEPPED

    # ---- progress and sync -------------------------------------------------------------------------------
    def note_loss(self, step: int, mean_loss: float, samples: int) -> None:
        """This peer's mean training loss over its ``samples`` samples of global step ``step``,
        published with its next progress record (the monitor pools it per step)."""
        if samples > 0 and math.isfinite(mean_loss) and mean_loss >= 0:
            self._loss = (step, mean_loss, samples)

    def _record(self, busy: bool) -> ProgressRecord:
        now = time.time()
        loss_step, loss, loss_samples = self._loss
        return ProgressRecord(self.peer.peer_id, self.global_step, self.acc.samples, self._sps.value,
                              self.peer.role, 0.0, now, now + self._mb_time.value if busy else 0.0,
                              self._fingerprint, loss, loss_step, loss_samples, self.resyncs, self.catchups,
                              self._syncing)

    def _report(self, busy: bool) -> CollaborationView:
        """Publish this peer's progress and read everyone's, waiting for the DHT."""
        sent = time.monotonic()
        view, wanted = self.peer.report(self._record(busy))
        self.blocking_reports += 1
        return self._saw(view, sent, wanted)

    def _saw(self, view: CollaborationView, sent: float, wanted: bool) -> CollaborationView:
        """Take in a view just read (each peer's samples bounded by what it could have computed)."""
        now = time.monotonic()
        self._latency.update(now - sent)
        view = self._without_forks(view)
        view = self._claims.observe(view, now)
        self._seen = _Seen(view, now)
        self._wanted = self._wanted or wanted
        if self._wanted and self._inflight is None and self._catchup is None:
            self.offer_state()
        return view

    def _without_forks(self, view: CollaborationView) -> CollaborationView:
        """``view`` less the records whose state this peer refused as a fork (``_forks``)."""
        if not self._forks:
            return view
        published = {r.peer_id: r.fingerprint for r in view.peers}
        self._forks = {p: f for p, f in self._forks.items() if published.get(p) == f}
        return view.without(set(self._forks))

    def _refused_forks(self, error: Exception, view: CollaborationView) -> CollaborationView:
        """Remember the donors that ``error`` (if a ForkError) refused as forks, at the fingerprint
        they publish in ``view``; returns ``view`` without them."""
        if isinstance(error, ForkError):
            published = {r.peer_id: r.fingerprint for r in view.peers}
            for donor in error.peers:
                self.forks_refused += 1
                if published.get(donor):
                    self._forks[donor] = published[donor]
        return self._without_forks(view)

    def _cached_view_if_far(self) -> CollaborationView | None:
        """The last view read, if the target is far enough that this micro-batch need not wait for a
        fresh one (a background report is then sent, one at a time); None if it must."""
        if self._pending is not None and self._pending[0].done():
            (future, sent), self._pending = self._pending, None
            try:
                view, wanted = future.result()
            except Exception as e:
                logger.debug(f"background progress report failed: {e!r}")
                return None  # the synchronous report that follows raises or recovers
            self._saw(view, sent, wanted)
        seen = self._seen
        if seen is None or not self._far(seen):
            return None
        if self._pending is None:
            self._pending = (self.peer.report_async(self._record(busy=True)), time.monotonic())
            self.background_reports += 1
        return seen.view

    def _far(self, seen: _Seen) -> bool:
        """At the measured speeds, the collaboration cannot reach the target before a report sent
        now comes back, plus two of this peer's micro-batches, with a margin of FAR_MARGIN and 0.25 s."""
        view = seen.view
        age = time.monotonic() - seen.at
        if view.global_step != self.global_step or age > MAX_VIEW_AGE:
            return False
        me, now = self.peer.peer_id, time.time()
        samples, speed = float(self.acc.samples), self._sps.value
        for r in view.trainers_at(self.global_step):
            if r.peer_id != me:
                samples += r.samples + r.samples_per_second * max(0.0, now - r.time)
                speed += r.samples_per_second
        if speed <= 0:
            return False
        horizon = FAR_MARGIN * (age + self._latency.value + 2 * self._mb_time.value) + 0.25
        return samples + speed * horizon < self.config.target_batch_size

    def _fingerprint_of_state(self) -> tuple[int, str]:
        """What identifies the state this peer holds (its applied step and parameters' fingerprint)."""
        return self.applied_step, self._fingerprint

    def _hash(self) -> str:
        if not self.config.verify_sync:
            return ""
        return f"{self.applied_step}:{snapshot.fingerprint(self.params)}"

    def _disagrees(self, view: CollaborationView) -> bool:
        """This peer's parameters differ from the majority's at its step, or its recent history is
        a fork that the live peers outvote (see state/lineage.py)."""
        if not self.config.verify_sync or self._inflight is not None or self._catchup is not None:
            return False
        consensus = view.consensus_fingerprint(self.applied_step)
        return (consensus is not None and consensus != self._fingerprint) or self._forked(view)

    def _forked(self, view: CollaborationView) -> bool:
        """Whether the live peers outvote this peer's recent history (its own vote counts as theirs
        do: a client's only while a trainer holds the same parameters, ``CollaborationView.votes``)."""
        me = self.peer.peer_id
        own = me if view.votes(self._record(busy=False)) else None
        return lineage.votes(self._lineage, view, exclude=me).outvoted(own=own)

    def _disagreement(self, view: CollaborationView) -> str:
        if self._forked(view):
            return (f"this peer's parameters since step {lineage.first_conflict(self._lineage, view)} are a fork "
                    f"that the other peers outvote")
        return "parameters differ from the majority's"

    def _state_fingerprint(self, state: dict[str, Any]) -> str | None:
        """The fingerprint these parameters would have after loading ``state`` (None: cannot tell)."""
        try:
            if self.model is not None:
                names = {id(p): n for n, p in self.model.named_parameters()}
                tensors = [state["model"][names[id(p)]] for p in self.params]
            else:
                tensors = list(state["params"])
            return f"{int(state['step'])}:{snapshot.fingerprint(tensors)}"
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def _votes(self, view: CollaborationView) -> dict[str, str] | None:
        """The live peers' fingerprints, for refusing a forked donor at its state's header."""
        return lineage.fingerprints(view) if self.config.verify_sync else None

    def _check_lineage(self, state: dict[str, Any], donor: str, view: CollaborationView) -> None:
        """Refuse (ProtocolError) a state whose history the live peers outvote: adopting it would
        rewrite steps the collaboration already took with other parameters."""
        if not self.config.verify_sync:
            return
        own = self._state_fingerprint(state)
        if own is None:
            return  # it does not fit the model: loading it raises StateError by name
        history = lineage.extend(lineage.of_state(state), own)
        if lineage.votes(history, view).outvoted(own=donor):
            at = lineage.first_conflict(history, view)
            raise ForkError(f"its state of step {state['step']} rewrites step {at}, which the collaboration "
                            f"took with other parameters (a fork): refused", peers=(donor,))
        consensus = view.consensus_fingerprint(int(state["step"]))
        if consensus is not None and consensus != own:
            raise ForkError(f"its parameters of step {state['step']} ({own}) are not the ones most peers hold at that "
                            f"step ({consensus}): refused", peers=(donor,))

    def _donors(self, view: CollaborationView, step: int) -> list[str]:
        me = self.peer.peer_id
        consensus = view.consensus_fingerprint(step)
        ranked: list[tuple[int, float, str]] = []
        for r in view.peers:
            if r.peer_id == me or not r.role.serves or r.step < step:
                continue
            tier = 0 if r.role.trains and (consensus is None or r.fingerprint in ("", consensus)) else \
                1 if r.role.trains else 2
            ranked.append((tier, random.random(), r.peer_id))
        return [p for _, _, p in sorted(ranked)]

    def _drop_inflight(self) -> None:
        """Forget the round in flight, once it has ended: until then the runtime still writes its result
        into the shared buffer that the next round's input goes to."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            avg = self.peer.averaging
            cf.wait([inflight.future], timeout=self.config.max_gather_wait + 2 * avg.matchmaking_time
                    + avg.averaging_timeout + 30)

    def _sync_target(self, view: CollaborationView) -> tuple[int | None, list[str]]:
        """The step to download and the donors to try; (None, []) if this peer already holds the
        collaboration's state (nothing to download: e.g. a round that failed for every member)."""
        me = self.peer.peer_id
        if self.config.verify_sync and self._forked(view):  # step back to the history the others took
            theirs = set(lineage.votes(self._lineage, view, exclude=me).disagree)
            target = max((r.applied_step or 0) for r in view.peers if r.peer_id in theirs)
            return target, [d for d in self._donors(view, target) if d in theirs]
        target = view.global_step
        if target <= self.applied_step and not self._disagrees(view):
            return None, []
        return target, self._donors(view, target)

    def _resync(self, view: CollaborationView, reason: str) -> None:
        """Drop the gradients in hand and load the collaboration's state (downloaded unless this peer
        already holds it).

        It keeps trying while some reachable peer advertises the state (donors that are busy, behind
        or slow are transient under churn: a warning is logged every ``state_timeout``), re-reading
        the target each time; it returns as soon as the collaboration is back at this peer's state.
        It raises StateError only when, for ``state_timeout`` on end, no reachable peer that this peer
        has not refused advertised the state (e.g. only client-mode peers hold it: they cannot send it).

        While it waits, the runtime keeps this peer's (emptied) progress record alive, so the others
        still see it and a newcomer never mistakes an older checkpoint for the collaboration's state.

        It first offers the state it holds (when complete: no update in flight), so that peers
        stepping back to its history can download it meanwhile: after a partition healed, both
        sides resynced toward each other and neither served the state it held (a deadlock)."""
        if self._inflight is None and self._catchup is None and self._offered != self._fingerprint_of_state():
            self.offer_state()
        self._syncing = True
        try:
            downloaded = self._download_collaboration_state(view, reason)
        finally:
            self._syncing = False
        if downloaded:
            self._report(busy=False)

    def _download_collaboration_state(self, view: CollaborationView, reason: str) -> bool:
        """``_resync``'s work; True if it loaded a downloaded state, False if it holds the state already."""
        self._drop_inflight()
        self._catchup = None
        self.acc.reset()
        self._zero_grads()
        view = self._report(busy=False)  # the dropped samples must not count toward the step any more
        target, donors = self._sync_target(view)
        if target is None:  # under churn a step can fail this way dozens of times: INFO once per step
            self._noted.log(self.applied_step, "holds", f"{reason}: this peer already holds the collaboration's state of "
                            f"step {self.applied_step}; its gradients are dropped, nothing to download")
            return False
        logger.info(f"out of sync ({reason}): downloading the state of step >= {target}")
        t0 = warned = time.monotonic()
        timeout = self.config.state_timeout
        refused: set[str] = set()  # donors whose state did not decode, or was a fork
        reasons: list[str] = []
        no_donor_since: float | None = None
        pause = 0.5
        while True:
            donors = [d for d in donors if d not in refused]
            try:
                step, blob, donor = self.peer.download_state(donors, target, timeout, self._max_state_bytes,
                                                             self._votes(view), _ceiling(view, target))
                state = snapshot.decode(blob)
                self._check_lineage(state, donor, view)
            except ForkError as e:  # some donors' states rewrite steps the collaboration took: never again
                refused.update(e.peers)
                view = self._refused_forks(e, view)
                logger.warning(f"{e}; trying another donor")
                reasons.append(str(e))
                error: Exception = e
            except ProtocolError as e:  # this donor's bytes are not a state: try others
                refused.add(donor)
                why = f"the state from {donor} was refused: {e}"
                logger.warning(f"{why}; trying another donor")
                reasons.append(why)
                error = e
            except StateError as e:  # every donor busy or behind: transient while others download too
                error = e
            else:
                self.load_state_dict(state)  # a state that does not fit the model raises at once
                # it serves what it now holds, not a state it offered before (a fork it stepped back from)
                self.peer.offer_state(self.applied_step, blob, [f for _, f in sorted(self._lineage.items())])
                self._offered = self._fingerprint_of_state()
                break
            now = time.monotonic()
            no_donor_since = None if donors else (no_donor_since or now)
            if no_donor_since is not None and now + pause - no_donor_since >= timeout:
                raise StateError(f"could not resync: for {timeout:.0f} s no reachable peer advertised the state of "
                                 f"step >= {target} (client-mode peers cannot send theirs): {error}"
                                 + "".join(f"; {r}" for r in reasons)) from None
            if now - warned >= timeout:
                warned = now
                logger.warning(f"still resyncing to step >= {target} after {now - t0:.0f} s: {error}")
            time.sleep(pause)
            pause = min(5.0, 2 * pause)
            # stay visible; offer our state if someone waits for it. The view leaves out the donors refused
            # as forks (``_forks``): while such a peer alone is ahead, this peer is not behind anyone
            view = self._report(busy=False)
            target, donors = self._sync_target(view)
            if target is None:
                logger.info(f"the collaboration is back at this peer's state of step {self.applied_step}: "
                            f"nothing to download")
                return False
        self.resyncs += 1
        logger.info(f"state of step {step} downloaded from {donor} ({len(blob) / 1e6:.1f} MB, "
                    f"{time.monotonic() - t0:.2f} s)")
        return True

    # ---- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a peer needs to continue from here: parameters, optimizer, scheduler, scale, step."""
        state: dict[str, Any] = {"step": self.applied_step, "optimizer": self.opt.state_dict(),
                                 "lineage": dict(self._lineage)}
        if self.model is not None:
            state["model"] = self.model.state_dict()
        else:
            state["params"] = [p.detach() for p in self.params]
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scale is not None:
            state["scaler"] = self.scale.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` (or a download); raises StateError if it does not fit."""
        try:
            self._load(state)
        except StateError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise StateError(f"the state does not fit this model/optimizer: {type(e).__name__}: {e}") from None

    def _load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            if self.model is not None:
                if "model" not in state:
                    raise StateError("the downloaded state has no model weights")
                self.model.load_state_dict(state["model"])
            else:
                params = state.get("params")
                if not isinstance(params, list) or len(params) != len(self.params) or any(
                        a.shape != b.shape for a, b in zip(params, self.params)):
                    raise StateError("the downloaded state's parameters do not match this model")
                for p, v in zip(self.params, params):
                    p.copy_(v)
        self.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scale is not None and "scaler" in state:
            self.scale.load_state_dict(state["scaler"])
        self.global_step = self.applied_step = int(state["step"])
        self._fingerprint = self._hash()
        self._lineage = lineage.extend(lineage.of_state(state), self._fingerprint)

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None



__all__ = ["CollaborativeOptimizer", "StepOutcome", "RoundRecord"]
