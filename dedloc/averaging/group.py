"""Who averages together in one round, and how the vector is split among them.

A :class:`Group` is what matchmaking agrees on and every member holds an identical copy of:
the members (sorted by peer id), their sample weights and aggregation shares, and, when the
collaboration is larger than the maximum group size, the split into subgroups for a
two-level (hierarchical) reduce. Everything a member derives from it (part boundaries,
backup aggregators, sub-round ids) is a pure function of the group, so all members agree.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

from dedloc.config import COMPRESSIONS, STRATEGIES
from dedloc.errors import ProtocolError
from dedloc.net.tcp import KEY_BYTES
from dedloc.records import MAX_ENDPOINT, Member

MAX_TIMEOUT = 3600.0
"""The longest round deadline a leader may set for its members."""


def sub_round_id(round_id: bytes, tag: str) -> bytes:
    return hashlib.blake2b(round_id + tag.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class Group:
    round_id: bytes
    step: int
    members: tuple[Member, ...]
    subgroups: tuple[tuple[int, ...], ...] = ()
    """Member indices of each subgroup; empty for a flat (single-level) group."""
    strategy: str = "partitioned"
    compression: str = "none"
    """Both chosen by the leader, so members never disagree."""
    timeout: float | None = None
    """The round's deadline in seconds, set by the leader to the smallest timeout among its own and
    those its joiners asked for (matchmaking rule 3): every member runs the round by it, so none
    gives up on a round that another still serves (None: each member's own)."""
    key: bytes = b""
    """The round's secret for direct TCP connections (net/tcp.py), drawn by the leader and sent only
    over the authenticated join streams, never published (empty: libp2p streams only)."""
    encryption: bool = True
    """Direct connections in this round must be TLS (the leader's ``AveragingConfig.encryption``)."""
    verify: bool = False
    """A verified round (the leader's ``AveragingConfig.verify``): each part's backup recomputes and
    confirms it, and every member checks its copy against the backup's digest (docs/averaging.md)."""

    def __post_init__(self) -> None:
        ids = [m.peer_id for m in self.members]
        if ids != sorted(ids) or len(set(ids)) != len(ids):
            raise ProtocolError("group members must be unique and sorted by peer id")
        if len(self.round_id) != 16:
            raise ProtocolError("round id must be 16 bytes")
        if len(self.key) not in (0, KEY_BYTES):
            raise ProtocolError(f"a round's key must be {KEY_BYTES} bytes")

    # ---- roles -------------------------------------------------------------------------------
    def index(self, peer_id: str) -> int | None:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        return None

    @property
    def aggregators(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.share > 0 and not m.client]

    @property
    def total_weight(self) -> float:
        return sum(m.weight for m in self.members)

    def backup(self, part: int) -> int | None:
        """The aggregator that re-reduces ``part`` if its aggregator fails: the next one in order."""
        aggs = self.aggregators
        if len(aggs) < 2 or part not in aggs:
            return None
        return aggs[(aggs.index(part) + 1) % len(aggs)]

    def part_bounds(self, numel: int) -> list[tuple[int, int]]:
        """[start, end) of each member's part; proportional to shares, empty for share 0."""
        shares = [m.share if (m.share > 0 and not m.client) else 0.0 for m in self.members]
        total = sum(shares)
        if total <= 0:
            raise ProtocolError("group has no aggregator (all shares are 0)")
        bounds, acc, start = [], 0.0, 0
        for s in shares:
            acc += s
            end = max(start, min(numel, int(round(numel * acc / total))))
            bounds.append((start, end))
            start = end
        last = max(i for i, s in enumerate(shares) if s > 0)
        bounds[last] = (bounds[last][0], numel)
        return bounds

    # ---- hierarchy ---------------------------------------------------------------------------
    def subgroup_of(self, index: int) -> int:
        for k, sub in enumerate(self.subgroups):
            if index in sub:
                return k
        raise ValueError(f"member {index} is in no subgroup")

    def subgroup(self, k: int) -> "Group":
        members = tuple(self.members[i] for i in self.subgroups[k])
        return replace(self, round_id=sub_round_id(self.round_id, f"sub{k}"), members=members, subgroups=())

    def representative(self, k: int) -> int:
        """The member of subgroup k that joins the top-level reduce: its largest-share reachable
        member among those that need the result (it must hold the subgroup's mean)."""
        sub = self.subgroups[k]
        return max((i for i in sub if _can_represent(self.members[i])),
                   key=lambda i: (self.members[i].share > 0, self.members[i].share, self.members[i].peer_id))

    def top_group(self, weights: dict[int, float]) -> "Group":
        reps = sorted((self.representative(k) for k in range(len(self.subgroups))),
                      key=lambda i: self.members[i].peer_id)
        members = tuple(replace(self.members[i], weight=weights.get(i, 0.0), share=1.0) for i in reps)
        return replace(self, round_id=sub_round_id(self.round_id, "top"), members=members, subgroups=())

    # ---- wire ----------------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {
            "round_id": self.round_id,
            "step": self.step,
            "members": [[m.peer_id, m.weight, m.share, m.client, m.fetch, m.private, m.data] for m in self.members],
            "subgroups": [list(s) for s in self.subgroups],
            "strategy": self.strategy,
            "compression": self.compression,
            **({"timeout": self.timeout} if self.timeout is not None else {}),
            **({"verify": True} if self.verify else {}),
            **({"key": self.key, "encryption": self.encryption} if self.key else {}),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> "Group":
        try:
            members = tuple(Member(str(p), float(w), float(s), bool(c), bool(f), bool(x), _endpoint(rest))
                            for p, w, s, c, f, x, *rest in obj["members"])
            subgroups = tuple(tuple(int(i) for i in s) for s in obj["subgroups"])
            strategy, compression = str(obj["strategy"]), str(obj["compression"])
            if strategy not in STRATEGIES or compression not in COMPRESSIONS:
                raise ValueError(f"unknown strategy {strategy!r} or compression {compression!r}")
            timeout = None if obj.get("timeout") is None else float(obj["timeout"])
            if timeout is not None and not 0 < timeout <= MAX_TIMEOUT:
                raise ValueError(f"round timeout {timeout} outside (0, {MAX_TIMEOUT:.0f}] s")
            verify = obj.get("verify", False)
            if not isinstance(verify, bool):
                raise ValueError(f"verify must be a boolean, got {verify!r}")
            key, encryption = obj.get("key", b""), obj.get("encryption", True)
            if not isinstance(key, bytes) or not isinstance(encryption, bool):
                raise ValueError("malformed key or encryption flag")
            group = cls(bytes(obj["round_id"]), int(obj["step"]), members, subgroups, strategy, compression, timeout,
                        key, encryption, verify)
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed group description: {e}") from None
        if any(not (m.weight >= 0 and math.isfinite(m.weight)) or not (m.share >= 0 and math.isfinite(m.share))
               for m in members):
            raise ProtocolError("group has a negative or non-finite weight or share")
        if subgroups:
            flat = sorted(i for s in subgroups for i in s)
            if flat != list(range(len(members))):
                raise ProtocolError("subgroups must cover every member exactly once")
            if not all(any(_can_represent(members[i]) for i in s) for s in subgroups):
                raise ProtocolError("every subgroup needs a reachable member that takes the result")
        return group


def _endpoint(rest: list) -> str:
    """A member's data endpoint from its wire entry's optional seventh field."""
    if not rest:
        return ""
    if len(rest) != 1 or not isinstance(rest[0], str) or len(rest[0]) > MAX_ENDPOINT:
        raise ValueError("malformed data endpoint")
    return rest[0]


def _can_represent(m: Member) -> bool:
    """Reachable and takes the result (the share may be 0 after planning: it is still dialable)."""
    return m.reachable and m.fetch


def split_into_subgroups(members: tuple[Member, ...], max_size: int) -> tuple[tuple[int, ...], ...]:
    """Split sorted members into near-equal subgroups of at most ``max_size``, each with an aggregator.

    Reachable members that take the result are dealt round-robin first, so every subgroup can
    reduce on its own and has a representative; then the rest fill up the smallest subgroups.
    Returns () when one group suffices.
    """
    n = len(members)
    if n <= max_size:
        return ()
    count = math.ceil(n / max_size)
    aggs = [i for i, m in enumerate(members) if _can_represent(m) and m.share > 0]
    if len(aggs) < count:
        count = max(1, len(aggs))
    subs: list[list[int]] = [[] for _ in range(count)]
    for k, i in enumerate(aggs[:count]):
        subs[k].append(i)
    for i in range(n):
        if i in aggs[:count]:
            continue
        min(subs, key=len).append(i)
    return tuple(tuple(sorted(s)) for s in subs)
