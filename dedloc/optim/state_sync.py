"""State sync: how a peer that is behind, or on a fork, gets the collaboration's state.

Two ways, both here:
- *Resync* (``StateSync.resync``): the gradients in hand were dropped (by the optimizer); download
  the state of the collaboration's step from a peer that serves it, verify that its lineage does
  not rewrite a step the live peers took otherwise, load it. Keeps trying while some reachable
  peer advertises the state.
- *Catch-up* (delayed updates; ``start_catchup`` / ``land``): a round in flight failed or closed
  without this peer; download the next step's state in the background while the gradients in hand
  are kept. If no peer holds it, the members agree that the step was lost, by the rules in
  optim/step_rules.py, and each skips it.

What the optimizer does with a landed state (keep the round in flight, drop the gradients) is its
own decision (optim/optimizer.py); the parameters themselves live in optim/local_state.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dedloc.config import OptimizerConfig
from dedloc.errors import DedlocError, ForkError, ProtocolError, StateError
from dedloc.logs import OncePerStep
from dedloc.optim import step_rules
from dedloc.optim.local_state import LocalState
from dedloc.optim.progress import Progress
from dedloc.optim.step_rules import FRESH_GRACE
from dedloc.optim.port import PeerPort
from dedloc.records import CollaborationView, ProgressRecord
from dedloc.state import lineage, snapshot

logger = logging.getLogger(__name__)


def ceiling(view: CollaborationView, wanted: int) -> int:
    """The newest step a download for ``wanted`` accepts: one past the step the run attests
    (``CollaborationView.global_step``; a catch-up is one step behind a round that just ended), so
    a member publishing a far step of its own serves it to nobody."""
    return max(view.global_step, wanted) + 1


@dataclass
class CatchUp:
    min_step: int
    future: cf.Future
    """Of ``Peer.download_state``'s (step, blob, donor)."""
    started: float
    heard: dict[str, float] = field(default_factory=dict)
    """Each peer's record's publish time in the view read at the start (step_rules.heard_from_others)."""
    missed_until: float | None = None
    """Until when (wall clock) the round of ``min_step - 1`` that this peer missed may still run, read
    once from its closed records (``waits_for_missed_round``); 0.0 if none runs."""


@dataclass(frozen=True)
class Downloaded:
    """A catch-up landed: the verified state of ``step`` from ``donor`` (not loaded yet)."""

    step: int
    state: dict[str, Any]
    blob: bytes
    donor: str


@dataclass(frozen=True)
class Skip:
    """Nobody holds the missed update: the step is lost for every member (``followed``: another
    member concluded so first and published it)."""

    view: CollaborationView
    followed: bool


@dataclass(frozen=True)
class Retrying:
    """Not concluded yet; ``catchup`` asks again in the background."""

    catchup: CatchUp


@dataclass(frozen=True)
class Refused:
    """The downloaded bytes were not a state, or a fork: resync from scratch."""

    view: CollaborationView
    reason: str


Landing = Downloaded | Skip | Retrying | Refused


class StateSync:
    """Downloads, verifies and offers states for one optimizer (module docs)."""

    def __init__(self, peer: PeerPort, config: OptimizerConfig, local: LocalState, progress: Progress,
                 record: Callable[[], ProgressRecord], report: Callable[[], CollaborationView], noted: OncePerStep):
        """``record()`` is the optimizer's progress record as it stands (not busy); ``report()``
        publishes it and returns the view read back."""
        self.peer, self.config, self.local, self.progress = peer, config, local, progress
        self._record, self._report, self._noted = record, report, noted
        self.max_state_bytes = config.max_state_bytes or (4 * local.nbytes() + (64 << 20))
        """A donor announcing a bigger state is refused before its bytes are read."""
        self.syncing = False
        """Inside ``resync`` (published: such a peer takes no round before it holds a state)."""
        self.offered: tuple[int, str] | None = None
        """The state last offered (``LocalState.identity``): a resync offers the one it holds unless it did."""

    # ---- offering ------------------------------------------------------------------------------------
    def offer(self, blob: bytes | None = None) -> None:
        """Make the state held downloadable (``blob``: its encoding, if at hand)."""
        if blob is None:
            blob = snapshot.encode(self.local.state_dict())
        self.peer.offer_state(self.local.applied_step, blob, self.local.history())
        self.offered = self.local.identity()

    # ---- verification --------------------------------------------------------------------------------
    def votes(self, view: CollaborationView) -> dict[str, str] | None:
        """The live peers' fingerprints, for refusing a forked donor at its state's header."""
        return lineage.fingerprints(view) if self.config.verify_sync else None

    def forked(self, view: CollaborationView) -> bool:
        """Whether the live peers outvote this peer's recent history (its own vote counts as theirs
        do: a client's only while a trainer holds the same parameters, ``CollaborationView.votes``)."""
        me = self.peer.peer_id
        own = me if view.votes(self._record()) else None
        return lineage.votes(self.local.lineage, view, exclude=me).outvoted(own=own)

    def disagreement(self, view: CollaborationView) -> str | None:
        """Why this peer's parameters are not the collaboration's (None: they are): they differ from
        the majority's at its step, or its recent history is a fork that the live peers outvote
        (see state/lineage.py)."""
        if not self.config.verify_sync:
            return None
        if self.forked(view):
            return (f"this peer's parameters since step {lineage.first_conflict(self.local.lineage, view)} are a "
                    f"fork that the other peers outvote")
        consensus = view.consensus_fingerprint(self.local.applied_step)
        if consensus is not None and consensus != self.local.fingerprint:
            return "parameters differ from the majority's"
        return None

    def check_lineage(self, state: dict[str, Any], donor: str, view: CollaborationView) -> None:
        """Refuse (ForkError) a state whose history the live peers outvote: adopting it would
        rewrite steps the collaboration already took with other parameters."""
        if not self.config.verify_sync:
            return
        own = self.local.fingerprint_of(state)
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

    def donors(self, view: CollaborationView, step: int) -> list[str]:
        """Peers that serve a state of ``step`` or later: trainers holding the consensus first, then
        other trainers, then backbones; shuffled within a tier."""
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

    def target(self, view: CollaborationView) -> tuple[int | None, list[str]]:
        """The step to download and the donors to try; (None, []) if this peer already holds the
        collaboration's state (nothing to download: e.g. a round that failed for every member)."""
        me = self.peer.peer_id
        if self.config.verify_sync and self.forked(view):  # step back to the history the others took
            theirs = set(lineage.votes(self.local.lineage, view, exclude=me).disagree)
            target = max((r.applied_step or 0) for r in view.peers if r.peer_id in theirs)
            return target, [d for d in self.donors(view, target) if d in theirs]
        target = view.global_step
        if target <= self.local.applied_step and self.disagreement(view) is None:
            return None, []
        return target, self.donors(view, target)

    # ---- resync --------------------------------------------------------------------------------------
    def read_as_newcomer(self) -> CollaborationView:
        """Publish this peer's record as resyncing (the step it holds then attests nothing) and read
        everyone's: what a peer back from an absence longer than its record's life reads before it
        decides whether the run went on without it."""
        self.syncing = True
        try:
            return self._report()
        finally:
            self.syncing = False

    def resync(self, reason: str) -> bool:
        """Load the collaboration's state (the optimizer dropped the gradients in hand and anything in
        flight). True if it loaded a downloaded state, False if this peer holds the state already.

        It keeps trying while some reachable peer advertises the state (donors that are busy, behind
        or slow are transient under churn: a warning is logged every ``state_timeout``), re-reading
        the target each time; it returns as soon as the collaboration is back at this peer's state.
        It raises StateError only when, for ``state_timeout`` on end, no reachable peer that this peer
        has not refused advertised the state (e.g. only client-mode peers hold it: they cannot send it).
        While it waits, its progress record stays published (``syncing``), so the others still see it
        and a newcomer never mistakes an older checkpoint for the collaboration's state."""
        self.syncing = True
        try:
            return self._resync(reason)
        finally:
            self.syncing = False

    def _resync(self, reason: str) -> bool:
        view = self._report()  # the dropped samples must not count toward the step any more
        target, donors = self.target(view)
        local = self.local
        if target is None:  # under churn a step can fail this way dozens of times: INFO once per step
            self._noted.log(local.applied_step, "holds", f"{reason}: this peer already holds the collaboration's state "
                            f"of step {local.applied_step}; its gradients are dropped, nothing to download")
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
                step, blob, donor = self.peer.download_state(donors, target, timeout, self.max_state_bytes,
                                                             self.votes(view), ceiling(view, target))
                state = snapshot.decode(blob)
                self.check_lineage(state, donor, view)
            except ForkError as e:  # some donors' states rewrite steps the collaboration took: never again
                refused.update(e.peers)
                view = self.progress.refused_forks(e, view)
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
                local.load(state)  # a state that does not fit the model raises at once
                # it serves what it now holds, not a state it offered before (a fork it stepped back from)
                self.offer(blob)
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
            # as forks: while such a peer alone is ahead, this peer is not behind anyone
            view = self._report()
            target, donors = self.target(view)
            if target is None:
                logger.info(f"the collaboration is back at this peer's state of step {local.applied_step}: "
                            f"nothing to download")
                return False
        logger.info(f"state of step {step} downloaded from {donor} ({len(blob) / 1e6:.1f} MB, "
                    f"{time.monotonic() - t0:.2f} s)")
        return True

    # ---- catch-up (delayed updates) ------------------------------------------------------------------
    def start_catchup(self, step: int, reason: str, accumulating: int) -> CatchUp:
        """Download the state of ``step`` (or later) in the background, in place of the update that
        this peer's parameters lack (it keeps accumulating for ``accumulating`` meanwhile)."""
        view = self.peer.collaboration()
        logger.info(f"{reason}; catching up: downloading the state of step >= {step} in the background, "
                    f"still accumulating for step {accumulating}")
        return CatchUp(step, self._download_async(view, step, self.config.state_timeout), time.monotonic(),
                       {r.peer_id: r.time for r in view.peers})

    def _download_async(self, view: CollaborationView, step: int, timeout: float) -> cf.Future:
        return self.peer.download_state_async(self.donors(view, step), step, timeout, self.max_state_bytes,
                                              self.votes(view), ceiling(view, step))

    def land(self, catchup: CatchUp, wait: bool) -> Landing:
        """What became of a catch-up: a verified state, a step lost by every member, a retry in the
        background (only when not ``wait``), or a state refused (resync).

        If no peer has the state (the round failed for every member), the members agree that the
        step is lost: each skips it, parameters unchanged, once no live peer shows the update
        applied, no training peer is still at that step (it may yet take it: e.g. the others, whose
        round had not started when this peer's failed; this wait is bounded by a round's length,
        ``2 * matchmaking_time + averaging_timeout + FRESH_GRACE``, and by ``state_timeout``), no
        group that closed the step may still finish its round (its leader's deadline, published in
        its closed record, plus ``CLOSED_GRACE``; bounded by ``state_timeout``), the round's
        stragglers have had ``2 * matchmaking_time + FRESH_GRACE`` to publish it, and the view brings
        a record from another peer published since the catch-up started (not a stale local copy;
        bounded by ``state_timeout``). ``why_skip_waits`` checks these."""
        while True:
            downloaded = False
            try:
                step, blob, donor = catchup.future.result(self.config.state_timeout + 30)
                downloaded = True
                state = snapshot.decode(blob)
                self.check_lineage(state, donor, self.peer.collaboration())
                return Downloaded(step, state, blob, donor)
            except (StateError, ProtocolError, cf.TimeoutError) as e:
                view = self.progress.refused_forks(e, self._report())
                if self.config.verify_sync and step_rules.skip_published(view, self.peer.peer_id, catchup.min_step,
                                                                         self.local.fingerprint):
                    return Skip(view, followed=True)  # another member concluded first
                if isinstance(e, ProtocolError) and downloaded:  # its bytes are not a state, or a fork: start over
                    return Refused(view, f"catching up failed: {e}")
                # (forks refused at their header are left out of the view now: no longer donors, nor "held")
                why = self.why_skip_waits(view, catchup)
                if why is None:
                    return Skip(view, followed=False)
                logger.debug(f"step {catchup.min_step - 1}: lost so far, not skipped yet: {why}")
                if wait:
                    time.sleep(0.5)  # a member whose round succeeded may not have published it yet
                catchup = CatchUp(catchup.min_step, self._download_async(view, catchup.min_step, FRESH_GRACE),
                                  catchup.started, catchup.heard)
                if not wait:
                    return Retrying(catchup)

    def why_skip_waits(self, view: CollaborationView, catchup: CatchUp) -> str | None:
        """Why the step that ``catchup`` replaces may not be skipped yet (None: it is lost for every
        peer alive): step_rules.skip_waits, then whether a round of it may still finish
        (``round_may_finish``). ``land`` states the conditions and their bounds."""
        waited = time.monotonic() - catchup.started
        windows = self.windows
        why = step_rules.skip_waits(view, self.peer.peer_id, catchup.min_step, waited, catchup.heard, windows)
        if why is None and self.round_may_finish(catchup.min_step - 1, waited):
            return "a round of it may still finish"
        return why

    @property
    def windows(self) -> step_rules.Windows:
        avg = self.peer.averaging
        return step_rules.Windows(avg.matchmaking_time, avg.averaging_timeout, self.config.state_timeout)

    def round_may_finish(self, step: int, waited: float) -> bool:
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

    def waits_for_missed_round(self, view: CollaborationView, catchup: CatchUp | None, step: int) -> bool:
        """Whether to hold back the round of ``step`` (keeping the gradients) because the others at it
        are still in the round of the step before, which this peer missed (delayed updates: it
        catches up on that step; step_rules.others_in_missed_round says why that would fork).

        Holds while a group that closed that step may still finish (its closed record's deadline,
        read once per catch-up), no peer that serves its state publishes that step's update applied,
        and no peer is ready for this step's round yet (its ready record: a member starts this round
        the moment its own ends, and publishes its progress only after its next micro-batch); at
        most a round's length from the catch-up's start. A DHT that cannot be read does not hold it
        back."""
        if catchup is None or not step_rules.others_in_missed_round(
                view, self.peer.peer_id, step, catchup.min_step, time.monotonic() - catchup.started, self.windows):
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


__all__ = ["StateSync", "CatchUp", "Downloaded", "Skip", "Retrying", "Refused", "Landing", "ceiling"]
