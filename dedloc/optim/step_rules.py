"""When a step is held back, skipped or handed to a resync: the optimizer's step rules, as pure
functions of what a peer knows (the collaboration's progress records, its own steps, its clocks).

The optimizer and state sync (optim/optimizer.py, optim/state_sync.py) gather these facts, read
the DHT where a rule says they must (``round_may_finish``, the missed round's deadline), and act;
the rules themselves make no call, so each is tested on made-up records in milliseconds (tests/test_units.py). docs/optimizer.md
has the reasoning; the incidents that taught each rule are named by its regression tests.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable

from dedloc.records import CollaborationView, Role

FRESH_GRACE = 10.0
"""Seconds a catch-up keeps asking before it concludes that no member holds the missed update."""


@dataclass(frozen=True)
class Windows:
    """How long the step rules wait, from the peer's settings."""

    matchmaking_time: float
    averaging_timeout: float
    state_timeout: float

    @property
    def round(self) -> float:
        """A round's length from a ready peer's point of view: its matchmaking, a retry's fresh
        window, the round itself and the grace for publishing its result (bounded by ``state_timeout``)."""
        return min(self.state_timeout, 2 * self.matchmaking_time + self.averaging_timeout + FRESH_GRACE)


def checkpointed_past(view: CollaborationView, step: int) -> str:
    """Why ``step`` (the one this peer accumulates for) is taken already, if a backbone holds a
    state past it ("" if none does). A backbone checkpoints only states a trainer applied on the
    history the live peers hold, so its step is one the run took, even when the trainers that took
    it have left or are out of reach: a peer one step behind must not take it again alone."""
    ahead = view.newest_backbone_step
    return "" if ahead is None or ahead <= step else f"a backbone holds step {ahead}, so the run took step {step} already"


def held_back_alone(view: CollaborationView, me: str, step: int, client: bool, catching_up: bool) -> str | None:
    """Why this peer holds back its round of ``step`` (keeping its gradients) because it would take
    the step ahead of every other reachable peer without being able to hand the result on (None:
    it does not). A client-mode peer accepts no streams, so no one could download the steps it took
    alone; a peer still catching up on the previous step holds no state to serve, and a round alone
    would only put it further ahead while the others chase it (each waiting for the other: a stall).
    It holds until another reachable peer reaches its step, while another trainer is alive."""
    others = max((r.step for r in view.peers if r.role.serves and r.peer_id != me), default=None)
    if not (client or catching_up) or others is None or others >= step or \
            not any(r.role == Role.TRAINER for r in view.peers if r.peer_id != me):
        return None
    why = "a client-mode peer" if client else "a peer still catching up"
    return (f"step {step}: no other reachable trainer has reached it yet (they are at step {others}); {why} does "
            f"not lead, so it keeps accumulating")


def others_in_missed_round(view: CollaborationView, me: str, step: int, catchup_step: int | None,
                           waited: float, windows: Windows) -> bool:
    """The first half of holding back a round of ``step`` while the others at it are still in the
    round of ``step - 1`` that this peer missed (delayed updates: it catches up on that step).
    They publish ``step`` while that round runs, but none can join a round of it before its own
    ends: a round started now would close without them, and the step would be both taken (by this
    peer alone) and skipped (by them). True while this peer catches up on exactly that step
    (``catchup_step``), no peer that serves its state shows that step's update applied, a training
    peer at the step holds the parameters before it, and the catch-up has waited less than a
    round's length. The optimizer then also checks, by reading the DHT, that a group that closed
    ``step - 1`` may still finish and that nobody is ready for ``step`` yet."""
    if catchup_step != step or waited >= windows.round:
        return False
    if any((r.applied_step or 0) >= step for r in view.peers if r.role.serves and r.peer_id != me):
        return False
    return any(r.applied_step == step - 1 for r in view.trainers_at(step) if r.peer_id != me)


def heard_from_others(view: CollaborationView, me: str, heard: dict[str, float]) -> bool:
    """Whether ``view`` brings news from another peer since ``heard`` (each peer's record's publish
    time when the catch-up started): a record published later, or a peer not seen then. Without
    news, the view may be this peer's stale local copy rather than the collaboration's (a peer
    resumed from a freeze that reads nobody else would conclude that nobody holds a step the others
    all took, and skip it: a fork). Clock-skew free: only one peer's own publish times are compared."""
    return any(r.time > heard.get(r.peer_id, -math.inf) for r in view.peers if r.peer_id != me)


def skip_published(view: CollaborationView, me: str, step: int, fingerprint: str) -> bool:
    """Whether a peer published ``step`` with exactly this peer's parameters (``fingerprint``, of
    the step before): it skipped the lost step, and this peer follows it."""
    skipped = f"{step}:{fingerprint.partition(':')[2]}"
    return any(r.fingerprint == skipped for r in view.peers if r.peer_id != me)


def skip_waits(view: CollaborationView, me: str, next_step: int, waited: float, heard: dict[str, float],
               windows: Windows) -> str | None:
    """Why the step before ``next_step`` (whose update a catch-up could not download) may not be
    skipped yet, by the progress records alone (None: skipped, once no round of it may still finish,
    ``round_may_finish``). ``waited``: seconds since the catch-up started; ``heard``: each peer's
    record's publish time then. In order:

    - a peer that serves its state shows the update applied: asking again can succeed;
    - another training peer is still accumulating for the lost step (for a round's length: one that
      has not taken it by then is frozen, or waits on this peer, and waiting longer would stall both);
    - for ``2 matchmaking_time + FRESH_GRACE``, a member whose round succeeded may not have published it;
    - until ``state_timeout``, no record from another peer since the catch-up started (a stale view)."""
    lost = next_step - 1
    if any((r.applied_step or 0) >= next_step for r in view.peers if r.role.serves):
        return "a peer holds its update: asking again can succeed"
    if waited < windows.round and any(r.peer_id != me for r in view.trainers_at(lost)):
        return "another training peer is still accumulating for it"
    if waited < 2 * windows.matchmaking_time + FRESH_GRACE:
        return "a member whose round succeeded may not have published it yet"
    if waited < windows.state_timeout and not heard_from_others(view, me, heard):
        return "no record from another peer since the catch-up started"
    return None


def round_may_finish(until: float | None, now: float) -> bool:
    """Whether a group that closed a step may still finish its round: ``until`` is the latest
    deadline in the step's closed records plus a grace for clock skew (None: no group closed it),
    set by each group's leader as the smallest timeout its members asked for (which can exceed this
    peer's own round length: skipping at this peer's own length could skip a step that group then
    takes). ``now``: the wall clock."""
    return until is not None and now < until


class Mode(str, enum.Enum):
    """Where a peer's step stands between two micro-batches (``CollaborativeOptimizer.mode``)."""

    ACCUMULATING = "accumulating"
    """Adding micro-batches to the step it counts toward; its parameters are at that step."""
    IN_FLIGHT = "in flight"
    """Delayed updates: the round of the step before runs in the background while it accumulates."""
    CATCHING_UP = "catching up"
    """Delayed updates: that round failed or closed without it; the next step's state downloads in
    the background, the gradients in hand are kept (optim/state_sync.py)."""
    RESYNCING = "resyncing"
    """Its gradients were dropped; it downloads the collaboration's state before it goes on."""


class Action(str, enum.Enum):
    """What a peer does at the step boundary (``at_boundary``)."""

    RESYNC = "resync"  # drop the gradients in hand, download the collaboration's state
    ACCUMULATE = "accumulate"  # the global batch is not full: compute the next micro-batch
    HOLD = "hold"  # the batch is full, but this peer may not take the step now: keep accumulating
    ROUND = "round"  # take the step: join (or lead) its round


@dataclass(frozen=True)
class Boundary:
    action: Action
    rule: str
    """The rule that decided: "ahead", "checkpointed", "disagrees", "below target", "held back alone",
    "missed round", "due"."""
    reason: str = ""


def at_boundary(view: CollaborationView, me: str, step: int, target: int, *, disagreement: str | None,
                client: bool, catching_up: bool, missed_round_runs: Callable[[], bool]) -> Boundary:
    """What a peer that just added a micro-batch for ``step`` does, in this order:

    1. *ahead*: the collaboration is two or more steps past it: resync;
    2. *checkpointed*: a backbone holds a state past ``step`` (``checkpointed_past``): resync;
    3. *disagrees*: its parameters are not the collaboration's (``disagreement``, from the lineage
       votes, or None): resync;
    4. *below target*: the collaboration's samples for ``step`` are below ``target`` and nobody
       took it: accumulate;
    5. *held back alone*: it would take the step ahead of every reachable trainer without being
       able to hand it on (``held_back_alone``): hold;
    6. *missed round*: the others at the step are still in the round before, which it missed
       (``others_in_missed_round``, then ``missed_round_runs()``, which may read the DHT and is
       called only here): hold;
    7. *due*: take the step.
    """
    if view.global_step > step + 1:
        return Boundary(Action.RESYNC, "ahead", f"the collaboration is at step {view.global_step}")
    if checkpointed := checkpointed_past(view, step):
        return Boundary(Action.RESYNC, "checkpointed", checkpointed)
    if disagreement:
        return Boundary(Action.RESYNC, "disagrees", disagreement)
    if view.samples_at(step) < target and view.global_step <= step:
        return Boundary(Action.ACCUMULATE, "below target")
    if why := held_back_alone(view, me, step, client, catching_up):
        return Boundary(Action.HOLD, "held back alone", why)
    if missed_round_runs():
        return Boundary(Action.HOLD, "missed round", f"step {step}: the others at it are still in the round of "
                                                     f"step {step - 1} that this peer missed")
    return Boundary(Action.ROUND, "due")


__all__ = ["Mode", "Action", "Boundary", "at_boundary", "Windows", "FRESH_GRACE", "checkpointed_past", "held_back_alone", "others_in_missed_round",
           "heard_from_others", "skip_published", "skip_waits", "round_may_finish"]
