"""Typed, expiring DHT records: per-peer progress, and the collaboration view built from them.

Records are validated on read: a malformed or hostile record is skipped (logged at DEBUG),
never raised into the training loop.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from dedloc.framing import framed

logger = logging.getLogger(__name__)


MAX_NAME = 32
"""Characters of a peer's display name (``PeerConfig.name``) at most."""
MAX_RUN_HASH = 64
"""Characters of a published ``run_hash`` at most."""
MAX_WEIGHT = float(1 << 40)
"""No weight (samples toward one step) above 2^40 is accepted anywhere (averaging/bounds.py)."""


def short_id(peer_id: str) -> str:
    """How a peer id is shown to people: its last 8 characters (every libp2p Ed25519 id begins with the
    same ``12D3KooW``). The dashboard's page cuts them the same way."""
    return peer_id[-8:]


def name_ok(name: object) -> bool:
    """Whether ``name`` may be a peer's display name: printable (no terminal escapes, no newlines),
    without spaces at either end, at most ``MAX_NAME`` characters."""
    return isinstance(name, str) and len(name) <= MAX_NAME and name.isprintable() and name == name.strip()


def label(peer_id: str, name: str = "") -> str:
    """How a peer is shown to people: its name beside its short id, or the short id alone. (A name is
    what a peer says of itself: two may share one, so the id stays beside it.)"""
    return f"{name} ({short_id(peer_id)})" if name else short_id(peer_id)


def weight_ok(weight: float) -> bool:
    return math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT


def parse_fingerprint(fingerprint: str) -> tuple[int, str] | None:
    """``(applied step, hash)`` of a published ``"<step>:<hash>"`` fingerprint; None if malformed."""
    step, sep, digest = fingerprint.partition(":")
    if not sep or not digest or not step.isdigit():
        return None
    return int(step), digest


class Role(str, enum.Enum):
    TRAINER = "trainer"
    AGGREGATOR = "aggregator"  # aggregates, trains nothing (weight 0)
    CLIENT = "client"  # trains, accepts no inbound connections, never aggregates
    BACKBONE = "backbone"  # keeps the DHT alive, holds checkpoints, serves state; trains nothing

    @property
    def trains(self) -> bool:
        return self in _TRAINS

    @property
    def serves(self) -> bool:
        """Whether peers can download this peer's state: clients accept no streams; aggregator-only
        peers hold none."""
        return self in (Role.TRAINER, Role.BACKBONE)


_TRAINS = frozenset({Role.TRAINER, Role.CLIENT})


@dataclass(frozen=True)
class ProgressRecord:
    """What one peer publishes about itself, with an expiry."""

    peer_id: str
    step: int
    samples: int
    """Samples accumulated toward the current step."""
    samples_per_second: float
    role: Role
    bandwidth: float = 0.0
    """Estimated bytes/s this peer can move (min of upload and download), 0 if unknown."""
    time: float = 0.0
    busy_until: float = 0.0
    """When this peer expects to finish the micro-batch it is computing (0: idle)."""
    fingerprint: str = ""
    """``"<applied step>:<hash of parameters>"``; peers at the same applied step must agree."""
    loss: float = 0.0
    """This peer's mean training loss over ``loss_samples`` samples of global step ``loss_step``
    (its last finished step; ``loss_samples`` 0: none yet). The monitor pools these per step."""
    loss_step: int = -1
    loss_samples: int = 0
    resyncs: int = 0
    """State downloads this peer made to rejoin (its optimizer's count since it started)."""
    catchups: int = 0
    syncing: bool = False
    """Downloading the collaboration's state (a resync): it accumulates nothing and joins no round
    until it holds that state, whatever ``step`` says."""
    run_hash: str = ""
    """A hash of the settings every peer of the run must share (``OptimizerConfig.run_hash``; empty:
    none given)."""
    name: str = ""
    """The peer's display name (``PeerConfig.name``; empty: none), added by its service as it publishes."""

    @property
    def applied_step(self) -> int | None:
        """The step of the parameters this peer holds (from its fingerprint; None if it publishes none)."""
        parsed = parse_fingerprint(self.fingerprint)
        return None if parsed is None else parsed[0]

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("peer_id")
        d["role"] = self.role.value
        return d

    @classmethod
    def from_wire(cls, peer_id: str, obj: Any) -> "ProgressRecord | None":
        try:
            rec = cls(peer_id=peer_id, step=int(obj["step"]), samples=int(obj["samples"]),
                      samples_per_second=float(obj["samples_per_second"]), role=Role(obj["role"]),
                      bandwidth=float(obj.get("bandwidth", 0.0)), time=float(obj.get("time", 0.0)),
                      busy_until=float(obj.get("busy_until", 0.0)), fingerprint=str(obj.get("fingerprint", "")),
                      loss=float(obj.get("loss", 0.0)), loss_step=int(obj.get("loss_step", -1)),
                      loss_samples=int(obj.get("loss_samples", 0)), resyncs=int(obj.get("resyncs", 0)),
                      catchups=int(obj.get("catchups", 0)), syncing=obj.get("syncing", False) is True,
                      run_hash=obj.get("run_hash", ""), name=obj.get("name", ""))
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.debug(f"ignoring malformed progress record from {peer_id}")
            return None
        numbers = (rec.samples_per_second, rec.bandwidth, rec.time, rec.busy_until, rec.loss)
        if rec.step < 0 or rec.samples < 0 or rec.loss_samples < 0 or rec.loss_step < -1 or rec.resyncs < 0 \
                or rec.catchups < 0 or not isinstance(rec.run_hash, str) or len(rec.run_hash) > MAX_RUN_HASH \
                or not rec.run_hash.isprintable() \
                or not name_ok(rec.name) \
                or not all(math.isfinite(x) and x >= 0 for x in numbers):
            logger.debug(f"ignoring out-of-range progress record from {peer_id}")
            return None
        return rec


ATTEST = 2
"""Peers that must vouch for a step before the collaboration is at it (fewer if fewer are alive):
no single member's claim moves the run (docs/security.md, "What a member can do")."""
HISTORY = 64
"""Steps of history a state carries (state/lineage.py), and steps past its checkpoint a backbone
vouches for."""


@dataclass(frozen=True)
class CollaborationView:
    """One consistent reading of all live progress records."""

    peers: tuple[ProgressRecord, ...]
    now: float

    @classmethod
    def build(cls, records: Iterable[ProgressRecord], now: float | None = None) -> "CollaborationView":
        return cls(tuple(sorted(records, key=lambda r: r.peer_id)), time.time() if now is None else now)

    @functools.cached_property
    def global_step(self) -> int:
        """The newest step the collaboration *attests*: the newest step that ``ATTEST`` attesters
        (all of them, if fewer) vouch for and a trainer can hand on, or that a backbone holds. A
        training peer vouches for the steps up to its own; a backbone for the ``HISTORY`` steps past
        its checkpoint that fewer than ``ATTEST`` trainers are behind (it pulls well before the run
        gets that far: a lone trainer stays the run, and so does one ahead of a single other).
        One member's record is its own claim: a member publishing step +1000 alone moves nothing,
        beside other trainers or beside a backbone (in an invite-only run the backbone role is
        itself checked against the member's invitation before its record gets here, service.py).

        Reachable trainers serve their state; a client-mode peer cannot (it accepts no streams). So
        while a trainer is alive, a step that only clients reached (e.g. one that moved on alone
        after a round failed for it) is not the run's: counting it sent every resync chasing a step
        no donor held. With no trainer alive, the clients are the collaboration. Aggregator-only
        peers hold no state and never count; peers downloading a state (``syncing``) count only
        when the settled ones attest no step (a trainer among them still bounds it: it serves the
        state it holds)."""
        backbones = [r.step for r in self.peers if r.role == Role.BACKBONE]
        holders = [r for r in self.peers if r.role.trains]
        # a resyncing trainer still serves the state it holds: with only clients settled past it, they
        # are not the run (a CI test: the client alone made the step the lone trainer's resync chased)
        servable = max((r.step for r in holders if r.role == Role.TRAINER), default=None)

        def attested(pool: list[ProgressRecord]) -> int | None:
            steps = sorted((r.step for r in pool), reverse=True)
            quorum = min(ATTEST, len(steps) + len(backbones))
            for reached, step in enumerate(steps, start=1):  # ``reached`` holders are at ``step`` or past it
                if servable is not None and step > servable:
                    continue
                # a backbone vouches for a step only while fewer than ATTEST trainers are behind it: beside
                # three honest trainers, a member publishing steps ahead of them was attested by the
                # backbone alone (up to its checkpoint + HISTORY), and the run's step ran away from every
                # state the others held
                vouch = sum(step < b + HISTORY for b in backbones) if len(steps) - reached < ATTEST else 0
                if reached + vouch >= quorum:
                    return max([step, *backbones])
            return None

        settled = [r for r in holders if not r.syncing]
        for pool in (settled, holders):  # resyncing peers count when the settled ones attest nothing
            if (step := attested(pool)) is not None:
                return step
        return max(backbones, default=0)

    @property
    def current(self) -> tuple[ProgressRecord, ...]:
        """Peers at the global step (the ones whose samples count toward it)."""
        return tuple(r for r in self.peers if r.step == self.global_step)

    @property
    def samples(self) -> int:
        return sum(r.samples for r in self.current)

    def without(self, peers: set[str] | frozenset[str]) -> "CollaborationView":
        """This view less the records of ``peers``."""
        return CollaborationView(tuple(r for r in self.peers if r.peer_id not in peers), self.now) if peers else self

    def settings_mismatch(self, me: str, mine: str) -> tuple[str, tuple[str, ...]] | None:
        """The run's settings hash and the peers publishing it, when it is not ``mine`` (None: it is,
        or no other training peer publishes one). The run's hash is the one most other training peers
        publish; ``mine`` is the run's only while more of them publish it than any other hash (a tie
        goes against ``me``, the peer asking as it joins: the run was there first)."""
        counts: dict[str, list[str]] = {}
        for r in self.peers:
            if r.peer_id != me and r.role in _TRAINS and r.run_hash:
                counts.setdefault(r.run_hash, []).append(r.peer_id)
        if not counts:
            return None
        ours = len(counts.get(mine, ()))
        theirs = max((h for h in counts if h != mine), key=lambda h: (len(counts[h]), h), default=None)
        if theirs is None or ours > len(counts[theirs]):
            return None
        return theirs, tuple(counts[theirs])

    def trainers_at(self, step: int) -> tuple[ProgressRecord, ...]:
        """Training peers (trainers and clients) accumulating for ``step``: not those resyncing, which
        may publish ``step`` for minutes while they wait for a later state. (Computed once per view
        and step: every rule at a step boundary asks, and a view can hold a thousand records.)"""
        memo = self.__dict__.setdefault("_trainers_at", {})
        if step not in memo:
            memo[step] = tuple(r for r in self.peers if r.step == step and r.role in _TRAINS and not r.syncing)
        return memo[step]

    def expected_at(self, step: int, me: str, last_round: tuple[str, ...] = ()) -> int:
        """How many training peers a round of ``step`` waits for: this one, those accumulating for
        ``step``, and the members of the round of ``step - 1`` (``last_round``) that still train, though
        their records may not show ``step`` yet (a client that finished that round with the others
        published its new record after the leader of the next one read the view: the leader closed
        without it, and it had to resync). A member that left has no record; one that died keeps its
        record, and its absence costs the gather window, as a stale record at ``step`` does."""
        ids = {me} | {r.peer_id for r in self.trainers_at(step)}
        last = set(last_round)
        ids |= {r.peer_id for r in self.peers if r.peer_id in last and r.role.trains and not r.syncing and r.step <= step}
        return len(ids)

    @property
    def aggregators(self) -> tuple[ProgressRecord, ...]:
        """Aggregator-only peers alive now (they join every round without contributing)."""
        return tuple(r for r in self.peers if r.role == Role.AGGREGATOR)

    def samples_at(self, step: int) -> int:
        memo = self.__dict__.setdefault("_samples_at", {})
        if step not in memo:
            memo[step] = sum(r.samples for r in self.trainers_at(step))
        return memo[step]

    def took(self, step: int, exclude: str = "") -> bool:
        """Whether most training peers (less ``exclude``, and those resyncing) whose fingerprint
        counts (``votes``) already hold the parameters after ``step``'s update: the collaboration
        took ``step``, and a round for it now could only be a group of latecomers (a fork). A lone
        peer ahead (e.g. a forked one, before it steps back) is not the collaboration."""
        applied = [a > step for peer_id, a in self._voters if peer_id != exclude]
        return 2 * sum(applied) > len(applied)

    @functools.cached_property
    def _voters(self) -> tuple[tuple[str, int], ...]:
        """(peer id, applied step) of the training peers, not resyncing, whose fingerprint counts
        (``votes``): ``took``'s electorate, once per view."""
        return tuple((r.peer_id, a) for r in self.peers if r.role.trains and not r.syncing
                     and (a := r.applied_step) is not None and self.votes(r))

    @functools.cached_property
    def newest_backbone_step(self) -> int | None:
        """The newest step a live backbone holds (None: no backbone)."""
        return max((r.step for r in self.peers if r.role == Role.BACKBONE), default=None)

    def votes(self, record: ProgressRecord) -> bool:
        """Whether ``record``'s fingerprint counts as a vote on the collaboration's history (rule 10,
        the fingerprint majority, the lineage votes). A client's counts only while a trainer (not
        resyncing) publishes the same one, or no trainer is alive (the clients are then the
        collaboration): a state that only clients hold can be downloaded from nobody. Counted, a
        client's copy of a step whose trainer left at once would make that step taken for the other
        trainers, which could neither take it again nor download it, while the client waits for a
        trainer to reach its step: neither would move again.

        Nor does a fingerprint past the step the run attests (``global_step``, plus the one a round
        that just ended may be ahead): a member publishing step +1000 made every step before it
        "taken" (``took``) for a lone honest trainer, which then waited for a state nobody could
        serve."""
        if (applied := record.applied_step) is not None and applied > self.global_step + 1:
            return False
        if record.role != Role.CLIENT or not record.fingerprint:
            return bool(record.fingerprint)
        settled = self._settled_trainer_fingerprints
        return settled is None or record.fingerprint in settled

    @functools.cached_property
    def _settled_trainer_fingerprints(self) -> frozenset[str] | None:
        """The fingerprints the trainers not resyncing publish; None while no trainer is alive.
        (Once per view: ``took`` asks ``votes`` of every record, which made it quadratic in the
        peers, 58 ms per call at 1,000 of them: bench/simulate.py.)"""
        trainers = [r for r in self.peers if r.role == Role.TRAINER]
        return frozenset(r.fingerprint for r in trainers if not r.syncing) if trainers else None

    def consensus_fingerprint(self, applied_step: int) -> str | None:
        """The parameter fingerprint most peers at ``applied_step`` report, of those that count
        (``votes``; ties: the smallest peer id's)."""
        prefix = f"{applied_step}:"
        votes: dict[str, list[str]] = {}
        for r in self.peers:
            if r.fingerprint.startswith(prefix) and self.votes(r):
                votes.setdefault(r.fingerprint, []).append(r.peer_id)
        if not votes:
            return None
        return min(votes, key=lambda fp: (-len(votes[fp]), min(votes[fp])))

    @property
    def samples_per_second(self) -> float:
        return sum(r.samples_per_second for r in self.current if r.role.trains)

    def eta(self, target_batch_size: int) -> float:
        """Seconds until the collaboration reaches the target, extrapolating from each record's time."""
        done = sum(r.samples + r.samples_per_second * max(0.0, self.now - r.time) for r in self.current)
        left = max(0.0, target_batch_size - done)
        sps = self.samples_per_second
        return 0.0 if left == 0 else (left / sps if sps > 0 else math.inf)

    def by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.peers:
            out[r.role.value] = out.get(r.role.value, 0) + 1
        return out


MAX_PAIRS = 64
MAX_DIRECT = 256


@dataclass(frozen=True)
class CapabilityRecord:
    """What one peer measured about its own links and compute, published with an expiry.

    Rates are bytes/s; 0 means unknown. ``pairs`` maps a peer id to the rate measured from this
    peer to that one (a lower bound of the path's capacity). The planner reads these.
    """

    peer_id: str
    upload: float = 0.0
    download: float = 0.0
    pairs: dict[str, float] | None = None
    client: bool = False
    """Accepts no inbound connections (client mode): can never aggregate."""
    private: bool = False
    """Behind NAT (or in client mode): it aggregates only for members listed in ``direct``."""
    direct: tuple[str, ...] = ()
    """A private peer's peers with a direct (not relayed, e.g. punched) connection to it."""
    aggregator_only: bool = False
    samples_per_second: float = 0.0
    time: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {"u": self.upload, "d": self.download, "p": dict(self.pairs or {}), "c": self.client,
                "r": self.private, "x": list(self.direct), "a": self.aggregator_only, "sps": self.samples_per_second, "t": self.time}

    @classmethod
    def from_wire(cls, peer_id: str, obj: Any) -> "CapabilityRecord | None":
        try:
            pairs = {str(k): float(v) for k, v in dict(obj.get("p", {})).items()}
            direct = obj.get("x", [])
            if not isinstance(direct, list) or len(direct) > MAX_DIRECT or not all(isinstance(d, str) for d in direct):
                raise ValueError(f"direct peers must be a list of at most {MAX_DIRECT} peer ids")
            rec = cls(peer_id=peer_id, upload=float(obj["u"]), download=float(obj["d"]), pairs=pairs,
                      client=bool(obj.get("c", False)), private=bool(obj.get("r", False)), direct=tuple(direct),
                      aggregator_only=bool(obj.get("a", False)), samples_per_second=float(obj.get("sps", 0.0)),
                      time=float(obj.get("t", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.debug(f"ignoring malformed capability record from {peer_id}")
            return None
        numbers = (rec.upload, rec.download, rec.samples_per_second, rec.time, *pairs.values())
        if len(pairs) > MAX_PAIRS or not all(math.isfinite(x) and x >= 0 for x in numbers):
            logger.debug(f"ignoring out-of-range capability record from {peer_id}")
            return None
        return rec


MAX_MEMBERS = 4096
MAX_NUMEL = 1 << 34
MAX_ENDPOINT = 200


@dataclass(frozen=True)
class Member:
    peer_id: str
    """Base58 libp2p peer id."""
    weight: float
    """Samples behind this member's contribution; 0 for an aggregator-only peer."""
    share: float
    """Relative share of the vector this member aggregates; 0 for client-mode peers."""
    client: bool = False
    fetch: bool = True
    """Needs the averaged result (False for an aggregator-only peer)."""
    private: bool = False
    """Behind NAT (found by dial-back): never leads, represents a subgroup or sits where a ring
    neighbour must dial it; aggregates only where the leader's planner saw it publish a direct
    (punched) path to every other member."""
    data: str = ""
    """Where it accepts direct TCP connections for round streams, ``host:port/<certificate
    fingerprint>`` (net/tcp.py; empty: libp2p streams only)."""

    @property
    def reachable(self) -> bool:
        """Every member can open a stream to it (not in client mode, not behind NAT)."""
        return not self.client and not self.private


@dataclass(frozen=True)
class ReadyRecord:
    """A peer ready to average a step (``{run}.ready.{step}``): the member it would be, and the
    vector's size. A join request carries the same fields (without the size)."""

    member: Member
    numel: int = 0
    """The vector's size (0: not given)."""

    def to_wire(self) -> dict[str, Any]:
        m = self.member
        return {"w": m.weight, "s": m.share, "c": m.client, "f": m.fetch, "p": m.private, "n": self.numel,
                **({"d": m.data} if m.data else {})}

    @classmethod
    def from_wire(cls, peer_id: str, obj: Any) -> "ReadyRecord | None":
        """The record, with a client's share as 0; None (logged at DEBUG) if malformed or out of range."""
        try:
            w, s, c = float(obj["w"]), float(obj["s"]), bool(obj["c"])
            f, p = bool(obj.get("f", True)), bool(obj.get("p", False))
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.debug(f"ignoring malformed ready record of {peer_id}")
            return None
        if not (weight_ok(w) and math.isfinite(s) and s >= 0) or (not f and (w > 0 or c or p)):
            logger.debug(f"ignoring out-of-range ready record of {peer_id}")  # an aggregator-only peer
            return None  # contributes nothing and must be reachable
        n = obj.get("n", 0)
        d = obj.get("d", "")
        if not isinstance(d, str) or len(d) > MAX_ENDPOINT:
            d = ""  # a malformed endpoint: this member is reached over libp2p only
        return cls(Member(peer_id, w, 0.0 if c else s, c, f, p, d),
                   n if isinstance(n, int) and 0 < n <= MAX_NUMEL else 0)


def join_statement(run_id: str, step: int, leader: str, member: str, incarnation: str, contributes: bool) -> bytes:
    """What a member signs when it joins ``leader``'s group for ``step`` (its join request carries the
    signature, and the leader's ``closed`` record lists it): the proof that this process of it
    (``incarnation``: a restart under the same identity is another) joined that group, contributing
    samples (``contributes``: weight > 0) or not (an aggregator-only peer joins any group)."""
    return framed(b"dedloc-join-v1", run_id, str(step), leader, member, incarnation, b"1" if contributes else b"0")


@functools.lru_cache(maxsize=4096)
def join_signed(run_id: str, step: int, leader: str, member: str, incarnation: str, contributes: bool,
                signature: bytes) -> bool:
    """Whether ``signature`` is ``member``'s over its join of ``leader``'s group for ``step`` (its
    Ed25519 key is inside its peer id). Remembers the 4096 most recent answers: every read of a step's
    ``closed`` records checks the same few."""
    from dedloc.auth.identity import public_key_of  # (the identity module pulls in hivemind)

    try:
        public_key_of(member).verify(signature, join_statement(run_id, step, leader, member, incarnation, contributes))
        return True
    except Exception:
        return False


MAX_SIGNATURE = 64
"""Bytes of an Ed25519 signature."""
MAX_INCARNATION = 32


@dataclass(frozen=True)
class JoinProof:
    """A member's proof that it joined a leader's group for a step (``join_statement``)."""

    incarnation: str
    signature: bytes
    contributes: bool = True

    def holds(self, run_id: str, step: int, leader: str, member: str) -> bool:
        return join_signed(run_id, step, leader, member, self.incarnation, self.contributes, self.signature)

    def to_wire(self) -> list:
        return [self.incarnation, self.signature, self.contributes]

    @classmethod
    def from_wire(cls, obj: Any) -> "JoinProof | None":
        if isinstance(obj, (list, tuple)) and len(obj) == 3 and isinstance(obj[0], str) \
                and len(obj[0]) <= MAX_INCARNATION and isinstance(obj[1], bytes) and len(obj[1]) == MAX_SIGNATURE \
                and isinstance(obj[2], bool):
            return cls(obj[0], obj[1], obj[2])
        return None


@dataclass(frozen=True)
class ClosedRecord:
    """The group a leader closed for a step (``{run}.closed.{step}``, under the leader's subkey), or
    its withdrawal (``members`` None: the leader's round failed, which closes nothing)."""

    leader: str
    members: tuple[str, ...] | None
    until: float | None = None
    """The round's deadline (wall clock, the leader's): once past, the record closes the step only
    if a member holds the step's update (averaging/matchmaking.py, rule 11). None: no deadline."""
    proofs: tuple[tuple[str, JoinProof], ...] = ()
    """``(member, its proof of joining)`` for the members other than the leader (``join_statement``);
    a member listed without a valid one did not join as far as a reader can tell."""
    leader_contributes: bool = True
    """Whether the leader brought samples (False: an aggregator-only leader, whose group of one
    trainer is a group of one contributor). Absent on the wire: True."""

    def to_wire(self) -> Any:
        if self.members is None:
            return {"failed": True}
        out: dict[str, Any] = {"members": list(self.members)}
        if self.until is not None:
            out["until"] = self.until
        if self.proofs:
            out["sigs"] = {m: p.to_wire() for m, p in self.proofs}
        if not self.leader_contributes:
            out["c"] = False
        return out

    def proof(self, run_id: str, step: int, member: str) -> JoinProof | None:
        """``member``'s valid proof of joining this group (None: it did not provably join)."""
        p = dict(self.proofs).get(member)
        return p if p is not None and member in (self.members or ()) and p.holds(run_id, step, self.leader, member) \
            else None

    def signed(self, run_id: str, step: int) -> frozenset[str]:
        """The members that provably joined: the leader (the record is its own, signed as a DHT record)
        and every member whose join proof verifies. A member cannot be listed into a group by anyone
        else: a member's record naming honest peers it never led counts as a group of one."""
        listed = set(self.members or ())
        return frozenset([self.leader, *(m for m, p in self.proofs if m in listed and p.holds(run_id, step, self.leader, m))])

    def contributors(self, run_id: str, step: int) -> int:
        """How many of ``signed`` contributed samples (the leader by its own word: the record is its
        own). A group of one trainer and aggregator-only peers is a group of one here, whoever leads it."""
        proven = self.signed(run_id, step)
        return int(self.leader_contributes) + sum(1 for m, p in self.proofs
                                                  if m in proven and m != self.leader and p.contributes)

    @classmethod
    def from_wire(cls, leader: str, obj: Any) -> "ClosedRecord | None":
        if isinstance(obj, dict) and obj.get("failed") is True:
            return cls(leader, None)
        until, proofs, contributes = None, (), True
        if isinstance(obj, dict):
            contributes = obj.get("c", True) is not False
            if isinstance(obj.get("until"), (int, float)) and not isinstance(obj["until"], bool) \
                    and math.isfinite(obj["until"]):
                until = float(obj["until"])
            raw = obj.get("sigs", {})
            if isinstance(raw, dict) and len(raw) <= MAX_MEMBERS:
                proofs = tuple(sorted(((m, p) for m, v in raw.items()
                                       if isinstance(m, str) and (p := JoinProof.from_wire(v)) is not None),
                                      key=lambda mp: mp[0]))
            obj = obj.get("members")
        if isinstance(obj, list) and len(obj) <= MAX_MEMBERS and all(isinstance(m, str) for m in obj) \
                and leader in obj:
            return cls(leader, tuple(obj), until, proofs, contributes)
        # (a leader is a member of the group it closes: a member's record closing an empty group made
        # every peer miss the step)
        logger.debug(f"ignoring malformed closed record of {leader}")
        return None


MAX_REPORTED_ROUNDS = 4


@dataclass(frozen=True)
class RoundReport:
    """What one member says of one averaging round it finished (``{run}.rounds``, under its own
    subkey, its last ``MAX_REPORTED_ROUNDS`` rounds), for the monitor's plan and recent rounds."""

    reporter: str
    round_id: str
    """Hex; members of one round report the same id."""
    step: int
    peers: tuple[str, ...]
    shares: tuple[float, ...]
    strategy: str
    seconds: float
    """This member's all-reduce time (from its group's start to having its result)."""
    matchmaking_s: float
    failovers: int
    predicted_s: float = 0.0
    """The all-reduce time its leader's plan predicted (only when this member made the plan; 0: not known)."""
    time: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {"r": self.round_id, "s": self.step, "p": list(self.peers), "h": list(self.shares),
                "g": self.strategy, "d": self.seconds, "m": self.matchmaking_s, "f": self.failovers,
                "e": self.predicted_s, "t": self.time}

    @classmethod
    def from_wire(cls, reporter: str, obj: Any) -> "RoundReport | None":
        try:
            peers, shares = obj["p"], obj["h"]
            if not (isinstance(peers, list) and isinstance(shares, list) and len(peers) == len(shares) <= MAX_MEMBERS
                    and all(isinstance(p, str) for p in peers)):
                raise ValueError("malformed member lists")
            rec = cls(reporter, str(obj["r"])[:64], int(obj["s"]), tuple(peers), tuple(float(x) for x in shares),
                      str(obj["g"])[:32], float(obj["d"]), float(obj["m"]), int(obj["f"]), float(obj.get("e", 0.0)),
                      float(obj.get("t", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.debug(f"ignoring malformed round report from {reporter}")
            return None
        numbers = (rec.seconds, rec.matchmaking_s, rec.predicted_s, rec.time, *rec.shares)
        if rec.step < 0 or rec.failovers < 0 or not all(math.isfinite(x) and x >= 0 for x in numbers):
            logger.debug(f"ignoring out-of-range round report from {reporter}")
            return None
        return rec

    @classmethod
    def list_from_wire(cls, reporter: str, obj: Any) -> list["RoundReport"]:
        """The reports in one member's record (malformed ones skipped)."""
        if not isinstance(obj, list):
            return []
        return [r for o in obj[:MAX_REPORTED_ROUNDS] if (r := cls.from_wire(reporter, o)) is not None]


@dataclass(frozen=True)
class CreditRecord:
    """What one aggregator credited each contributor with since it started (``{run}.credits``,
    under its own subkey): for every round, each contributor it reduced into its part gets that
    part's fraction of the vector times the weight (samples) it was reduced with, and the same
    fraction of a round. Over a round's aggregators the fractions add up to 1, so a contributor's
    credits add up to its samples and its rounds. ``incarnation``: a random id per start of the
    aggregator, whose totals restart from 0 (the ledger keeps each incarnation's last totals)."""

    aggregator: str
    incarnation: str
    totals: dict[str, tuple[float, float, int]]
    """Contributor -> (samples, rounds, last step)."""

    def to_wire(self) -> dict[str, Any]:
        return {"i": self.incarnation, "c": {p: list(v) for p, v in self.totals.items()}}

    @classmethod
    def from_wire(cls, aggregator: str, obj: Any) -> "CreditRecord | None":
        try:
            totals = {str(p): (float(s), float(r), int(last)) for p, (s, r, last) in dict(obj["c"]).items()}
            rec = cls(aggregator, str(obj["i"])[:32], totals)
        except (KeyError, TypeError, ValueError, AttributeError):
            logger.debug(f"ignoring malformed credit record from {aggregator}")
            return None
        if len(totals) > MAX_MEMBERS or not all(weight_ok(s) and weight_ok(r) and last >= 0
                                                for s, r, last in totals.values()):
            logger.debug(f"ignoring out-of-range credit record from {aggregator}")
            return None
        return rec


MAX_LEDGER_ROWS = 200
MAX_CHECKPOINTS = 100


@dataclass(frozen=True)
class LedgerRecord:
    """A backbone's contribution ledger as monitors show it (``{run}.ledger``, under its subkey):
    its top ``MAX_LEDGER_ROWS`` rows, most samples first, and the checkpoint steps it holds."""

    backbone: str
    rows: tuple[dict[str, Any], ...]
    """``{peer, name, samples, rounds, last_step}`` (monitor/ledger.py ``Ledger.table``)."""
    checkpoints: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"table": [dict(r) for r in self.rows[:MAX_LEDGER_ROWS]],
                "checkpoints": list(self.checkpoints[:MAX_CHECKPOINTS])}

    @classmethod
    def from_wire(cls, backbone: str, obj: Any) -> "LedgerRecord | None":
        try:
            table, steps = obj["table"], obj["checkpoints"]
            if not (isinstance(table, list) and isinstance(steps, list) and len(table) <= MAX_LEDGER_ROWS
                    and len(steps) <= MAX_CHECKPOINTS):
                raise ValueError("malformed lists")
            rows = tuple({"peer": str(r["peer"])[:128], "name": r.get("name", "") if name_ok(r.get("name", "")) else "",
                          "samples": round(float(r["samples"])),
                          "rounds": round(float(r["rounds"]), 1), "last_step": int(r["last_step"])} for r in table)
            rec = cls(backbone, rows, tuple(int(x) for x in steps))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            logger.debug(f"ignoring malformed ledger record from {backbone}")
            return None
        if not all(weight_ok(r["samples"]) and weight_ok(r["rounds"]) and r["last_step"] >= -1 for r in rows) \
                or not all(x >= 0 for x in rec.checkpoints):
            logger.debug(f"ignoring out-of-range ledger record from {backbone}")
            return None
        return rec
