"""A collaboration far larger than this machine, on a virtual clock, driven by the real rules.

    python bench/simulate.py [--peers 10 100 1000] [--hours 1] [--seed 0] [--target 4096]

Prints one JSON line per ``--peers`` value: ``peers``, ``sim_hours``, ``steps_per_hour``,
``lost_steps``, ``skipped_steps``, ``matchmaking_p50_s``, ``matchmaking_p95_s``, ``group_sizes``,
``dht_requests_per_peer_step``, ``dht_bytes_per_peer_step``, ``records_alive``,
``planner_solve_s``, ``wall_s`` and more (``hot_key``: the busiest DHT key's load, ``decide_ms``:
what one step-boundary decision costs a peer's CPU at this size).

Real (imported from dedloc, not copied): the progress records and the collaboration's view built
from them (``records.CollaborationView``: the attested global step, samples at a step, the peers
a round waits for); the step boundary (``optim.step_rules.at_boundary``) and the background-report
rule (``optim.progress.far_from_target``); matchmaking's leader order, rule 14 and how often the ready records
are read (``averaging.match_rules.leaders``, ``never_joined``, ``declines_lone_lead``, ``poll_period``); hierarchical
subgroups (``averaging.group.split_into_subgroups``); the LP planner (``planning.lp.choose``, solved
for real, its wall time charged to the leader's virtual clock) and its predicted round time; the
byte size of every record on the wire (msgpack of ``to_wire()``).

Modelled: a DHT as one store per key with latency (lognormal, median ``--dht-ms``), a TTL per
record and lost requests (``--dht-loss``: a lost get costs its timeout and returns nothing, a store
whose first replicas do not answer lands that timeout late); peers drawn from the paper's mix (10 % servers at 1 Gbit/s, 30 %
workstations at 100-200 Mbit/s, 60 % home links at 20-50 Mbit/s, two thirds of those behind NAT,
so client mode), with compute speeds to match; a join is one RPC to the leader (a dead or frozen
leader costs the joiner its 2 x matchmaking_time deadline, then it passes the leader over); a round
lasts the planner's predicted time for its subgroups plus the representatives' round, plus a
latency per stage; an aggregator that dies mid-round costs a failover (its part again), two in one
backup chain fail the round for everyone (they keep their state and retry the step). Churn per
peer and hour (``--kill``, ``--freeze``, ``--leave``): killed and leaving peers are replaced by new
ones 10-60 s later, which download the state; frozen ones stop for 20-40 s.

Not modelled: the verification of rounds, the amendments after a failover, the lineage votes as
such (a peer whose step a larger group also took resyncs, as the vote would make it), NAT
traversal and relays, the backbone. ``lost_steps`` counts steps taken by two disjoint groups of two or more at once (a fork
the rules must prevent); ``lone_forks`` steps a group of one took beside a larger group (rule 13
lets it; the lineage vote outvotes that peer, which then resyncs);
``skipped_steps`` rounds that failed for every member (the step is then retried).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dedloc.averaging import match_rules  # noqa: E402
from dedloc.averaging.group import Group, split_into_subgroups  # noqa: E402
from dedloc.net.tcp import KEY_BYTES  # noqa: E402
from dedloc.config import AveragingConfig, OptimizerConfig, PeerConfig  # noqa: E402
from dedloc.optim import step_rules  # noqa: E402
from dedloc.optim.progress import far_from_target  # noqa: E402
from dedloc.planning import lp  # noqa: E402
from dedloc.records import CollaborationView, Member, ProgressRecord, ReadyRecord, Role  # noqa: E402
from dedloc.optim.step_rules import Action  # noqa: E402

EPOCH = 1.8e9
"""Virtual wall clock at the simulation's start (records carry wall-clock times)."""
SNAPSHOT_S = 0.2
"""A read returns the key as it was up to this long ago (stores take that long to spread), so the
readers of one moment share one snapshot, and one view built from it."""
GET_TIMEOUT = 2.0
"""What a lost DHT get costs its caller."""
MAX_HOPS = 3
"""Redirects a join follows before it passes the leader over (the matchmaker's MAX_STEP_DOWNS)."""
MBIT = 1e6 / 8


def _wire_bytes(obj: Any) -> int:
    return len(msgpack.packb(obj, use_bin_type=True))


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- the clock and the DHT ---------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(t, self.now), self._seq, fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def run(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            self.now, _, fn = heapq.heappop(self._queue)
            fn()
        self.now = until

    @property
    def wall(self) -> float:
        return EPOCH + self.now


@dataclass
class _Entry:
    value: Any
    size: int
    expires: float


@dataclass
class _Key:
    entries: dict[str, _Entry] = field(default_factory=dict)
    requests: int = 0
    bytes: int = 0
    snapshot: dict[str, _Entry] = field(default_factory=dict)
    """What reads return: the entries alive as of ``snapshot_at`` (SNAPSHOT_S)."""
    snapshot_at: float = -math.inf
    version: int = 0
    """Of the snapshot."""
    size: int = 0


class SimDHT:
    """One store per key (subkey -> value), with latency, TTLs and lost requests."""

    def __init__(self, clock: Clock, rng: random.Random, median_ms: float, loss: float):
        self.clock, self.rng, self.median, self.loss = clock, rng, median_ms / 1000, loss
        self.keys: dict[str, _Key] = {}
        self.requests = 0
        self.bytes = 0

    def latency(self) -> float:
        return self.median * math.exp(self.rng.gauss(0.0, 0.5))

    def _count(self, key: str, nbytes: int) -> _Key:
        k = self.keys.setdefault(key, _Key())
        k.requests += 1
        k.bytes += nbytes
        self.requests += 1
        self.bytes += nbytes
        return k

    def store(self, key: str, subkey: str, value: Any, size: int, ttl: float) -> None:
        k = self._count(key, size + len(key) + len(subkey))
        delay = self.latency()
        if self.rng.random() < self.loss:  # its first replicas did not answer: it lands late
            delay += GET_TIMEOUT

        def land() -> None:
            k.entries[subkey] = _Entry(value, size, self.clock.now + ttl)
        self.clock.after(delay, land)

    def get(self, key: str, reply: Callable[[dict[str, _Entry] | None, int], None]) -> None:
        """``reply(entries alive, version)`` after a round trip; (None, -1) after GET_TIMEOUT if lost."""
        k = self._count(key, len(key))
        if self.rng.random() < self.loss:
            self.clock.after(GET_TIMEOUT, lambda: reply(None, -1))
            return
        delay = self.latency()

        def answer() -> None:
            now = self.clock.now
            if now - k.snapshot_at >= SNAPSHOT_S:
                k.entries = {s: e for s, e in k.entries.items() if e.expires > now}
                k.snapshot, k.snapshot_at, k.version = dict(k.entries), now, k.version + 1
                k.size = sum(e.size for e in k.snapshot.values())
            k.bytes += k.size
            self.bytes += k.size
            snapshot, version = k.snapshot, k.version
            self.clock.after(delay / 2, lambda: reply(snapshot, version))
        self.clock.after(delay / 2, answer)

    def alive(self) -> int:
        now = self.clock.now
        return sum(1 for k in self.keys.values() for e in k.entries.values() if e.expires > now)


# ---- peers -------------------------------------------------------------------------------------------
@dataclass
class Kind:
    name: str
    mbit: tuple[float, float]
    speed: tuple[float, float]
    """Samples per second."""
    nat: float
    """Probability of being behind NAT (client mode)."""


MIX = ((0.1, Kind("server", (1000, 1000), (16, 32), 0.0)),
       (0.3, Kind("workstation", (100, 200), (4, 12), 0.0)),
       (0.6, Kind("home", (20, 50), (1, 4), 2 / 3)))
"""Samples per second of ALBERT-large on 512-token sequences: data-centre GPUs, consumer GPUs,
notebook-class GPUs."""


@dataclass
class Lead:
    """A step's group as its leader forms it."""

    leader: str
    step: int
    members: dict[str, Member]
    joiners: list["SimPeer"]
    ready: dict[str, Member] | None = None
    """The ready peers the leader saw when it decided to lead (None: not leading yet)."""
    closed: bool = False
    declined: dict[str, float] | None = None
    withdrawn: bool = False
    """Rule 9: outranked by a larger group that closed the step at the same time."""
    redirect: str | None = None
    """The peer this one follows (it does not lead): joins are sent there."""


class SimPeer:
    def __init__(self, sim: "Simulation", pid: str, kind: Kind):
        rng = sim.rng
        self.sim, self.id, self.kind = sim, pid, kind
        mbps = rng.uniform(*kind.mbit)
        self.up, self.down = mbps * MBIT * rng.uniform(0.5, 1.0), mbps * MBIT
        self.speed = rng.uniform(*kind.speed)
        self.client = rng.random() < kind.nat
        self.micro_batch = sim.args.micro_batch
        self.alive, self.frozen_until = True, 0.0
        self.step = self.samples = 0
        self.epoch = 0
        """Bumped on death or freeze: callbacks of an older epoch are dropped."""
        self.view: CollaborationView | None = None
        self.view_at = -math.inf
        self.latency = 0.2
        self.mb_time = self.micro_batch / self.speed
        self.busy = False
        self.ready_at = self.started_at = 0.0
        self.attempt = 0
        self.data = f"198.51.{sim.rng.randrange(256)}.{sim.rng.randrange(256)}:{sim.rng.randrange(1024, 65536)}/" + \
            "%064x" % sim.rng.getrandbits(256)
        """Its direct-connection endpoint as published (host:port/certificate fingerprint)."""
        self.last_members: tuple[str, ...] = ()
        self.forked: str | None = None
        """Set when a larger group took a step this peer took alone (rule 13 let it): the lineage
        vote outvotes it, and it resyncs at its next step boundary (the "disagrees" rule)."""

    # -- plumbing
    @property
    def role(self) -> Role:
        return Role.CLIENT if self.client else Role.TRAINER

    def live(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn``, dropped if this peer died or froze before it runs."""
        epoch = self.epoch

        def call(*a: Any) -> None:
            if self.alive and self.epoch == epoch:
                fn(*a)
        return call

    def member(self) -> Member:
        return Member(self.id, float(self.samples), 0.0 if self.client else 1.0, self.client, True, self.client,
                      "" if self.client else self.data)

    def record(self, busy: bool) -> ProgressRecord:
        now = self.sim.clock.wall
        # the fingerprint names the step it holds (no peer here disagrees about parameters): rule 10 and
        # the attested step read it as they read a real one
        return ProgressRecord(self.id, self.step, self.samples, self.speed, self.role, 0.0, now,
                              now + self.mb_time if busy else 0.0, f"{self.step}:{self.step:024x}")

    def publish(self, busy: bool) -> None:
        rec = self.record(busy)
        self.sim.dht.store("progress", self.id, rec, self.sim.size_of(rec), self.sim.progress_ttl)

    # -- training
    def start(self) -> None:
        self.started_at = self.sim.clock.now
        self.publish(busy=False)
        self.read_progress(self.after_join_read)

    def after_join_read(self, view: CollaborationView | None) -> None:
        if view is not None and view.global_step > self.step:
            self.resync(view.global_step, "joining")
        else:
            self.compute()

    def compute(self) -> None:
        self.busy = True
        self.sim.clock.after(self.mb_time, self.live(self.micro_batch_done))

    def micro_batch_done(self) -> None:
        self.samples += self.micro_batch
        self.sim.sample_seconds += self.mb_time
        far = self.view is not None and far_from_target(
            self.view, self.id, self.step, self.samples, self.speed, self.sim.clock.now - self.view_at, self.latency,
            self.mb_time, self.sim.args.target, self.sim.clock.wall)
        self.publish(busy=True)
        if far:  # background report: decide on the view in hand
            self.read_progress(lambda view: None)
            self.decide(self.view)
        else:
            self.read_progress(self.live(self.decide))

    def read_progress(self, then: Callable[[CollaborationView | None], None]) -> None:
        sent = self.sim.clock.now

        def got(entries: dict[str, _Entry] | None, version: int) -> None:
            if entries is None:
                then(self.view)  # (a lost read: the view in hand stands in, as a failed report's retry would)
                return
            self.latency = 0.8 * self.latency + 0.2 * (self.sim.clock.now - sent)
            self.view, self.view_at = self.sim.view_of(entries, version), self.sim.clock.now
            then(self.view)
        self.sim.dht.get("progress", self.live(got))

    def decide(self, view: CollaborationView | None) -> None:
        if view is None:
            self.compute()
            return
        t0 = time.perf_counter()
        d = step_rules.at_boundary(view, self.id, self.step, self.sim.args.target, disagreement=self.forked,
                                   client=self.client, catching_up=False, missed_round_runs=lambda: False)
        self.sim.decide_s.append(time.perf_counter() - t0)
        if d.action is Action.RESYNC:
            self.resync(view.global_step, d.rule)
        elif d.action is Action.ROUND:
            self.matchmake()
        else:
            self.compute()

    def resync(self, target: int, why: str) -> None:
        """Download the state of step >= ``target`` from a trainer that holds it: the state it holds
        when asked (parameters and optimizer state, ``state_bytes``). With ``--replay K`` (a design
        not built yet: docs/scaling.md), a peer at most K steps behind on the run's history instead
        downloads the averaged gradients of the steps it lacks (``nbytes`` each) from a member that
        kept them, and applies them as the members did."""
        sim = self.sim
        self.samples, self.forked = 0, None
        donors = [p for p in sim.peers.values() if p.alive and not p.client and p is not self
                  and p.step >= target and p.frozen_until <= sim.clock.now]
        if not donors:
            sim.clock.after(5.0, self.live(self.compute))
            return
        donor = sim.rng.choice(donors)
        step = donor.step  # the state it holds now is the one it sends
        behind = step - self.step
        replay = 0 < behind <= sim.args.replay and self.started_at < sim.clock.now - 1e-9 and self.step > 0
        nbytes = behind * sim.nbytes if replay else sim.state_bytes
        seconds = nbytes / min(donor.up, self.down) + 2 * sim.dht.latency()
        sim.resyncs += 1
        sim.replays += replay

        def loaded() -> None:
            self.step = max(self.step, step)
            self.samples = 0
            self.publish(busy=False)
            self.compute()
        sim.clock.after(seconds, self.live(loaded))

    # -- matchmaking
    def matchmake(self) -> None:
        """Form a group for this step, as ``Matchmaker.form_group`` does: store a ready record, gather
        the ready peers until the expected ones are (or the gather window ends: the optimizer's,
        stretched to the others' current micro-batch, ``busy_until``), then lead or join."""
        sim, step, view = self.sim, self.step, self.view
        if view is not None and view.took(step, exclude=self.id):  # rule 10: most trainers hold its update
            self.missed(step)
            return
        self.ready_at = sim.clock.now
        ready = ReadyRecord(self.member(), sim.numel)
        sim.dht.store(f"ready.{step}", self.id, self.member(), sim.size_of(ready), 3 * sim.mm + sim.mm + 60.0)
        expected, gather = 1, sim.mm
        if view is not None:
            expected = view.expected_at(step, self.id, self.last_members)
            busy = max((r.busy_until for r in view.trainers_at(step) if r.peer_id != self.id), default=0.0)
            gather = min(sim.max_gather, max(sim.mm, busy - sim.clock.wall + 1.0))
        deadline = sim.clock.now + gather

        def poll() -> None:
            def got(entries: dict[str, _Entry] | None, version: int) -> None:
                n = len(entries) if entries is not None else 0
                if (n >= expected or sim.clock.now >= deadline) and entries is not None:
                    sim.closed_for(step, self.id, self.live(lambda why: self.missed(step) if why
                                                            else self.choose(step, entries, version, expected)))
                elif sim.clock.now >= deadline + sim.mm:
                    self.compute()  # nothing readable: accumulate on, try again
                else:
                    sim.clock.after(sim.poll(n), self.live(poll))
            sim.dht.get(f"ready.{step}", self.live(got))
        poll()

    def choose(self, step: int, entries: dict[str, _Entry], version: int, expected: int) -> None:
        sim = self.sim
        ready = sim.ready_of(step, entries, version)
        if self.id in ready:
            order = sim.leaders_of(step, ready, version)
        else:  # its own record has not landed (or was lost): it counts itself
            ready = {**ready, self.id: self.member()}
            order = match_rules.leaders(ready)
        if not order:
            sim.clock.after(sim.mm, self.live(self.compute))
            return
        if order[0] == self.id:
            self.lead(step, ready, expected)
        else:
            self.join(step, order, 0)

    def lead(self, step: int, ready: dict[str, Member], expected: int) -> None:
        """Lead ``step`` as ``Matchmaker._run_lead`` does: re-read the ready peers (``match_rules.poll_period``); close
        at ``matchmaking_time``, or once every ready peer joined and the group holds ``expected``."""
        sim = self.sim
        lead = sim.leads.get((step, self.id))
        if lead is None or lead.closed:
            lead = Lead(self.id, step, {self.id: self.member()}, [self], ready=ready)
            sim.leads[(step, self.id)] = lead
        else:  # joins arrived before it decided to lead
            lead.ready, lead.redirect = ready, None
            lead.members[self.id] = self.member()
            lead.joiners.append(self)
        close_at = sim.clock.now + sim.mm

        def poll() -> None:
            def got(entries: dict[str, _Entry] | None, version: int) -> None:
                if lead.closed:
                    return
                if entries is not None:
                    lead.ready = sim.ready_of(step, entries, version)
                    first = sim.leaders_of(step, lead.ready, version)
                    if first and first[0] < self.id:  # a smaller reachable peer is ready: step down, follow it
                        lead.closed = True
                        sim.stepped_down += 1
                        for p in lead.joiners:
                            if p.alive:
                                p.join(step, first, 0)
                        return
                if sim.clock.now >= close_at or (set(lead.ready) <= set(lead.members)
                                                 and len(lead.members) >= expected):
                    sim.close(lead)
                else:
                    sim.clock.after(sim.poll(len(lead.ready)), self.live(poll))
            sim.dht.get(f"ready.{step}", self.live(got))
        poll()

    def join(self, step: int, order: list[str], i: int, hops: int = 0) -> None:
        """Join ``order[i]``'s lead; one that does not answer within the join deadline
        (2 x matchmaking_time) is passed over (rule 4) for the next in ``order``."""
        sim = self.sim
        if i >= len(order):
            self.compute()
            return
        mine = sim.leads.get((step, self.id))
        if mine is not None and not mine.closed:  # it follows: joins queued with it are redirected
            mine.redirect, queued = order[i], mine.joiners
            mine.joiners, mine.members = [], {}
            for p in queued:
                if p.alive and p is not self:
                    p.join(step, order[i:], 0)
        leader = sim.peers.get(order[i])
        lead = sim.leads.get((step, order[i]))
        if lead is None:  # its join waits for the leader's decision (lead or follow): it is queued
            lead = sim.leads[(step, order[i])] = Lead(order[i], step, {}, [])
        if leader is None or not leader.alive or leader.frozen_until > sim.clock.now or leader.step > step:
            if leader is not None and leader.alive and leader.step > step:
                self.missed(step)
                return
            sim.clock.after(2 * sim.mm, self.live(lambda: self.join(step, order, i + 1)))
            return

        def arrive() -> None:
            if lead.redirect is not None and lead.redirect != self.id:
                if hops < MAX_HOPS:  # sent on to whom it follows
                    self.join(step, [lead.redirect, *order[i + 1:]], 0, hops + 1)
                else:  # followers sending each other on: pass it over, as an unanswered leader
                    sim.clock.after(2 * sim.mm, self.live(lambda: self.join(step, order, i + 1)))
                return
            if lead.closed:
                self.missed(step)
                return
            lead.members[self.id] = self.member()
            lead.joiners.append(self)
            self.attempt += 1
            attempt = self.attempt

            def deadline() -> None:
                # unanswered: the leader froze, died or follows another (and this join was not sent on)
                if not lead.closed and self.attempt == attempt and self in lead.joiners:
                    lead.joiners.remove(self)
                    lead.members.pop(self.id, None)
                    self.join(step, order, i + 1)
            sim.clock.after(2 * sim.mm, self.live(deadline))
        sim.clock.after(sim.dht.latency(), self.live(arrive))

    def missed(self, step: int) -> None:
        """The step closed without this peer: it downloads the state once the round is over."""
        self.sim.clock.after(self.sim.mm, self.live(lambda: self.resync(step + 1, "missed")))


class Simulation:
    def __init__(self, args: argparse.Namespace, peers: int, seed: int):
        self.args, self.n = args, peers
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.dht = SimDHT(self.clock, self.rng, args.dht_ms, args.dht_loss)
        avg, cfg = AveragingConfig(), PeerConfig()
        self.mm, self.max_group = avg.matchmaking_time, avg.max_group_size
        self.max_gather = OptimizerConfig().max_gather_wait
        self.progress_ttl = cfg.progress_ttl
        self.numel = int(args.params)
        self.nbytes = self.numel * args.bytes_per_param
        self.state_bytes = self.numel * 4 * 3  # parameters and two Adam moments
        self.peers: dict[str, SimPeer] = {}
        self.leads: dict[tuple[int, str], Lead] = {}
        self.taken: dict[int, list[tuple[str, ...]]] = {}
        self._views: dict[int, CollaborationView] = {}
        self._ready: dict[tuple[int, int], dict[str, Member]] = {}
        self._leaders: dict[tuple[int, int], list[str]] = {}
        self._sizes: dict[type, int] = {}
        self.matchmaking_s: list[float] = []
        self.group_sizes: list[int] = []
        self.solve_s: list[float] = []
        self.leader_bytes: list[int] = []
        self.round_s: list[float] = []
        self.batches: list[float] = []
        self.decide_s: list[float] = []
        self.records_alive: list[int] = []
        self.alive_samples: list[int] = []
        self.failed_rounds = self.resyncs = self.forks = self.lone_forks = self.stepped_down = self.replays = self.withdrawn = 0
        self.sample_seconds = 0.0
        self._next_id = 0

    def poll(self, ready: int) -> float:
        """Seconds between two reads of a step's ready records, as the matchmaker waits them
        (``--fixed-poll``: the flat 0.05 s it waited before ``poll_period``)."""
        return match_rules.POLL if self.args.fixed_poll else match_rules.poll_period(ready, self.mm)

    # -- shared reads: every peer reading the same DHT version gets the same object (no copy per reader)
    def size_of(self, record: Any) -> int:
        kind = type(record)
        if kind not in self._sizes:
            self._sizes[kind] = _wire_bytes(record.to_wire()) + 46  # + the subkey (a peer id)
        return self._sizes[kind]

    def view_of(self, entries: dict[str, _Entry], version: int) -> CollaborationView:
        view = self._views.get(version)
        if view is None:
            self._views = {version: (view := CollaborationView.build([e.value for e in entries.values()],
                                                                     self.clock.wall))}
        return view

    def ready_of(self, step: int, entries: dict[str, _Entry], version: int) -> dict[str, Member]:
        key = (step, version)
        if key not in self._ready:
            self._ready[key] = {s: e.value for s, e in entries.items()}
        return self._ready[key]

    def leaders_of(self, step: int, ready: dict[str, Member], version: int) -> list[str]:
        key = (step, version)
        if key not in self._leaders:
            self._leaders[key] = match_rules.leaders(ready)
        return self._leaders[key]

    # -- a group closes
    def closed_for(self, step: int, me: str, then: Callable[[bool], None], tries: int = 2) -> None:
        """``then(True)`` if the step's closed records show a group of two or more contributors
        without ``me`` (rule 13, proofs taken as valid): the step is taken, ``me`` missed it. A lost
        read is asked again (twice; then it counts as none)."""
        def got(entries: dict[str, _Entry] | None, version: int) -> None:
            if entries is None and tries > 0:
                self.closed_for(step, me, then, tries - 1)
                return
            then(any(me not in e.value and len(e.value) >= 2 for e in (entries or {}).values()))
        self.dht.get(f"closed.{step}", got)

    def close(self, lead: Lead, checked: bool = False) -> None:
        leader = self.peers[lead.leader]
        if lead.closed or not leader.alive or lead.ready is None:
            return
        members = dict(lead.members)
        never = match_rules.never_joined(lead.ready, members, set())
        if never and not checked:  # rule 9: ready peers never joined: did another group take the step?
            def then(taken: bool) -> None:
                if not taken:
                    self.close(lead, checked=True)
                elif not lead.closed:  # its joiners are told they missed the step
                    lead.closed = True
                    for p in lead.joiners:
                        if p.alive:
                            p.missed(lead.step)
            self.closed_for(lead.step, lead.leader, leader.live(then))
            return
        others = bool(never)
        # (the simulation reads no progress records here: no trainer beside the lead counts as silent)
        if match_rules.declines_lone_lead(members, others, lead.declined, {}):
            lead.declined = {}  # rule 14: try again with them, once (a fresh attempt: rule 8's look again)
            self.clock.after(self.mm, leader.live(lambda: self.close(lead)))
            return
        lead.closed = True
        joined = [p for p in lead.joiners if p.alive]
        ordered = tuple(sorted(members.values(), key=lambda m: m.peer_id))
        subgroups = split_into_subgroups(ordered, self.max_group) or (tuple(range(len(ordered))),)
        plan_s = solve_wall = 0.0
        reps: list[lp.PlanPeer] = []
        for sub in subgroups:
            plan_peers = [self._plan_peer(ordered[i]) for i in sub]
            t0 = time.perf_counter()
            plan = lp.choose(plan_peers, self.nbytes)
            solve_wall += time.perf_counter() - t0
            plan_s = max(plan_s, plan.predicted_s)
            reps.append(max(plan_peers, key=lambda p: (p.can_aggregate, p.upload)))
        if len(subgroups) > 1:  # the subgroups' representatives average their parts (hierarchical)
            t0 = time.perf_counter()
            plan_s += lp.choose(reps, self.nbytes).predicted_s
            solve_wall += time.perf_counter() - t0
        self.solve_s.append(solve_wall)
        # each joiner's answer carries the whole group (averaging/group.py): the leader's fan-in
        group = Group(os.urandom(16), lead.step, ordered, split_into_subgroups(ordered, self.max_group), "partitioned",
                      "float16", 60.0, os.urandom(KEY_BYTES))
        self.leader_bytes.append(_wire_bytes(group.to_wire()) * max(0, len(joined) - 1))
        stages = 2 * (2 if len(subgroups) > 1 else 1)
        seconds = solve_wall + plan_s + stages * self.dht.latency()
        step = lead.step
        for p in joined:
            self.matchmaking_s.append(self.clock.now + solve_wall - p.ready_at)
        self.group_sizes.append(len(members))
        self.dht.store(f"closed.{step}", lead.leader, frozenset(members), 64 + 40 * len(members),
                       3 * self.mm + 60)
        if len(members) == 1 and never:
            # rule 9: a lead of one that ready peers never joined looks again once the records have had
            # matchmaking_time / 4 to spread; a group of two or more that closed the step outranks it
            def look() -> None:
                def then(outranked: bool) -> None:
                    lead.withdrawn = outranked
                    if outranked:
                        self.withdrawn += 1
                        leader.missed(step)
                self.closed_for(step, lead.leader, leader.live(then))
            self.clock.after(self.mm / 4, leader.live(look))
        self.clock.after(seconds, lambda: None if lead.withdrawn else self.finish(lead, joined, seconds))

    def _plan_peer(self, m: Member) -> lp.PlanPeer:
        p = self.peers[m.peer_id]
        return lp.PlanPeer(m.peer_id, p.up, p.down, sends=m.weight > 0, can_aggregate=not m.client,
                           samples_per_second=p.speed)

    def finish(self, lead: Lead, joined: list[SimPeer], seconds: float) -> None:
        now = self.clock.now
        survivors = [p for p in joined if p.alive and p.frozen_until <= now]
        dead_aggs = sorted(p.id for p in joined if not p.client and p not in survivors)
        ids = sorted(p.id for p in joined if not p.client)
        chain = any(ids.index(a) + 1 < len(ids) and ids[ids.index(a) + 1] in dead_aggs for a in dead_aggs)
        if not survivors or chain:
            self.failed_rounds += 1  # every member keeps its state, drops its gradients, and takes the step again
            for p in survivors:
                p.samples = 0
                p.compute()
            return
        step = lead.step
        groups = self.taken.setdefault(step, [])
        members = tuple(sorted(p.id for p in survivors))
        if groups and not any(set(g) & set(members) for g in groups):
            big = [g for g in groups if len(g) >= 2]
            if len(members) >= 2 and big:
                self.forks += 1  # a second, disjoint group of two or more took the same step: a fork
            else:  # a group of one took it for itself alone (rule 13 lets it): outvoted, it resyncs
                self.lone_forks += 1
                lone = members if len(members) < 2 else next(g for g in groups if len(g) < 2)
                for pid in lone:
                    if (q := self.peers.get(pid)) is not None:
                        q.forked = f"step {step} was taken by a larger group"
        groups.append(members)
        self.batches.append(float(sum(m.weight for m in lead.members.values())))
        self.round_s.append(seconds)
        for p in survivors:
            p.step, p.samples = step + 1, 0
            p.last_members = members
            p.publish(busy=False)
            p.compute()

    # -- churn
    def add_peer(self, at: float) -> None:
        self._next_id += 1
        u, acc, kind = self.rng.random(), 0.0, MIX[-1][1]
        for share, k in MIX:
            acc += share
            if u < acc:
                kind = k
                break
        peer = SimPeer(self, f"Qm{self.rng.getrandbits(64):016x}{self._next_id:06d}", kind)
        self.peers[peer.id] = peer
        self.clock.at(at, peer.live(peer.start))
        self._schedule_churn(peer)

    def _schedule_churn(self, peer: SimPeer) -> None:
        a = self.args
        for rate, what in ((a.kill, self._kill), (a.leave, self._kill), (a.freeze, self._freeze)):
            if rate > 0:
                t = self.clock.now + self.rng.expovariate(rate / 3600)
                self.clock.at(t, (lambda w=what: w(peer)))

    def _kill(self, peer: SimPeer) -> None:
        if not peer.alive:
            return
        peer.alive = False
        peer.epoch += 1
        self.add_peer(self.clock.now + self.rng.uniform(10, 60))

    def _freeze(self, peer: SimPeer) -> None:
        if not peer.alive:
            return
        peer.epoch += 1
        seconds = self.rng.uniform(20, 40)
        peer.frozen_until = self.clock.now + seconds
        self.clock.after(seconds, peer.live(peer.compute))
        self.clock.after(self.rng.expovariate(self.args.freeze / 3600) + seconds,
                         lambda: self._freeze(peer))

    def _sample(self) -> None:
        self.records_alive.append(self.dht.alive())
        self.alive_samples.append(sum(p.alive for p in self.peers.values()))
        self.clock.after(30.0, self._sample)

    # -- the run
    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        for _ in range(self.n):
            self.add_peer(self.rng.uniform(0, 30))
        self._sample()
        horizon = self.args.hours * 3600
        self.clock.run(horizon)
        steps = max((p.step for p in self.peers.values() if p.alive), default=0)
        peer_steps = max(1, steps) * statistics.mean(self.alive_samples)
        progress = self.dht.keys.get("progress")
        return {
            "peers": self.n, "sim_hours": self.args.hours, "steps": steps,
            "steps_per_hour": round(steps / self.args.hours, 1),
            "lost_steps": self.forks, "skipped_steps": self.failed_rounds, "lone_forks": self.lone_forks,
            "matchmaking_p50_s": round(_percentile(self.matchmaking_s, 0.5), 2),
            "matchmaking_p95_s": round(_percentile(self.matchmaking_s, 0.95), 2),
            "group_sizes": {"p5": _percentile(self.group_sizes, 0.05), "p50": _percentile(self.group_sizes, 0.5),
                            "max": max(self.group_sizes, default=0)},
            "round_p50_s": round(_percentile(self.round_s, 0.5), 2),
            "batch_p50": _percentile(self.batches, 0.5),
            "dht_requests_per_peer_step": round(self.dht.requests / peer_steps, 1),
            "dht_bytes_per_peer_step": round(self.dht.bytes / peer_steps),
            "records_alive": max(self.records_alive, default=0),
            "leader_mbytes_per_step": round(_percentile(self.leader_bytes, 0.5) / 1e6, 2),
            "hot_key": {"key": "progress", "requests_per_s": round(progress.requests / horizon, 1),
                        "mbytes_per_s": round(progress.bytes / horizon / 1e6, 2)} if progress else None,
            "planner_solve_s": {"p50": round(_percentile(self.solve_s, 0.5), 4),
                                "max": round(max(self.solve_s, default=0.0), 4)},
            "decide_ms": round(1000 * statistics.mean(self.decide_s), 3) if self.decide_s else 0.0,
            "resyncs": self.resyncs, "replays": self.replays, "stepped_down": self.stepped_down, "withdrawn": self.withdrawn,
            "utilisation": round(self.sample_seconds / (horizon * statistics.mean(self.alive_samples)), 3),
            "wall_s": round(time.perf_counter() - t0, 1),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--hours", type=float, default=1.0, help="simulated hours per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=int, default=0,
                        help="target batch size (0: sahajBERT's 4096 per 40 peers, so each peer's share of a "
                             "step stays as it was: 4096 for up to 40 peers, 102,400 for 1,000)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--params", type=float, default=18e6, help="model parameters (ALBERT-large: 18M)")
    parser.add_argument("--bytes-per-param", type=int, default=2, help="on the wire (float16 compression)")
    parser.add_argument("--dht-ms", type=float, default=80.0, help="median DHT request latency")
    parser.add_argument("--dht-loss", type=float, default=0.02, help="fraction of DHT requests lost")
    parser.add_argument("--kill", type=float, default=0.5, help="kills per peer and hour")
    parser.add_argument("--leave", type=float, default=0.5, help="departures per peer and hour")
    parser.add_argument("--freeze", type=float, default=1.0, help="20-40 s freezes per peer and hour")
    parser.add_argument("--fixed-poll", action="store_true",
                        help="gathering peers and leaders read the ready records every 0.05 s whatever their "
                             "number (the matchmaker before match_rules.poll_period), for comparison")
    parser.add_argument("--replay", type=int, default=0,
                        help="a peer at most this many steps behind downloads the averaged gradients of the steps "
                             "it lacks instead of the state (a proposed design, docs/scaling.md; 0: as built)")
    args = parser.parse_args(argv)
    for n in args.peers:
        run = argparse.Namespace(**{**vars(args), "target": args.target or 4096 * max(1, math.ceil(n / 40))})
        print(json.dumps({**Simulation(run, n, args.seed).run(), "target": run.target}), flush=True)


if __name__ == "__main__":
    main()
