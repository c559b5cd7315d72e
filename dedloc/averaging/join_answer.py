"""A leader's answer to a join request: one of a closed set of kinds (docs/averaging.md, rules 3-5
and 13), built by the leader and read by the follower through this one type.

On the wire an answer is a msgpack map whose keys name its kind (protocol version 8):

| kind | wire | the follower |
| --- | --- | --- |
| ``GROUP`` | ``{"group": Group}`` | runs the round with that group |
| ``REDIRECT`` | ``{"redirect": peer_id}`` | asks that peer (the leader stepped down, or follows it) |
| ``MISSED`` | ``{"missed": true[, "held": true][, "closed": ClosedRecord]}`` | checks that a group closed the step for it (rule 13), else passes the leader over |
| ``NOT_HELD`` | ``{"missed": true, "held": false[, "failed": true]}`` | passes the leader over: its group cannot hand the step on, or its round failed (rules 4, 5) |
| ``CANNOT_LEAD`` | ``{"error": why, "pass": true}`` | passes the leader over: it is not matchmaking near that step (rule 5) |
| ``REFUSED`` | ``{"error": why}`` | stops: the leader refused this peer's join |

A map that fits none of these reads as ``REFUSED`` (with no reason given), as does anything that is
not a map.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Answer(str, enum.Enum):
    GROUP = "group"
    REDIRECT = "redirect"
    MISSED = "missed"
    NOT_HELD = "not held"
    CANNOT_LEAD = "cannot lead"
    REFUSED = "refused"


@dataclass(frozen=True)
class JoinAnswer:
    kind: Answer
    group: Any = None
    """The group's wire form (``Group.from_wire`` checks it), for GROUP."""
    redirect: str = ""
    closed: Any = None
    """The closing group's ``closed`` record, wire form, when a MISSED answer carries one."""
    failed: bool = False
    """NOT_HELD because the leader's round for the step failed (rather than: its group holds no state)."""
    error: str = ""

    @classmethod
    def joined(cls, group_wire: Any) -> JoinAnswer:
        return cls(Answer.GROUP, group=group_wire)

    @classmethod
    def redirected(cls, leader: str) -> JoinAnswer:
        return cls(Answer.REDIRECT, redirect=leader)

    @classmethod
    def missed(cls, held: bool = True, closed: Any = None) -> JoinAnswer:
        return cls(Answer.MISSED, closed=closed) if held else cls(Answer.NOT_HELD)

    @classmethod
    def round_failed(cls) -> JoinAnswer:
        return cls(Answer.NOT_HELD, failed=True)

    @classmethod
    def cannot_lead(cls, why: str) -> JoinAnswer:
        return cls(Answer.CANNOT_LEAD, error=why)

    @classmethod
    def refused(cls, why: str) -> JoinAnswer:
        return cls(Answer.REFUSED, error=why)

    def to_wire(self) -> dict[str, Any]:
        k = self.kind
        if k is Answer.GROUP:
            return {"group": self.group}
        if k is Answer.REDIRECT:
            return {"redirect": self.redirect}
        if k is Answer.MISSED:
            return {"missed": True, "held": True, **({"closed": self.closed} if self.closed is not None else {})}
        if k is Answer.NOT_HELD:
            return {"missed": True, "held": False, **({"failed": True} if self.failed else {})}
        if k is Answer.CANNOT_LEAD:
            return {"error": self.error, "pass": True}
        return {"error": self.error}

    @classmethod
    def from_wire(cls, value: Any) -> JoinAnswer:
        if not isinstance(value, dict):
            return cls.refused("")
        if "group" in value:
            return cls.joined(value["group"])
        if isinstance(value.get("redirect"), str):
            return cls.redirected(value["redirect"])
        if value.get("missed"):
            if value.get("held") is False:
                return cls(Answer.NOT_HELD, failed=value.get("failed") is True)
            return cls(Answer.MISSED, closed=value.get("closed"))
        error = str(value.get("error") or "")[:500]
        return cls.cannot_lead(error) if value.get("pass") is True else cls.refused(error)


__all__ = ["Answer", "JoinAnswer"]
