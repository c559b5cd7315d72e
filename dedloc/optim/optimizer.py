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
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dedloc.averaging.outcome import RoundOutcome
from dedloc.config import OptimizerConfig
from dedloc.errors import AveragingError, LoneStepDeclined, MatchmakingError, RuntimeClosedError, SettingsMismatch
from dedloc.logs import OncePerStep
from dedloc.optim import step_rules
from dedloc.optim.accumulator import GradientAccumulator
from dedloc.optim.hand_on import hand_on
from dedloc.optim.local_state import LocalState
from dedloc.optim.progress import Facts, Progress
from dedloc.optim.scaling import CollaborativeScale
from dedloc.optim.state_sync import CatchUp, Downloaded, Refused, Retrying, StateSync
from dedloc.optim.step_rules import Action, Mode
from dedloc.optim.port import PeerPort
from dedloc.records import CollaborationView, ProgressRecord, Role, short_id

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
class _Inflight:
    step: int
    vector: torch.Tensor
    future: cf.Future
    finish: Callable[[], RoundOutcome]
    local_samples: int
    started: float
    overflowed: bool = False


class CollaborativeOptimizer:
    """Wraps any ``torch.optim`` optimizer (and its scheduler) for a collaboration; see module docs.

    Built from three collaborators: the state it holds (``local``, optim/local_state.py), its
    progress reports (``progress``, optim/progress.py) and state sync (``sync``, resync and
    catch-up, optim/state_sync.py). This class takes the steps: what to do at each micro-batch
    (``step_rules.at_boundary``), the rounds, and applying their result."""

    def __init__(self, optimizer: torch.optim.Optimizer, peer: PeerPort, config: OptimizerConfig | None = None, *,
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
        self.local = LocalState(optimizer, model=model, scheduler=scheduler, scale=self.scale,
                                verify=self.config.verify_sync)
        self.params = self.local.params
        self.acc = GradientAccumulator(self.params)
        self.progress = Progress(peer, self.config.target_batch_size, self.config.run_hash)
        self._noted = OncePerStep(logger)
        """Conditions met again and again within a step (held back, already holds the state): INFO once."""
        self.sync = StateSync(peer, self.config, self.local, self.progress, lambda: self._record(busy=False),
                              lambda: self._report(busy=False), self._noted)
        self.global_step = 0
        """The global step this peer's micro-batches currently count toward."""
        self.history: list[RoundRecord] = []
        self.resyncs = 0
        """State downloads that dropped this peer's gradients (joining counts as one)."""
        self.catchups = 0
        """Missed updates replaced by a state downloaded in the background, gradients kept (delayed updates)."""
        self.skipped_steps = 0
        """Steps whose round failed for every member (delayed updates): skipped by all, parameters unchanged."""
        self._inflight: _Inflight | None = None
        self._catchup: CatchUp | None = None
        self._closed = False
        self._returned_at: tuple[float, float] | None = None
        """When ``step`` last returned (monotonic, wall clock): the training loop's time away since."""
        self._settled = False
        """Whether this peer has met the run (a state downloaded, or a round with another peer): until
        then every download is preceded by the settings check (a first view can come before the DHT
        holds the run's records)."""
        view = self._report(busy=False)
        self._check_settings(view)  # (again before its download: _resync)
        if view.global_step > self.global_step or self.sync.disagreement(view):
            self._resync(view, "joining a collaboration at step %d" % view.global_step)

    def _check_settings(self, view: CollaborationView) -> None:
        """Joining (and before every download until this peer has met the run): refuse to train with
        settings other than the run's, before downloading anything (``OptimizerConfig.run_hash``). A volunteer who forgot ``--recipe albert-mlm`` downloaded the
        whole state before "the state does not fit this model"; one who changed a run-wide value that
        keeps the shapes (``--lr``) would have trained on, outvoted and resynced at every step."""
        mine = self.config.run_hash
        found = view.settings_mismatch(self.peer.peer_id, mine) if mine else None
        if found is None:
            return
        theirs, peers = found
        self.peer.leave()  # its record (step 0) is not one of the run's
        raise SettingsMismatch(
            f"this peer's run-wide settings (hash {mine}) are not the run's (hash {theirs}, published by "
            f"{', '.join(map(short_id, peers[:5]))}{' and others' if len(peers) > 5 else ''}): it would train "
            f"another model or with other hyperparameters. Join with the run's manifest (dedloc train --join "
            f"TOKEN) or with exactly its --recipe and recipe options", peers=peers)

    # ---- what it is doing --------------------------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        """Where this peer's step stands (step_rules.Mode)."""
        if self.sync.syncing:
            return Mode.RESYNCING
        if self._catchup is not None:
            return Mode.CATCHING_UP
        if self._inflight is not None:
            return Mode.IN_FLIGHT
        return Mode.ACCUMULATING

    @property
    def applied_step(self) -> int:
        """How many global updates the parameters have received (== global_step unless one is in flight)."""
        return self.local.applied_step

    @property
    def forks_refused(self) -> int:
        """Downloaded states refused because they rewrite steps the collaboration took otherwise."""
        return self.progress.forks_refused

    @property
    def blocking_reports(self) -> int:
        """Progress reports the training loop waited for."""
        return self.progress.blocking

    @property
    def background_reports(self) -> int:
        """Progress reports sent in the background (far from the target)."""
        return self.progress.background

    @property
    def view(self) -> CollaborationView | None:
        """The collaboration's progress as this peer last read it (None before the first read)."""
        seen = self.progress.seen
        return seen.view if seen is not None else None

    @property
    def samples_per_second(self) -> float:
        """This peer's smoothed training speed (what it publishes)."""
        return self.progress.sps.value

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
        self.progress.micro_batch(batch_size)
        try:
            self.acc.add(batch_size, self.scale.current() if self.scale else 1.0)
            self.local.zero_grads()
            if self._catchup is not None and self._catchup.future.done() and not self._land_catchup(wait=False):
                return StepOutcome.RESYNCED
            if self._inflight is not None and self._inflight.future.done() and not self._finish_inflight():
                return StepOutcome.RESYNCED
            if self._back_behind_the_run():
                return StepOutcome.RESYNCED
            view = self.progress.cached_view_if_far(self._facts(), lambda: self._record(busy=True))
            self._offer_if_wanted()
            if view is None:
                view = self._report(busy=True)
            decision = self._at_boundary(view)
            if decision.action is Action.RESYNC:
                self._resync(view, decision.reason)
                return StepOutcome.RESYNCED
            if decision.action is not Action.ROUND:
                return StepOutcome.ACCUMULATED
            return self._round(view)
        finally:
            self.progress.ended()
            self._returned_at = (time.monotonic(), time.time())

    def _back_behind_the_run(self) -> bool:
        """Whether this peer comes back from an absence (its training loop frozen, suspended, or busy
        elsewhere) longer than its progress record lives to find the run past its step; then it
        drops its gradients and downloads the run's state, as a newcomer would, and True. Its record
        lapsed meanwhile, so the others went on without it; it reads the run with its own record
        marked resyncing, so that the step it holds attests nothing: otherwise two trainers back at a
        step that a third took alone meanwhile would take it again together (a fork). Both clocks
        count: a suspended machine's monotonic clock stands still."""
        if self._returned_at is None or self.sync.syncing:
            return False
        mono, wall = self._returned_at
        away = max(time.monotonic() - mono, time.time() - wall)
        if away < self.peer.progress_ttl:
            return False
        view = self.sync.read_as_newcomer()
        if view.global_step <= self.global_step:
            return False
        self._resync(view, f"this peer was away {away:.0f} s, longer than its progress record lives "
                           f"({self.peer.progress_ttl:.0f} s), and the run went on to step {view.global_step}")
        return True

    def offer_state(self) -> None:
        """Make the current state downloadable right away (e.g. before a planned stop, for a backbone)."""
        if self._inflight is not None:
            self._finish_inflight()
        self.progress.wanted = False
        self.sync.offer()

    def report(self) -> CollaborationView:
        """Publish this peer's progress now (step, samples, parameter hash) and read everyone's.

        The training loop's ``step`` does this by itself; call it when the loop has stopped but the
        peer stays, e.g. before leaving, so that the others (a backbone) see the step it holds: the
        record sent before its last round still names the step before."""
        return self._report(busy=False)

    def note_loss(self, step: int, mean_loss: float, samples: int) -> None:
        """This peer's mean training loss over its ``samples`` samples of global step ``step``,
        published with its next progress record (the monitor pools it per step)."""
        self.progress.note_loss(step, mean_loss, samples)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local.zero_grads()

    def drop_gradients(self) -> None:
        """Forget the samples accumulated for the current step: this peer contributes nothing more
        to it (it leaves, optim/hand_on.py)."""
        self.acc.reset()

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

    def state_dict(self) -> dict[str, Any]:
        """Everything a peer needs to continue from here: parameters, optimizer, scheduler, scale, step."""
        return self.local.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` (or a download); raises StateError if it does not fit.
        This peer's micro-batches then count toward the step after it."""
        self.local.load(state)
        self.global_step = self.local.applied_step

    # ---- the step boundary -------------------------------------------------------------------------------
    def _at_boundary(self, view: CollaborationView) -> step_rules.Boundary:
        """step_rules.at_boundary on what this peer knows now; INFO once per step when it holds back."""
        step = self.global_step
        settled = self._inflight is None and self._catchup is None
        decision = step_rules.at_boundary(
            view, self.peer.peer_id, step, self.config.target_batch_size,
            disagreement=self.sync.disagreement(view) if settled else None,
            client=self.peer.role == Role.CLIENT, catching_up=self._catchup is not None,
            missed_round_runs=lambda: self.sync.waits_for_missed_round(view, self._catchup, step))
        if decision.rule == "held back alone":
            self._noted.log(step, "held back", decision.reason)
        elif decision.action is not Action.ACCUMULATE:
            self._noted.forget(step, "held back")
        return decision

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
                      bounds=self.progress.claims.weights(step, view))
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
        except LoneStepDeclined as e:  # the step stays open for a group with the others: keep the gradients
            logger.debug(f"{e}; keeping the gradients")
            return StepOutcome.ACCUMULATED
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
                self._catchup = self.sync.start_catchup(inflight.step + 1, f"step {inflight.step} failed: {e}",
                                                        self.global_step)
                self.catchups += 1
                return True
            logger.warning(f"step {inflight.step} failed while leaving: {e}")
            return False
        self._apply(inflight.step, inflight.vector, stats, inflight.local_samples, inflight.started, inflight.overflowed)
        return True

    def _land_catchup(self, wait: bool = True) -> bool:
        """Load the catch-up download (StateSync.land); False if the gradients in hand were dropped.
        With ``wait`` False (the download failed but may yet succeed), a retry goes on in the background."""
        catchup, self._catchup = self._catchup, None
        landing = self.sync.land(catchup, wait)
        if isinstance(landing, Retrying):
            self._catchup = landing.catchup
            return True
        if isinstance(landing, Refused):
            self._resync(landing.view, landing.reason)
            return False
        if not isinstance(landing, Downloaded):
            self._skip_lost_step(catchup.min_step - 1, landing.view, landing.followed)
            return True
        step, inflight, global_step = landing.step, self._inflight, self.global_step
        self.load_state_dict(landing.state)  # sets both steps to the state's
        kept = True
        if inflight is not None and step == inflight.step:  # the round under way applies on top of it
            self.global_step = global_step
        elif step == global_step:  # it opens the step being accumulated (and holds any round before it)
            self._drop_inflight()
        else:  # the collaboration moved on without this peer: its work in hand is for an older state
            self._drop_inflight()
            self.acc.reset()
            self.local.zero_grads()
            self.resyncs += 1
            kept = False
        logger.info(f"caught up: state of step {step} downloaded from {landing.donor} ({len(landing.blob) / 1e6:.1f} "
                    f"MB, {time.monotonic() - catchup.started:.2f} s)" +
                    ("" if kept else f"; the collaboration had moved on, so the gradients for step "
                                     f"{global_step} were dropped"))
        return kept

    def _skip_lost_step(self, step: int, view: CollaborationView, followed: bool = False) -> None:
        """Every member lost the round of ``step``: count it as taken without an update, as they all do
        (``followed``: another peer concluded so first). The log names what ``view`` showed."""
        self.local.advance(step)
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
        self.local.zero_grads()
        if not self.config.delay_updates:
            self.global_step = step + 1
            self.acc.reset()
        self.local.advance(step)
        if self.progress.wanted and self._catchup is None:
            # a peer waits for a newer state: offer it between applying this update and starting the
            # next round (when rounds outlast compute, no report falls in that gap)
            self.offer_state()
        contributors = stats.contributors if stats.contributors is not None else tuple(
            p for p, w in zip(stats.peers, stats.weights) if w > 0 and p not in stats.excluded)
        record = RoundRecord(step, local_samples, stats.total_weight, stats.group_size, time.monotonic() - started,
                             overflow, contributors, stats.peers)
        self.history.append(record)
        self._settled = self._settled or record.group_size > 1
        logger.info(f"step {step} averaged with {record.group_size} peers, batch {record.batch:.0f} samples, "
                    f"in {record.averaging_s:.2f} s" + (" (no member's gradient was finite: step skipped by all)"
                                                        if overflow else ""))
        return StepOutcome.SKIPPED if overflow else StepOutcome.STEPPED

    def _drop_inflight(self) -> None:
        """Forget the round in flight, once it has ended: until then the runtime still writes its result
        into the shared buffer that the next round's input goes to."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            avg = self.peer.averaging
            cf.wait([inflight.future], timeout=self.config.max_gather_wait + 2 * avg.matchmaking_time
                    + avg.averaging_timeout + 30)

    # ---- progress and sync -------------------------------------------------------------------------------
    def _facts(self) -> Facts:
        return Facts(self.global_step, self.acc.samples, self.local.fingerprint, self.resyncs, self.catchups,
                     self.sync.syncing)

    def _record(self, busy: bool) -> ProgressRecord:
        return self.progress.record(self._facts(), busy)

    def _report(self, busy: bool) -> CollaborationView:
        """Publish this peer's progress and read everyone's, waiting for the DHT."""
        view = self.progress.report(self._record(busy))
        self._offer_if_wanted()
        return view

    def _offer_if_wanted(self) -> None:
        """A peer asked for a newer state than ours: offer it once this peer holds a complete one."""
        if self.progress.wanted and self._inflight is None and self._catchup is None:
            self.offer_state()

    def _resync(self, view: CollaborationView, reason: str) -> None:
        """Drop the gradients in hand and anything in flight, and load the collaboration's state
        (StateSync.resync; downloaded unless this peer already holds it).

        It first offers the state it holds (when complete: no update in flight), so that peers
        stepping back to its history can download it meanwhile: after a partition healed, both
        sides resynced toward each other and neither served the state it held (a deadlock)."""
        if self._inflight is None and self._catchup is None and self.sync.offered != self.local.identity():
            self.offer_state()
        if not self._settled:
            self._check_settings(view)
        self._drop_inflight()
        self._catchup = None
        self.acc.reset()
        self.local.zero_grads()
        if self.sync.resync(reason):
            self._settled = True
            self.global_step = self.local.applied_step
            self.resyncs += 1
            self._report(busy=False)


__all__ = ["CollaborativeOptimizer", "StepOutcome", "RoundRecord"]
