"""Matchmaking: peers ready for step ``s`` agree on one member list within a deadline.

Protocol (docs/averaging.md has the reasoning and the soak findings; the rule numbers are its):
1. A ready peer stores ``{run}.ready.{s}[peer_id] = {w, s, c, f, p}`` in the DHT (weight, share,
   client, fetches the result, private: behind NAT).
2. It waits until the expected number of peers are ready, or ``matchmaking_time`` passes.
3. The leader is the smallest peer id among the ready, reachable (neither client nor NAT'd) peers. Others send
   it a ``join`` request over a stream; the leader answers all of them with the same Group when
   it closes the round, and publishes ``{run}.closed.{s}[leader]`` with the member list. The
   shares in that Group come from the leader's planner, so every member follows one plan. A join
   says how long the joiner still waits for the answer (``by``) and the round timeout it wants
   (``t``): the leader closes in time to answer its earliest joiner, and the round's deadline is
   the smallest timeout asked for (peers may run with different settings).
4. A leader that later sees a smaller reachable peer steps down and redirects its joiners. A
   follower that passes its leader over (unreachable, or its round failed or holds no state)
   regroups with the others in one fresh window of ``2 * matchmaking_time``: the next smallest
   reachable peer leads. A peer that asks a closed leader, or finds a closed group without itself, gets
   :class:`MissedRoundError` and joins the next step. A group in which no member can hand its
   state on (only clients and aggregator-only peers) closes the step for its members alone: its
   leader publishes no ``closed`` record and answers late joiners ``{"missed", "held": false}`` (join_answer.py),
   and they pass it over as if unreachable and form another group. Such a group does not close at
   all while the progress records show a trainer that can hand the state on at the step: its joiners
   are answered the same, and its leader raises :class:`LeftToTrainersError` (the step is theirs).
5. A peer whose round for ``s`` failed, or whose matchmaking for it ended without a group (as a
   follower), reopens the step: until it starts matchmaking for ``s`` again, it answers joiners
   ``{"missed", "held": false, "failed": true}`` (they pass it over, as above), and a failed leader
   overwrites its ``closed`` record. A peer asked to lead a step it cannot (not near its own: a
   process restarted under the id of a ready record still live) refuses with ``pass``, and is
   passed over too.
6. A peer suspended while it matched (past its ready record's life; a leader also ``2 *
   matchmaking_time`` past its close, when its joiners have given up) takes no group, and a leader
   so suspended closes nothing: no closed record, and joiners still waiting form another group.
7. Joins are answered only for steps near the one this peer last matched for.
8. A leader that some ready peers never joined reads the ``closed`` records once more before it
   closes, and misses the step if another group took it (instead of taking it alone: a fork).
9. A lead of one that ready peers never joined does not take the step when it cannot read them,
   and after closing reads them again and withdraws if another group outranks it (larger, or a
   smaller leader id). A lead of one that saw no ready peer does the same when the progress
   records show another training peer at the step, misses a step they show taken (rule 10), and
   does not take the step when it cannot read them.
10. A peer misses a step that most training peers already took, by their progress records'
   fingerprints (``CollaborationView.took``), even with no closed record left.
11. A closed record carries its round's deadline. Once that is past (by ``CLOSED_GRACE``) and no
   member that can hand it on (not a client) publishes the step's update applied, the round failed:
   the record closes nothing, even if its leader, frozen or dead, never withdrew it.
12. A peer runs each round at most once. A retry that its leader answers with the group whose round
   already failed here raises MatchmakingError: running it again would bring another weight into it.
   The step stays that group's until its round ends (rule 11) or fails at its leader (rule 5).
13. A join carries its sender's signature over (run, step, leader, its incarnation, whether it
   contributes samples), and the leader's ``closed`` record lists them. A group closes the step for
   the peers it left out only if two or more contributing members provably joined it; a group of
   one contributor (with or without aggregator-only peers) closes it only for a peer that, after
   its gather, sees no other contributing peer ready for the step (it forms a larger group with
   them instead). A ``missed`` answer carries the group's record; a follower that finds no group
   that closed the step for it (in the answer, or in the records) passes the leader over (rule 4),
   and one that finds its own proof of this process in it knows the leader lies.
14. A lead of one contributor (the leader, or one trainer that joined an aggregator-only leader,
   whose record says it brought no samples) that ready peers never joined, or beside trainers at
   the step by their progress records, does not take the step the first time (they would not
   follow it: rule 13): it raises :class:`LoneStepDeclined` (the optimizer keeps its gradients)
   and tries again with them. Later it closes as before (a peer that can never join holds it back
   only once), unless a trainer at the step at the first decline has published nothing since
   (frozen or dead): it waits for it to come back or for its record to lapse.

Guarantees: a peer is in at most one group per step (it sends at most one join whose outcome
is unknown, and a leader's group is final once sent); every call returns or raises within
about ``2 * matchmaking_time`` plus RPC deadlines, and ``2 * matchmaking_time`` more when its
leader is passed over (rule 4: the peers that gave up on it regroup in one fresh window).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, NoReturn

from hivemind.p2p import PeerID

from dedloc.averaging.bounds import FOLLOWER_TOLERANCE, WeightBounds
from dedloc.averaging import match_rules
from dedloc.averaging.group import MAX_TIMEOUT, Group, Member, split_into_subgroups
from dedloc.averaging.join_answer import Answer, JoinAnswer
from dedloc.averaging.wire import VERSION
from dedloc.config import AveragingConfig
from dedloc.errors import LeftToTrainersError, LoneStepDeclined, MatchmakingError, MissedRoundError, ProtocolError
from dedloc.logs import OncePerStep, PerPeerWarnings
from dedloc.net import messages
from dedloc.net.node import Node
from dedloc.net.tcp import KEY_BYTES
from dedloc.records import ClosedRecord, CollaborationView, JoinProof, ReadyRecord, Role, join_statement
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
KEEP_STEPS = 64
"""Steps below the one this peer last matched for whose matchmaking state it keeps."""
JOIN_AHEAD = 2
"""A join request may name at most this many steps beyond the step this peer last matched for (a
leader publishes its ready record, and so reaches the step, before anyone can ask it). Requests
outside the window are refused, so no stream of requests can crowd the current step's state out."""
CLOSED_GRACE = 5.0
"""Seconds past a closed round's deadline before rule 11 judges it (clock skew, members that have
applied its update but not yet published it)."""
ANSWER_MARGIN = 0.5
"""A leader closes ``ANSWER_MARGIN * matchmaking_time`` before its earliest joiner gives up: its work
after closing (rule 8's look, planning) is bounded by half its matchmaking_time."""
TOOK = "the collaboration already took it (most training peers hold the parameters after it)"
"""Why a peer misses a step by rule 10."""
REASK_S = 0.25
"""How soon a follower asks again a peer that redirected it to a leader it passed over (rule 4)."""
MAX_STEP_DOWNS = 3
"""Times a leader steps down for the same smaller peer in one step (a transient redirect resolves
in one or two; a peer that follows a leader this one cannot reach never does)."""


@dataclass
class _Lead:
    members: dict[str, Member]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    group: Group | None = None
    redirect: str | None = None
    incarnations: dict[str, str] = field(default_factory=dict)
    """Per member, the incarnation that joined: a peer restarted under the same identity is another
    process, and never gets its predecessor's group (it would send another weight)."""
    held: bool = True
    """Whether a member of the closed group can hand its state on (see ``_holds_state``)."""
    timeouts: dict[str, float] = field(default_factory=dict)
    """Per joiner, the round timeout it asked for (``t``): the round gets the smallest (rule 3)."""
    proofs: dict[str, JoinProof] = field(default_factory=dict)
    """Per joiner, its signed proof of joining (the ``closed`` record lists them: rule 13)."""
    record: ClosedRecord | None = None
    """The ``closed`` record of this lead's group (sent with a ``missed`` answer: the asker checks it)."""


@dataclass
class _StepMatch:
    """This peer's matchmaking for one step: what it decided, led and followed, and what it learnt
    about the others there (``Matchmaker._step``; the newest ``KEEP_STEPS`` steps are kept)."""

    decided: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once this peer decided what it does in the step (lead, follow, miss): joiners wait on it."""
    lead: _Lead | None = None
    """Its lead of the step, while it leads or led it."""
    follow: str | None = None
    """The leader it follows."""
    stepped_down: dict[str, int] = field(default_factory=dict)
    """How often it stepped down for each peer (at most MAX_STEP_DOWNS: ``_run_lead``)."""
    unreachable: set[str] = field(default_factory=set)
    """Leaders it could not reach or passed over: never stepped down for or followed again (stepping
    down and failing to reach them would loop until the deadline)."""
    stale_at: float = math.inf
    """When its matchmaking is stale (event loop time: its ready record expired, it was suspended)."""
    failed: bool = False
    """Its round failed here and it has not started matchmaking for the step again (rule 5)."""
    declined: dict[str, float] | None = None
    """Once it declined the step as its group's only contributor (rule 14): the training peers at
    the step then, with their records' publish times."""
    dead: set[bytes] = field(default_factory=set)
    """Rounds that failed here: never run again (rule 12)."""
    waiting: dict[str, float] = field(default_factory=dict)
    """Joiners waiting for its answer, each with the time (event loop) by which it must close to
    answer in time (rule 3)."""
    bounds: WeightBounds | None = None
    """The weights its training loop finds plausible for each member (when given)."""


@dataclass(frozen=True)
class _LeadNext:
    """What a follower does next when every leader before it was passed over (rule 4): lead."""

    expected: int | None
    close_deadline: float


@dataclass(frozen=True)
class _FollowNext:
    """What a leader does next when it sees a smaller reachable peer ready (rule 4): step down and
    follow it."""

    candidates: list[str]
    deadline: float
    gather: float
    ready: dict[str, Member]


class _CannotLead(ProtocolError):
    """A join this peer refuses because it cannot lead the step (not the joiner's fault): answered
    with ``pass`` (the joiner passes it over, rule 4)."""


def _holds_state(members: tuple[Member, ...]) -> bool:
    """A group's result can be handed on only if a member both contributed (weight > 0: it holds the
    model) and accepts streams (not a client). A group of clients and aggregator-only peers took the
    step for themselves alone: peers that missed it could never download it, so it does not close
    the step for them (they form another group; the lineage vote then settles which one stands)."""
    return any(m.weight > 0 and not m.client for m in members)


SharePolicy = Callable[[tuple[Member, ...], int], Awaitable[tuple[float, ...]]]
"""(members, numel) -> the shares of one (sub)group, decided by the leader's planner."""


def _missed_error(step: int, why: str) -> MissedRoundError:
    return MissedRoundError(f"step {step}: {why}; join the next step")


def _seconds(value: Any, low: float, high: float) -> float | None:
    """A duration a peer sent, clamped into ``[low, high]``; None if absent or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return min(max(float(value), low), high)


def _parse_entry(peer_id: str, value: Any) -> Member | None:
    """The member a ready record or a join request describes (None if malformed: records.ReadyRecord)."""
    rec = ReadyRecord.from_wire(peer_id, value)
    return None if rec is None else rec.member


class Matchmaker:
    """Forms the group of each step for one peer. Lives in the runtime process."""

    def __init__(self, node: Node, config: AveragingConfig, share: float, policy: SharePolicy | None = None,
                 progress: Callable[[], Awaitable[CollaborationView]] | None = None):
        """``progress()``: the live progress records, for rules 10 and 11 (None: neither applies)."""
        self.node, self.config, self.share, self.policy = node, config, share, policy
        self.progress = progress
        self.fetch = not config.aggregator_only
        self.me = node.peer_id.to_base58()
        self.incarnation = os.urandom(8).hex()
        """Tells this process from an earlier one under the same peer id (a restart)."""
        self.client = node.config.client_mode
        self.private = not node.reachable and not self.client
        """Found behind NAT: never leads; aggregates only where a planner saw it reach every member directly."""
        self.data = ""
        """This peer's direct data endpoint, announced in its ready record and joins (set by the averager)."""
        self.proto = f"dedloc.{node.config.run_id}.join"
        self._steps: dict[int, _StepMatch] = {}
        """This peer's matchmaking, one object per step (``_step``)."""
        self._noted = OncePerStep(logger)
        """Per step, the matchmaking events already logged at INFO (repeats go to DEBUG)."""
        self._stores = Tasks("matchmaking")
        """The ``closed`` records this peer is storing while its rounds run (``close`` cancels them)."""
        self._refusals = PerPeerWarnings(logger)
        self._newest = -1
        """The step this peer last started matchmaking for (the window of joins it accepts follows it,
        also back, after the collaboration resumed from an older checkpoint)."""

    async def start(self) -> None:
        if self.node.reachable:  # only a reachable peer ever leads
            await self.node.streams.serve_requests(self.proto, self._on_join)

    def _step(self, step: int) -> _StepMatch:
        """This peer's matchmaking for ``step`` (made on first use, when steps more than ``KEEP_STEPS``
        behind the newest are forgotten)."""
        st = self._steps.get(step)
        if st is None:
            st = self._steps[step] = _StepMatch()
            for old in [s for s in self._steps if s < min(step, self._newest - KEEP_STEPS)]:
                del self._steps[old]
        return st

    def _decision(self, step: int) -> asyncio.Event:
        return self._step(step).decided

    def _reopen(self, step: int) -> None:
        """Forget this peer's earlier matchmaking for ``step`` (a retry after its round failed or it
        missed the step): joiners wait for the new decision instead of getting the old answer."""
        st = self._step(step)
        st.failed, st.lead = False, None
        self._undecide(step)

    def _undecide(self, step: int) -> None:
        """This peer no longer follows anyone for ``step`` and has not decided what it does next:
        a joiner waits for that decision instead of being sent to the leader it followed."""
        st = self._steps.get(step)
        if st is not None:
            st.follow = None
            if st.decided.is_set():
                st.decided = asyncio.Event()

    async def round_failed(self, step: int, group: Group) -> None:
        """The round of ``group`` failed at this peer: reopen ``step`` for the others (protocol rule 5)."""
        st = self._step(step)
        st.failed = True
        st.dead.add(group.round_id)
        led = st.lead
        if led is None or led.group is None or led.group.round_id != group.round_id:
            return
        logger.info(f"step {step}: the round this peer led failed; the step is open again for the others")
        if led.held:  # its closed record must no longer close the step (bounded: the caller waits for this)
            await self._withdraw_closed(step)

    async def _store_closed(self, step: int, record: ClosedRecord, bound: float | None = None) -> None:
        """Store this peer's ``closed`` record for ``step`` (or its withdrawal), within ``bound`` seconds
        if given. A failure is logged at DEBUG: late peers then learn of a group from its members'
        progress (rule 10), and a record not withdrawn lives out its TTL (rule 11 judges it)."""
        try:
            await asyncio.wait_for(self.node.store(self.node.key("closed", step), self.me, record.to_wire(),
                                                   ttl=self._closed_ttl()), bound)
        except Exception as e:
            logger.debug(f"step {step}: could not store the closed record {record.to_wire()!r}: {e!r}")

    async def close(self) -> None:
        """Cancel the closed-record stores still under way (at shutdown)."""
        await self._stores.close()

    async def _withdraw_closed(self, step: int) -> None:
        """Overwrite this peer's ``closed`` record for ``step`` so that it closes nothing (bounded by
        ``matchmaking_time``; a failure is logged at DEBUG: the record then lives out its TTL)."""
        await self._store_closed(step, ClosedRecord(self.me, None), self.config.matchmaking_time)

    def _closed_ttl(self) -> float:
        """How long a ``closed`` record lives (a withdrawal stored later outlives the record it replaces)."""
        return 3 * self.config.matchmaking_time + self.config.averaging_timeout

    def _answer_by(self, step: int) -> float:
        """When this peer must close ``step``'s lead to answer every joiner waiting in time (rule 3)."""
        st = self._steps.get(step)
        return min(st.waiting.values(), default=math.inf) if st is not None else math.inf

    def _note(self, step: int, event: str, message: str) -> None:
        """Log ``message`` at INFO the first time ``event`` happens in ``step`` (at DEBUG after)."""
        self._noted.log(step, event, f"step {step}: {message}")

    # ---- DHT views -----------------------------------------------------------------------------
    async def _ready(self, step: int, me: Member) -> dict[str, Member]:
        entries = await self.node.get(self.node.key("ready", step))
        ready = {p: m for p, (v, _) in entries.items() if (m := _parse_entry(p, v)) is not None}
        ready[self.me] = me
        return ready

    async def pending_numel(self, step: int) -> int:
        """The vector size that contributing peers are ready to average for ``step`` (0: none ready).

        Lets an aggregator-only peer, which holds no model, join the rounds it can serve."""
        sizes = []
        for peer, (value, _) in (await self.node.get(self.node.key("ready", step))).items():
            rec = ReadyRecord.from_wire(peer, value)
            if rec is not None and rec.member.weight > 0 and rec.numel > 0:
                sizes.append(rec.numel)
        return max(set(sizes), key=sizes.count) if sizes else 0

    async def _view(self, bound: float | None = None) -> CollaborationView | None:
        """The live progress records (None: no ``progress``, or they cannot be read within ``bound``,
        by default ``matchmaking_time``)."""
        if self.progress is None:
            return None
        try:
            return await asyncio.wait_for(self.progress(), bound or self.config.matchmaking_time)
        except Exception as e:
            logger.debug(f"could not read the progress records: {e!r}")
            return None

    async def _standing(self, step: int, with_view: bool = False) -> tuple[dict[str, ClosedRecord], CollaborationView | None]:
        """The groups that close ``step`` (leader -> its record; rule 11 drops those whose round is over
        with no member holding the step's update), and the progress records if they were read: with
        ``with_view``, or when a record's round is over (rule 11 needs them; most reads skip them)."""
        view = None
        if with_view:
            records, view = await asyncio.gather(self._closed(step), self._view())
        else:
            records = await self._closed(step)
        over = time.time() - CLOSED_GRACE
        if not with_view and any(r.until is not None and r.until < over for r in records):
            view = await self._view()
        # (a client's update counts for nothing: no one can download it, and a client waiting for a trainer
        # to reach its step would hold the step closed for everyone else for as long as it runs)
        holders = set() if view is None else {r.peer_id for r in view.peers
                                              if (r.applied_step or 0) > step and r.role.serves}
        out = {}
        for r in records:
            if r.until is not None and r.until < over and view is not None and not holders & set(r.members):
                logger.debug(f"step {step}: the round {r.leader} closed is over and no member holds its update: "
                             f"it closes nothing")
                continue
            out[r.leader] = r
        return out, view

    async def _closed(self, step: int) -> list[ClosedRecord]:
        """The closed records of ``step`` that close a group (withdrawn and malformed ones left out)."""
        entries = await self.node.get(self.node.key("closed", step))
        return [r for leader, (value, _) in entries.items()
                if (r := ClosedRecord.from_wire(leader, value)) is not None and r.members is not None]

    async def round_deadline(self, step: int) -> float | None:
        """The latest deadline (wall clock, each its leader's) of the groups that closed ``step``,
        plus ``CLOSED_GRACE``: until then a round of ``step`` may still finish and its members take
        the step. None if no group closed it (or none said its deadline)."""
        return max((r.until + CLOSED_GRACE for r in await self._closed(step) if r.until is not None), default=None)

    async def closed_round(self, step: int) -> dict[str, list[str]]:
        """Leader -> members of every group that closes ``step`` (``_standing``)."""
        return {leader: list(r.members) for leader, r in (await self._standing(step))[0].items()}

    @property
    def _asker(self) -> match_rules.Asker:
        return match_rules.Asker(self.node.config.run_id, self.me, self.incarnation, self.client)

    def _closes_for_me(self, step: int, record: ClosedRecord, ready: dict[str, Member] | None) -> str | None:
        """Why ``record`` closes ``step`` for this peer (match_rules.closes_for; None: it does not). A
        group of one that it takes the step beside instead is named once a minute, at INFO."""
        why, partners = match_rules.closes_for(self._asker, step, record, ready)
        if partners:
            self._refusals.warn(record.leader, f"step {step}: {record.leader} closed the step in a group of one contributor "
                                f"(no other contributing member's signed join in its record); {len(partners)} other peer(s) at the step: "
                                f"taking it with them, not missing it", logging.INFO)
        return why

    async def _why_missed(self, step: int, took: bool = False, ready: dict[str, Member] | None = None) -> str | None:
        """Why this peer cannot take ``step`` any more (rules 4 and 13; rule 10 too with ``took``), None
        if it can. ``ready``: the ready peers it gathered (None: not yet)."""
        closed, view = await self._standing(step, with_view=took)
        for leader, record in sorted(closed.items()):
            if why := self._closes_for_me(step, record, ready):
                return why
        if took and view is not None and view.took(step, exclude=self.me):
            return TOOK
        return None

    def _gave_up(self, step: int) -> None:
        """Rule 5 for a follower whose matchmaking for ``step`` ended without a group: until it starts
        matchmaking for the step again, a joiner that asks it is told to pass it over (``failed``),
        not sent on to the leader it last followed, which that joiner may have passed over already
        (it would wait on the redirect until its deadline, and fail the step)."""
        st = self._steps.get(step)
        if st is not None and st.follow is not None:
            st.follow, st.failed = None, True
            st.decided.set()

    def _missed(self, step: int, why: str) -> NoReturn:
        self._decision(step).set()
        raise _missed_error(step, why)

    def _end_lead(self, step: int, state: _Lead, error: Exception, held: bool | None = None) -> NoReturn:
        """End this peer's lead of ``step`` without a group and raise ``error``: each joiner waiting
        is answered ``missed`` (with ``held``, when given: False sends them to form another group)."""
        if held is not None:
            state.held = held
        state.done.set()
        self._decision(step).set()
        raise error from None

    # ---- entry point -----------------------------------------------------------------------------
    async def form_group(self, step: int, weight: float, expected_peers: int | None = None,
                         gather_time: float | None = None, numel: int = 0, timeout: float | None = None,
                         bounds: WeightBounds | None = None) -> Group:
        """Agree on this step's group; raises MissedRoundError or MatchmakingError.

        Waits up to ``gather_time`` (default: matchmaking_time) for ``expected_peers`` to be ready.
        ``numel`` (the vector's size) lets a leading peer's planner size the plan; ``timeout`` (default:
        averaging_timeout) is the round deadline this peer asks for: the group's is the smallest its
        members asked for (rule 3). With ``bounds``,
        a leading peer refuses a join whose weight is above the joiner's bound, and a following peer
        refuses a group with a weight above twice its own bound for that member (averaging/bounds.py).
        """
        loop = asyncio.get_running_loop()
        self._newest = step
        if bounds is not None:
            self._step(step).bounds = bounds
        self._reopen(step)
        t = self.config.matchmaking_time
        gather = t if gather_time is None else max(0.0, gather_time)
        gather_deadline = loop.time() + gather
        me = Member(self.me, float(weight), 0.0 if self.client else self.share, self.client, self.fetch, self.private,
                    self.data)
        started, ready_ttl = loop.time(), 3 * t + gather + self.config.averaging_timeout
        self._step(step).stale_at = started + ready_ttl
        # A late peer learns it at once instead of after the gather window: from a closed record, or,
        # once those expired (its training loop was frozen between reading the collaboration's step
        # and this call), from the others' progress records: it would otherwise take the step alone.
        _, missed = await asyncio.gather(
            self.node.store(self.node.key("ready", step), self.me, ReadyRecord(me, int(numel)).to_wire(), ttl=ready_ttl),
            self._why_missed(step, took=True))
        if missed:
            self._missed(step, missed)
        while True:
            ready = await self._ready(step, me)
            if (expected_peers and len(ready) >= expected_peers) or loop.time() >= min(gather_deadline,
                                                                                       self._answer_by(step)):
                break
            await asyncio.sleep(match_rules.poll_period(len(ready), self.config.matchmaking_time))
        missed = await self._why_missed(step, ready=ready)
        if missed:
            self._missed(step, missed)
        candidates = match_rules.leaders(ready)
        if not candidates:
            raise MatchmakingError(f"step {step}: no reachable peer (neither in client mode nor behind NAT) is ready to lead")
        timeout = timeout or self.config.averaging_timeout
        role: _LeadNext | _FollowNext = _LeadNext(expected_peers, loop.time() + t) if candidates[0] == self.me \
            else _FollowNext(candidates, loop.time() + 2 * t, gather, ready)
        try:
            while True:  # a leader may step down, a follower may end up leading (rule 4): each returns what is next
                if isinstance(role, _LeadNext):
                    outcome = await self._run_lead(step, me, role.expected, role.close_deadline, numel, timeout)
                else:
                    outcome = await self._run_follow(step, me, role.candidates, role.deadline, role.gather, numel,
                                                     timeout, role.ready)
                if isinstance(outcome, Group):
                    group = outcome
                    break
                role = outcome
        except MissedRoundError:
            raise  # (the leader it followed closed the step: a joiner sent there learns the same)
        except MatchmakingError:
            self._gave_up(step)
            raise
        # A group formed over longer than the ready record stored above lives is refused: this process
        # was suspended (a stopped laptop) and woke up to a step whose records had expired, so it could
        # only see itself, and would take the step alone.
        elapsed = loop.time() - started
        if elapsed > ready_ttl:
            raise MatchmakingError(f"step {step}: matchmaking took {elapsed:.0f} s, longer than the step's records "
                                   f"live ({ready_ttl:.0f} s): this peer was suspended; the group is stale")
        return group

    # ---- leader ----------------------------------------------------------------------------------
    async def _run_lead(self, step: int, me: Member, expected: int | None, close_deadline: float,
                        numel: int, timeout: float) -> Group | _FollowNext:
        loop = asyncio.get_running_loop()
        state = _Lead({self.me: me})
        st = self._step(step)
        st.lead = state
        st.decided.set()
        ready: dict[str, Member] = {self.me: me}
        looked = False
        floor = loop.time() + match_rules.POLL  # joiners that are already waiting join before an early close

        def close_at() -> float:  # rule 3: in time for the earliest joiner waiting
            return min(close_deadline, max(self._answer_by(step), floor))

        while loop.time() < close_at():
            try:  # a slow DHT (a dead or frozen node) must not hold the joiners past their deadline
                ready = await asyncio.wait_for(self._ready(step, me), max(0.05, close_at() - loop.time()))
                looked = True
            except asyncio.TimeoutError:
                break
            unreachable = st.unreachable
            smaller = sorted(p for p, m in ready.items() if m.reachable and p < self.me and p not in unreachable)
            downs = st.stepped_down
            if smaller and downs.get(smaller[0], 0) >= MAX_STEP_DOWNS:
                # Each time we stepped down for it, it sent our join on to a leader this peer cannot
                # reach (its own follow target). Stepping down again would loop (lead, step down, be
                # redirected to the unreachable one, lead...) until its deadline.
                logger.info(f"step {step}: {smaller[0]} keeps following a leader this peer cannot reach; "
                            f"leading instead")
                st.unreachable.add(smaller[0])
                continue
            if smaller:
                downs[smaller[0]] = downs.get(smaller[0], 0) + 1
                state.redirect = smaller[0]
                state.done.set()
                self._note(step, f"down:{smaller[0]}", f"stepping down as leader for {smaller[0]}")
                return _FollowNext(smaller, loop.time() + 2 * self.config.matchmaking_time, 0.0, ready)
            if set(ready) - unreachable <= set(state.members) and (not expected or len(state.members) >= expected):
                break
            await asyncio.sleep(match_rules.poll_period(len(ready), self.config.matchmaking_time))
        overslept = loop.time() - close_deadline
        if overslept > 2 * self.config.matchmaking_time or loop.time() > st.stale_at:
            # This process was suspended while it led (a stopped laptop): its joiners gave up at their
            # deadline, at most 2 matchmaking_time after this close, and went on. A group of them would
            # be run by nobody, yet its closed record would close the step for a round's length (and
            # every member would wait on it to skip the step). Any joiner still waiting is told to form
            # another group.
            st.failed = True
            self._end_lead(step, state, MatchmakingError(
                f"step {step}: this peer was suspended while leading ({overslept:.0f} s past its close); its "
                f"joiners have gone: the step is left to the others"), held=False)
        alone = len(state.members) == 1
        if not looked and alone:
            # A follower whose leader's stream open hung until its own deadline (a leader killed
            # mid-matchmaking) leads past that deadline, so the loop above never looked: it must
            # still see the others who gave up on the same leader (each of two such peers would take
            # the step alone). Nobody waits on this answer.
            try:
                ready = await asyncio.wait_for(self._ready(step, me), self.config.matchmaking_time)
            except Exception as e:
                self._end_lead(step, state, MatchmakingError(
                    f"step {step}: leading past the join deadline, and the step's ready records could not be read "
                    f"({type(e).__name__}); not taking the step alone"))
        unjoined = bool(set(ready) - st.unreachable - set(state.members))
        never_joined = match_rules.never_joined(ready, state.members, st.unreachable)
        view = None
        if alone and not unjoined and self.progress is not None:
            view = await self._lone_lead_check(step, state)
            unjoined = match_rules.trainers_outside(view, step, state.members)
        if unjoined:
            # Ready peers never joined: they may have formed a group of their own before this peer's
            # ready record reached them (it woke from a freeze, or its state download just ended),
            # whose closed record was not yet stored when this peer looked at the start. Taking the
            # step anyway would fork the collaboration (a group of one under delayed updates did).
            await self._close_unless_taken(step, state, alone, ready)
        if not _holds_state(tuple(state.members.values())):
            await self._leave_to_trainers(step, state, alone)
        if match_rules.one_contributor(state.members):
            await self._decline_lone_lead(step, state, bool(never_joined or unjoined), alone, view)
        members = tuple(sorted(state.members.values(), key=lambda m: m.peer_id))
        subgroups = split_into_subgroups(members, self.config.max_group_size)
        if self.policy is not None and self.config.strategy == "partitioned":
            members = await self._planned(members, subgroups, numel)
        else:  # no planner checked a NAT'd member's paths: it aggregates nothing
            members = tuple(replace(m, share=0.0) if m.private else m for m in members)
        direct = self.config.transport != "libp2p"
        timeout = min([timeout, *(state.timeouts[m.peer_id] for m in members if m.peer_id in state.timeouts)])
        group = Group(os.urandom(16), step, members, subgroups, self.config.strategy, self.config.compression,
                      timeout, os.urandom(KEY_BYTES) if direct else b"", self.config.encryption, self.config.verify)
        until = time.time() + timeout  # taken now: this process may be frozen before it stores the record
        state.group = group
        state.held = _holds_state(members)
        if state.held:
            state.record = ClosedRecord(self.me, tuple(m.peer_id for m in members), until,
                                        tuple((m.peer_id, state.proofs[m.peer_id]) for m in members
                                              if m.peer_id in state.proofs), me.weight > 0)
        state.done.set()  # answer the joiners first: the record below can wait on a slow DHT
        if state.record is not None:
            stored = self._store_closed(step, state.record)
            if alone and unjoined:  # nobody waits on this lead, and its look after closing needs the record
                await stored
                await self._yield_if_outranked(step, state)
            else:
                # The round starts at once, the record on its way: a DHT store waits on every node it goes
                # to, a frozen one too, and a leader that waited for it would begin its round after its
                # members, whose aggregators refuse its contributions as late. A withdrawal (rule 5)
                # may overtake it: stored later, it expires later, and the DHT keeps the later expiry.
                self._stores.spawn(stored, name=f"dedloc-closed-{step}")
        else:
            logger.info(f"step {step}: led a group in which no member can hand the state on (clients and "
                        f"aggregators only); peers that missed it will form another")
        logger.debug(f"step {step}: led a group of {len(members)}")
        return group

    async def _lone_lead_check(self, step: int, state: _Lead) -> CollaborationView:
        """Rule 9 for a lead of one that saw no ready peer, by the progress records: raises if they
        cannot be read (MatchmakingError) or show the step taken (MissedRoundError, rule 10), else
        returns them. A training peer they show accumulating for ``step`` (not resyncing,
        ``match_rules.trainers_outside``) is one whose ready record did not reach this peer in time,
        so the caller checks the lead like one whose ready peers never joined (a peer woken from a
        freeze would otherwise take the step alone while the others take it together)."""
        view = await self._view()
        if view is None or view.took(step, exclude=self.me):
            # A peer woken from a freeze as the step's closed records expired, whose look at the progress
            # records times out (a slow DHT: dead and frozen nodes), would otherwise take an old step
            # alone while the others are far ahead.
            self._end_lead(step, state, _missed_error(step, TOOK) if view is not None else MatchmakingError(
                f"step {step}: no ready peer seen, and the progress records could not be read; not taking the "
                f"step alone"))
        return view

    async def _decline_lone_lead(self, step: int, state: _Lead, others: bool, alone: bool,
                                 view: CollaborationView | None) -> None:
        """Rule 14 for a group of one contributor: raises LoneStepDeclined (the step stays open, the
        leader keeps its gradients) when ``match_rules.declines_lone_lead`` says so. ``others``: ready
        peers never joined it. The progress records (``view``, or read now: bounded by a quarter of
        ``matchmaking_time`` while joiners wait; none read, nobody counts) add the training peers at the
        step outside the group: trainers at the step still in the round of the step before (delayed
        updates) are not ready yet, their ready records may not have reached this peer through a frozen
        DHT node, and frozen ones publish nothing until they come back."""
        if view is None:
            view = await self._view(self.config.matchmaking_time / (1 if alone else 4))
        beside = match_rules.beside(view, step, state.members) if view is not None else {}
        st = self._step(step)
        declined = st.declined
        if not match_rules.declines_lone_lead(state.members, others or bool(beside), declined, beside):
            return
        st.declined = {**beside, **(declined or {})}  # each peer's record as first seen beside a decline
        if declined is None:
            self._note(step, "declined", "not taking the step with one contributor while other peers are ready "
                                         "for it or training at it; trying again with them")
            why = "other peers are ready for it or training at it, and they would not follow it"
        else:
            silent = match_rules.silent_since(declined, beside)
            why = (f"{len(silent)} trainer(s) at the step ({', '.join(silent)}) have published nothing since it was "
                   f"first declined (frozen, or gone: a record lapses within the progress TTL); taken alone now, the "
                   f"step would be taken again by them when they come back")
            self._note(step, "declined again", f"still not taking the step alone: {why}")
        self._end_lead(step, state, LoneStepDeclined(f"step {step}: not taken by a group of one contributor: {why}"),
                       held=False)

    async def _leave_to_trainers(self, step: int, state: _Lead, alone: bool) -> None:
        """Rule 4 for a lead whose group could hand no state on (clients and aggregator-only peers):
        when the progress records show a trainer that can (not a client, not resyncing, not joined)
        at the step, it will form a group of its own; closing this one would take the step twice
        with other parameters (trainers catching up become ready a few seconds later, and the
        client would fork). Then the joiners are
        told to pass this peer over (``missed, held: false``) and LeftToTrainersError is raised. The
        look is bounded like rule 8's (a quarter of ``matchmaking_time`` with joiners waiting); if
        the records cannot be read, the group closes as before (rule 4's lineage vote settles it)."""
        view = await self._view(self.config.matchmaking_time / (1 if alone else 4))
        if view is None:
            return
        if view.took(step, exclude=self.me):
            self._end_lead(step, state, _missed_error(step, TOOK), held=False)
        trainers = sorted(r.peer_id for r in view.trainers_at(step)
                          if r.role == Role.TRAINER and r.peer_id not in state.members)
        if not trainers:
            return
        logger.info(f"step {step}: this lead's group (clients and aggregators only) could not hand the step on, "
                    f"and {len(trainers)} trainer(s) that can are at it ({trainers[0]}): left to them")
        # no group: joiners pass this peer over (held: false), as for a group that holds no state
        self._end_lead(step, state, LeftToTrainersError(
            f"step {step}: left to the trainers at it ({', '.join(trainers)}): a group of clients and aggregators "
            f"only could not hand the state on"), held=False)

    async def _close_unless_taken(self, step: int, state: _Lead, alone: bool, ready: dict[str, Member]) -> None:
        """Before closing a lead that some ready peers never joined: if another group closed the step
        without this peer, tell its joiners they missed it and raise MissedRoundError (the closed
        group holds the step's state). With joiners waiting, the look is bounded by a quarter of
        ``matchmaking_time`` (they still get their answer in time; a slow DHT: close as before).
        ``alone`` (no one joined): nobody waits, so it may take ``matchmaking_time``, and a lead of
        one that cannot read the records does not take the step (MatchmakingError): under churn a
        slow read let two peers each take the same step alone."""
        bound = self.config.matchmaking_time / (1 if alone else 4)
        try:
            missed = await asyncio.wait_for(self._why_missed(step, ready={**ready, **state.members}), bound)
        except Exception as e:
            if not alone:
                logger.debug(f"step {step}: could not read the closed records before closing: {e!r}")
                return
            self._end_lead(step, state, MatchmakingError(
                f"step {step}: no ready peer joined this peer's lead, and the step's closed records could not be "
                f"read ({type(e).__name__}); not taking the step alone"))
        if missed:  # no group: the joiners are told they missed the step, which is held
            logger.info(f"step {step}: ready peers never joined this peer's lead; {missed}")
            self._end_lead(step, state, _missed_error(step, missed))

    async def _yield_if_outranked(self, step: int, state: _Lead) -> None:
        """A lead of one that ready peers never joined, just closed: another peer may have closed the
        step at the same moment (each looked before the other stored). Once the records have had
        ``matchmaking_time / 4`` to spread, the one that ranks lower withdraws its record and misses
        the step (MissedRoundError): a group of two or more outranks a group of one, and between two
        of one the smaller leader id wins. No member was told of this group, so withdrawing is free."""
        await asyncio.sleep(self.config.matchmaking_time / 4)
        try:
            closed, _ = await asyncio.wait_for(self._standing(step), self.config.matchmaking_time)
        except Exception as e:
            logger.debug(f"step {step}: could not read the closed records after closing: {e!r}")
            return
        winner = match_rules.outranked_by(self._asker, step, closed)
        if winner is None:
            return
        logger.info(f"step {step}: {winner} closed the step at the same time as this peer's lead of one; "
                    f"withdrawing ours")
        state.group = None  # a late joiner is told it missed the step, not handed this group
        await self._withdraw_closed(step)
        self._missed(step, f"the round led by {winner} closed without this peer")

    async def _planned(self, members: tuple[Member, ...], subgroups: tuple[tuple[int, ...], ...],
                       numel: int) -> tuple[Member, ...]:
        """Members with the planner's shares: one plan per subgroup (or for the whole flat group)."""
        out = list(members)
        for sub in subgroups or (tuple(range(len(members))),):
            try:
                shares = await self.policy(tuple(members[i] for i in sub), numel)
            except Exception as e:  # planning never fails a round: keep the declared shares
                logger.warning(f"planning failed ({type(e).__name__}: {e}); using the declared shares")
                return members
            if len(shares) != len(sub) or not any(g > 0 for g in shares):
                logger.warning("the planner returned no usable shares; using the declared shares")
                return members
            for i, g in zip(sub, shares):
                out[i] = replace(members[i], share=float(g) if members[i].share > 0 and not members[i].client else 0.0)
        return tuple(out)

    async def _on_join(self, remote: PeerID, request: Any) -> dict[str, Any]:
        peer = remote.to_base58()
        received = asyncio.get_running_loop().time()
        try:
            if not isinstance(request, dict) or request.get("v") != VERSION:
                theirs = request.get("v") if isinstance(request, dict) else None
                raise ProtocolError(f"protocol version mismatch: ours is {VERSION}, theirs is {theirs}")
            step = int(request["step"])
            member = _parse_entry(peer, request)
            gather = min(max(float(request.get("g", 0.0)), 0.0), 600.0)
            proof = JoinProof.from_wire(request.get("j"))
            wants = _seconds(request.get("t"), 1.0, MAX_TIMEOUT)
            answer_within = _seconds(request.get("by"), 0.0, 600.0)
            if member is None or step < 0:
                raise ProtocolError("malformed join request")
            if not self._newest - KEEP_STEPS <= step <= self._newest + JOIN_AHEAD:
                raise _CannotLead(f"step {step} is not near this peer's step {self._newest}")
            if proof is None or proof.contributes != (member.weight > 0) or \
                    not proof.holds(self.node.config.run_id, step, self.me, peer):
                raise ProtocolError("the join is not signed by its sender for this leader and step")
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            self._refusals.warn(peer, f"refused join request from {peer}: {e}")
            return (JoinAnswer.cannot_lead if isinstance(e, _CannotLead) else JoinAnswer.refused)(str(e)).to_wire()
        waiting = self._step(step).waiting
        if answer_within is not None:  # the leader's work after closing is bounded by matchmaking_time / 2
            waiting[peer] = received + answer_within - ANSWER_MARGIN * self.config.matchmaking_time
        try:
            return (await self._answer_join(step, peer, member, gather, proof, wants)).to_wire()
        finally:
            waiting.pop(peer, None)

    async def _answer_join(self, step: int, peer: str, member: Member, gather: float, proof: JoinProof,
                           wants: float | None) -> JoinAnswer:
        incarnation = proof.incarnation
        try:
            await asyncio.wait_for(self._decision(step).wait(), 2 * self.config.matchmaking_time + gather)
        except asyncio.TimeoutError:
            return JoinAnswer.cannot_lead(f"not matchmaking for step {step}")
        st = self._step(step)
        bounds = st.bounds
        excess = bounds.excess(peer, member.weight) if bounds is not None else None
        if excess is not None:
            self._refusals.warn(peer, f"step {step}: refused the join of {peer}: {excess}")
            return JoinAnswer.refused(excess)
        if st.failed:
            return JoinAnswer.round_failed()
        if st.follow is not None and st.lead is None:
            return JoinAnswer.redirected(st.follow)
        state = st.lead
        if state is None:
            return JoinAnswer.missed()
        if state.done.is_set():
            if state.redirect:
                return JoinAnswer.redirected(state.redirect)
            if state.group is not None and state.group.index(peer) is not None:
                if state.incarnations.get(peer, incarnation) != incarnation:
                    logger.info(f"step {step}: {peer} restarted after joining; its new process joins the next step")
                    return self._missed_answer(state)
                return JoinAnswer.joined(state.group.to_wire())
            return self._missed_answer(state)
        state.members[peer] = member
        state.incarnations[peer] = incarnation
        state.proofs[peer] = proof
        if wants is not None:
            state.timeouts[peer] = wants
        await state.done.wait()
        if state.redirect:
            return JoinAnswer.redirected(state.redirect)
        return JoinAnswer.joined(state.group.to_wire()) if state.group else self._missed_answer(state)

    @staticmethod
    def _missed_answer(state: _Lead) -> JoinAnswer:
        """``missed``, with the group's ``closed`` record when there is one: the asker checks it (rule 13)
        rather than wait for the record to reach the DHT."""
        return JoinAnswer.missed(state.held, state.record.to_wire()
                                 if state.record is not None and state.group is not None else None)

    # ---- follower --------------------------------------------------------------------------------
    async def _missed_by(self, step: int, leader: str, record: Any, ready: dict[str, Member]) -> str | None:
        """Why this peer missed ``step``, as its leader answered (rule 13): the group record the answer
        carries, or what the ``closed`` and progress records show; None if nothing shows a group that
        closed the step for this peer (the leader is then passed over, as one that could not be reached).
        If the records cannot be read within ``matchmaking_time``, the leader's word stands."""
        closed = ClosedRecord.from_wire(leader, record) if record is not None else None
        if closed is not None and closed.members is not None:
            if why := self._closes_for_me(step, closed, ready):
                return why
        try:
            return await asyncio.wait_for(self._why_missed(step, took=True, ready=ready), self.config.matchmaking_time)
        except Exception as e:
            logger.debug(f"step {step}: could not read the records after {leader}'s missed answer: {e!r}")
            return f"the round led by {leader} was already closed"

    async def _ask(self, step: int, leader: str, request: dict[str, Any], deadline: float) -> JoinAnswer | None:
        """Send ``request`` to ``leader`` and return its answer; None if the request could not be
        delivered. A stream that broke after delivery raises ConnectionError/IncompleteReadError; any
        other failure, or an answer that is not a dict, raises MatchmakingError."""
        loop = asyncio.get_running_loop()
        try:
            reader, writer = await asyncio.wait_for(
                self.node.streams.open(leader, self.proto),
                max(0.1, deadline - loop.time()))
        except Exception as e:
            self._note(step, f"unreachable:{leader}",
                       f"leader {leader} unreachable ({type(e).__name__}: {str(e)[:200]}); trying the next")
            return None
        try:  # ``by``: how long this peer still waits for the answer (rule 3)
            await messages.write_message(writer, {**request, "by": round(max(0.0, deadline - loop.time()), 3)})
            response = await asyncio.wait_for(messages.read_message(reader), max(0.1, deadline - loop.time()))
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as e:
            raise MatchmakingError(f"step {step}: leader {leader} did not answer the join request: "
                                   f"{type(e).__name__}: {e}") from None
        finally:
            writer.close()
        if not isinstance(response, dict):
            raise MatchmakingError(f"step {step}: leader {leader} sent a malformed answer")
        return JoinAnswer.from_wire(response)

    async def _run_follow(self, step: int, me: Member, candidates: list[str], deadline: float,
                          gather: float, numel: int, timeout: float, ready: dict[str, Member]) -> Group | _LeadNext:
        loop = asyncio.get_running_loop()
        self._decision(step).set()
        request = {"v": VERSION, "step": step, **ReadyRecord(me).to_wire(), "g": gather,
                   "t": timeout}
        tried: set[str] = set()
        leader = candidates[0]
        broken = 0
        regrouped = False
        hops = 0
        while hops < 8:
            hops += 1
            st = self._step(step)
            st.follow = leader
            st.decided.set()
            tried.add(leader)
            signed = join_statement(self.node.config.run_id, step, leader, self.me, self.incarnation, me.weight > 0)
            request["j"] = JoinProof(self.incarnation, self.node.sign(signed), me.weight > 0).to_wire()  # rule 13
            try:
                response = await self._ask(step, leader, request, deadline)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                # The stream broke; the leader may or may not hold our join. Asking the same leader
                # again is safe: a join is idempotent there, and its group is final once sent.
                broken += 1
                if broken > 2 or loop.time() >= deadline:
                    raise MatchmakingError(f"step {step}: leader {leader} did not answer the join request: "
                                           f"{type(e).__name__}: {e}") from None
                logger.debug(f"step {step}: join stream to {leader} broke ({e!r}); asking again")
                continue
            kind = None if response is None else response.kind
            if response is None:  # the request was never delivered: safe to try another leader
                passed_over = f"no reachable leader among {candidates}"
            elif kind is Answer.GROUP:
                group = Group.from_wire(response.group)
                if group.step != step or group.index(self.me) is None:
                    raise MatchmakingError(f"step {step}: leader {leader} sent a group without this peer")
                if group.round_id in st.dead:
                    # Rule 12: our round in that group failed here, and the leader still runs it; running it
                    # again would send another weight into it. The step is that group's until it ends.
                    raise MatchmakingError(f"step {step}: leader {leader} answered with the group whose round "
                                           f"already failed at this peer; the step is held until that round ends")
                bounds = st.bounds
                for m in group.members if bounds is not None else ():
                    if (excess := bounds.excess(m.peer_id, m.weight, FOLLOWER_TOLERANCE)) is not None:
                        raise MatchmakingError(f"step {step}: leader {leader} admitted an implausible claim: {excess}")
                return group
            elif kind is Answer.REDIRECT:
                if response.redirect in st.unreachable:
                    # It still waits on the leader this peer passed over (the peers that waited on one
                    # give up within moments of each other): ask it again once it leads or follows
                    # another, until the deadline (not a hop).
                    if loop.time() + REASK_S >= deadline:
                        raise MatchmakingError(f"step {step}: {leader} still follows {response.redirect}, "
                                               f"which this peer passed over")
                    hops -= 1
                    await asyncio.sleep(REASK_S)
                    continue
                leader = response.redirect
                continue
            elif kind is Answer.NOT_HELD:
                why = f"{leader}'s round for this step failed" if response.failed else \
                    f"the round led by {leader} closed with no member that can hand its state on"
                self._note(step, f"failed:{leader}", f"{why}; forming another")
                passed_over = f"{why}, and no other reachable peer is ready to lead"
            elif kind is Answer.MISSED:
                why = await self._missed_by(step, leader, response.closed, ready)
                if why:
                    raise _missed_error(step, why)
                self._note(step, f"unproven:{leader}", f"{leader} answered that this peer missed the step, but no "
                                                       f"group that closed it for this peer shows; forming another")
                passed_over = f"{leader} answered missed without a group that closed the step, and no other " \
                              f"reachable peer is ready to lead"
            elif kind is Answer.CANNOT_LEAD:  # (a process restarted under its id, whose old ready record
                # still shows): passed over, as if unreachable
                why = f"{leader} cannot lead the step ({response.error[:200]})"
                self._note(step, f"cannot lead:{leader}", f"{why}; forming another")
                passed_over = f"{why}, and no other reachable peer is ready to lead"
            else:
                raise MatchmakingError(f"step {step}: leader {leader} refused: {response.error}")
            # this leader is passed over for the step (every peer that asks it is, alike): the next one leads
            st.unreachable.add(leader)
            if not regrouped:
                # Rule 4: the peers that waited on it give up together, at their deadline (a leader frozen
                # whole: its stream open hangs until then); they regroup in one fresh window, once (the
                # next one, leading with no time left, would close alone at once while the others miss
                # the step).
                regrouped = True
                # undecided while it looks: a joiner that gave up on the same leader waits for what this
                # peer does next (it leads, or follows another), instead of being redirected to the one
                # both passed over
                self._undecide(step)
                deadline = max(deadline, loop.time() + 2 * self.config.matchmaking_time)
                try:  # and by what they see now: a ready record slow to spread (the frozen node is a DHT node too)
                    fresh = await asyncio.wait_for(self._ready(step, me), self.config.matchmaking_time / 2)
                    candidates = sorted(set(candidates) | {p for p, m in fresh.items() if m.reachable})
                    ready = {**ready, **fresh}
                except Exception as e:
                    logger.debug(f"step {step}: could not read the ready records again: {e!r}")
            rest = [c for c in candidates if c not in tried and c != self.me]
            if not rest or (self.node.reachable and rest[0] > self.me):  # (only a reachable peer leads)
                if self.node.reachable:
                    # close while the others, who gave up on the same leader, still wait for an answer
                    t = self.config.matchmaking_time
                    close = min(deadline - t / 2, loop.time() + t)
                    return _LeadNext(None, close)
                raise MatchmakingError(f"step {step}: {passed_over}")
            leader = rest[0]
        raise MatchmakingError(f"step {step}: too many redirects while looking for the leader")
