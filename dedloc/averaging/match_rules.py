"""Who leads a step, and whose group closes it: matchmaking's rules as pure functions of what a
peer knows (the step's ready and closed records, the joins it holds).

The matchmaker (averaging/matchmaking.py) gathers these facts from the DHT and its join streams
and acts on the answers; the rules make no call, so each is tested on made-up records in
milliseconds (tests/test_units.py). The rule numbers are docs/averaging.md's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dedloc.records import ClosedRecord, CollaborationView, Member


@dataclass(frozen=True)
class Asker:
    """The peer a rule decides for."""

    run_id: str
    peer_id: str
    incarnation: str
    """This process of the peer (a restart under the same identity is another)."""
    client: bool


POLL = 0.05
"""Seconds between two reads of a step's ready records while few peers are ready."""
POLL_FLAT = 8
"""Up to this many ready peers, every read waits POLL (the cadence a small run has always had)."""


def poll_period(ready: int, matchmaking_time: float) -> float:
    """Seconds between two reads of a step's ready records, by a gathering peer and by a leader
    before it closes, when ``ready`` peers are ready. Each read returns every ready record, so N
    peers reading every p seconds move N * N / p records: at a fixed 0.05 s, 1,000 peers would ask
    one key for 20 million records a second (bench/simulate.py). The period grows with N beyond
    ``POLL_FLAT`` peers (N / p stays at 160 reads a second of the whole set), up to a quarter of
    ``matchmaking_time``, so a leader still sees a smaller ready peer, and a gatherer the expected
    ones, well within its window."""
    return min(max(POLL, POLL * ready / POLL_FLAT), max(POLL, matchmaking_time / 4))


def leaders(ready: dict[str, Member], passed_over: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Rule 3: who may lead, in order: the ready peers that accept connections (neither in client
    mode nor behind NAT), smallest id first, less those passed over (rule 4)."""
    return sorted(p for p, m in ready.items() if m.reachable and p not in passed_over)


def partners(me: Asker, step: int, record: ClosedRecord, ready: dict[str, Member]) -> set[str]:
    """Ready peers outside ``record``'s proven group that contribute, with which ``me`` could take
    ``step`` (one of them, or ``me``, able to hand the step on: not a client)."""
    out = {p for p, m in ready.items() if m.weight > 0} - record.signed(me.run_id, step) - {me.peer_id}
    if me.client and all(ready[p].client for p in out):
        return set()  # clients only: they could take the step for themselves alone (rule 4)
    return out


def closes_for(me: Asker, step: int, record: ClosedRecord, ready: dict[str, Member] | None) -> tuple[str | None, set[str]]:
    """Why ``record`` closes ``step`` for ``me`` (None: it does not), and, when a group of one does
    not close it, the peers ``me`` takes it with instead.

    Rule 13: a group closes the step for the peers it left out only if two or more contributing
    members provably joined it (their signed join proofs); a group of one contributor closes it only
    for a peer that, having gathered the ready peers (``ready``; None: not yet, so not yet), sees
    none it could take the step with (``partners``). Otherwise one member storing a record of a
    group of one (itself) for each step, and serving that step's update applied, would make every
    honest peer miss the step and download its parameters. A record listing ``me`` closes nothing
    for it, unless it holds the proof of another process of ``me`` (a restart: that process's
    group is not this one's)."""
    if me.peer_id in record.members:  # (listed without this peer's proof: the leader's word, harmless here)
        mine = record.proof(me.run_id, step, me.peer_id)
        if mine is not None and mine.incarnation != me.incarnation:
            return f"the round led by {record.leader} closed with an earlier process of this peer", set()
        return None, set()
    if record.contributors(me.run_id, step) >= 2:
        return f"the round led by {record.leader} closed without this peer", set()
    if ready is None:
        return None, set()
    if found := partners(me, step, record, ready):
        return None, found
    return (f"the round led by {record.leader} closed without this peer (a group of one, and no other peer is at "
            f"the step)"), set()


def outranked_by(me: Asker, step: int, closed: dict[str, ClosedRecord]) -> str | None:
    """Rule 9, for a lead of one that ready peers never joined, just closed: the leader of another
    group that closed ``step`` at the same moment and ranks higher (None: none does). A group of two
    or more provable contributors outranks a group of one; between two of one, the smaller leader id."""
    return next((leader for leader, r in sorted(closed.items()) if me.peer_id not in r.members
                 and (r.contributors(me.run_id, step) > 1 or leader < me.peer_id)), None)


def never_joined(ready: dict[str, Member], members: dict[str, Member], passed_over: set[str]) -> set[str]:
    """Contributing ready peers that did not join this lead (less those it passed over)."""
    return {p for p, m in ready.items() if m.weight > 0 and p not in members and p not in passed_over}


def trainers_outside(view: CollaborationView, step: int, members: dict[str, Member]) -> bool:
    """Whether the progress records show a training peer at ``step`` (accumulating for it, not
    resyncing) that is not in the group ``members``: it would not follow a group of one (rule 14)."""
    return bool(beside(view, step, members))


def beside(view: CollaborationView, step: int, members: dict[str, Member]) -> dict[str, float]:
    """The training peers at ``step`` outside the group ``members`` (``trainers_outside``), each with
    its record's publish time (its own clock: compared only with an earlier record of the same peer)."""
    return {r.peer_id: r.time for r in view.trainers_at(step) if r.peer_id not in members}


def one_contributor(members: dict[str, Member]) -> bool:
    """Whether exactly one member of a group brings samples (the others, if any, aggregate only)."""
    return sum(m.weight > 0 for m in members.values()) == 1


def silent_since(declined: Mapping[str, float], now_beside: Mapping[str, float]) -> list[str]:
    """The trainers that were at the step when a lead of it first declined (``declined``: each one's
    record's publish time then) and still are, with that very record (``now_beside``): they published
    nothing since, so they are frozen or dead (a dead one's record lapses within ``progress_ttl``)."""
    return sorted(p for p, t in declined.items() if now_beside.get(p) == t)


def declines_lone_lead(members: dict[str, Member], others_at_step: bool, declined: Mapping[str, float] | None,
                       now_beside: Mapping[str, float]) -> bool:
    """Rule 14: a lead whose group has one contributor (the leader, or a trainer that joined an
    aggregator-only leader) declines the step the first time (``declined`` None), while other
    contributing peers are ready for it or training at it (``others_at_step``): they would not follow
    a group of one (rule 13), and taking it would fork the step. Later it closes (a peer that can
    never join, e.g. a NAT'd one whose joins fail, holds it back only once), unless a trainer that was
    at the step at the first decline is still there and has published nothing since
    (``silent_since``): two such trainers, frozen while they accumulated, would come back and take
    the step again together (a fork). So it waits for them to come back, or for their records to
    lapse."""
    if not one_contributor(members) or not others_at_step:
        return False
    return declined is None or bool(silent_since(declined, now_beside))


__all__ = ["POLL", "poll_period", "Asker", "leaders", "partners", "closes_for", "outranked_by", "never_joined", "trainers_outside", "beside", "one_contributor",
           "silent_since", "declines_lone_lead"]
