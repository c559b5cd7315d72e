"""Which history of parameters the collaboration took: lineages and the live peers' votes on them.

A *lineage* maps each recent applied step to the fingerprint of the parameters after it
(``"<step>:<hash>"`` as published in progress records). It travels with every state, so a peer
can tell whether a state continues the steps that the collaboration already took, or rewrites
them (a fork: e.g. a newcomer that trained alone from a stale checkpoint while the others were
frozen or invisible).

Votes: every live peer's published fingerprint ``"t:h"`` is a vote at step ``t`` (a client's only
while a trainer publishes the same, or no trainer is alive: ``CollaborationView.votes``). Against a
lineage it *agrees* if the lineage holds ``h`` at ``t``, *disagrees* if it holds another hash
there, and says nothing if the lineage does not reach ``t`` (the peer is ahead, or too far
behind). The side with more votes is the collaboration's history; a tie goes to the side
whose smallest voting peer id is smaller, so every peer decides the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from dedloc.records import HISTORY, CollaborationView
from dedloc.records import parse_fingerprint as parse

KEEP = HISTORY
"""Steps of history a lineage keeps (forks older than this go unnoticed)."""


def extend(lineage: dict[int, str], fingerprint: str) -> dict[int, str]:
    """``lineage`` with ``fingerprint`` added (keeping the newest KEEP steps, none after it)."""
    parsed = parse(fingerprint)
    if parsed is None:
        return dict(lineage)
    step, _ = parsed
    out = {s: f for s, f in lineage.items() if s < step}
    out[step] = fingerprint
    for s in sorted(out)[:-KEEP]:
        del out[s]
    return out


@dataclass(frozen=True)
class Votes:
    agree: tuple[str, ...]
    """Peer ids whose published fingerprint lies on the lineage."""
    disagree: tuple[str, ...]
    """Peer ids whose published fingerprint contradicts it at the same step."""

    def outvoted(self, own: str | None = None) -> bool:
        """Whether the contradicting side wins (``own``: a peer id that counts for the lineage)."""
        agree = set(self.agree) | ({own} if own else set())
        disagree = set(self.disagree) - agree
        if len(disagree) != len(agree):
            return len(disagree) > len(agree)
        return bool(disagree) and min(disagree) < min(agree)


def votes(lineage: dict[int, str], view: CollaborationView, exclude: str = "") -> Votes:
    """The live peers' votes on ``lineage`` (``exclude``: a peer id whose vote is not counted)."""
    return votes_of(lineage, fingerprints(view), exclude)


def fingerprints(view: CollaborationView) -> dict[str, str]:
    """Each live peer's published fingerprint that counts (``CollaborationView.votes``; peer id ->
    ``"t:h"``): the votes, in a form that travels to the runtime process (which checks a donor's
    lineage before its state's bytes)."""
    return {r.peer_id: r.fingerprint for r in view.peers if view.votes(r)}


def votes_of(lineage: dict[int, str], published: dict[str, str], exclude: str = "") -> Votes:
    """``votes`` over fingerprints already read (peer id -> ``"t:h"``)."""
    agree, disagree = [], []
    for peer, fingerprint in published.items():
        parsed = parse(fingerprint) if peer != exclude else None
        if parsed is None or parsed[0] not in lineage:
            continue
        (agree if lineage[parsed[0]] == fingerprint else disagree).append(peer)
    return Votes(tuple(agree), tuple(disagree))


def of_state(state: dict) -> dict[int, str]:
    """The lineage a decoded state carries under ``"lineage"`` (empty if it has none or a malformed one)."""
    raw = state.get("lineage")
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, int) and isinstance(v, str) and parse(v)}


def from_list(entries: object) -> dict[int, str] | None:
    """A lineage sent as a list of ``"t:h"`` strings (a state header); None if malformed or longer
    than KEEP."""
    if not isinstance(entries, list) or len(entries) > KEEP:
        return None
    out: dict[int, str] = {}
    for entry in entries:
        parsed = parse(entry) if isinstance(entry, str) and len(entry) <= 128 else None
        if parsed is None:
            return None
        out[parsed[0]] = entry
    return out


def divergence(a: dict[int, str], b: dict[int, str]) -> int | None:
    """The earliest step that lineages ``a`` and ``b`` both reach with different fingerprints (None:
    one continues the other, as far as both reach)."""
    return min((t for t, f in a.items() if t in b and b[t] != f), default=None)


def first_conflict(lineage: dict[int, str], view: CollaborationView) -> int | None:
    """The earliest step at which a live peer's fingerprint contradicts ``lineage``."""
    return first_conflict_of(lineage, fingerprints(view))


def first_conflict_of(lineage: dict[int, str], published: dict[str, str]) -> int | None:
    """``first_conflict`` over fingerprints already read (peer id -> ``"t:h"``)."""
    steps = [p[0] for f in published.values() if (p := parse(f)) is not None and p[0] in lineage and lineage[p[0]] != f]
    return min(steps, default=None)


__all__ = ["KEEP", "parse", "extend", "Votes", "votes", "votes_of", "fingerprints", "of_state", "from_list", "divergence", "first_conflict",
           "first_conflict_of"]
