"""The contribution ledger: samples and rounds per peer, counted from what aggregators accepted.

Input: credit records (records.CreditRecord). After every round, each aggregator credits each
contributor it actually reduced into its part with that part's fraction of the vector times the
weight (samples) it reduced, and the same fraction of a round; it publishes its running totals.
Over a round's aggregators the fractions add up to 1, so for honest aggregators

    samples(p) = sum over sources of credited samples(p) = the samples p's accepted gradients carried

and a peer cannot credit itself by claiming: only aggregators credit, and only for contributions
they received and reduced. What an aggregator could still do (docs/security.md): publish inflated
totals. The ledger keeps every source's totals apart (``sources``), so an outlier is visible.

A source is one aggregator incarnation (its totals restart from 0 when it restarts); the ledger
keeps each source's last totals, so departed aggregators keep counting. The ledger is a JSON file
(``save``/``load``, written atomically: a backbone keeps it next to its checkpoints across
restarts) and exports CSV.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from typing import Iterable

from dedloc.files import write_atomically
from dedloc.records import CreditRecord, ProgressRecord, name_ok

COLUMNS = ["peer", "name", "samples", "rounds", "last_step"]
MAX_SOURCES = 100_000
MAX_NAMES = 100_000


def rows_csv(rows: list[dict]) -> str:
    """Ledger rows (``Ledger.table()``) as CSV with a header; other keys are left out."""
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


@dataclass
class Ledger:
    sources: dict[str, dict[str, tuple[float, float, int]]] = field(default_factory=dict)
    """``"<aggregator>/<incarnation>"`` -> contributor -> (samples, rounds, last step): its last totals."""
    names: dict[str, str] = field(default_factory=dict)
    """Peer id -> the display name it last published (``PeerConfig.name``)."""

    def observe(self, records: Iterable[CreditRecord]) -> bool:
        """Take in credit records (the newest totals of each source); True if anything changed."""
        changed = False
        for r in records:
            key = f"{r.aggregator}/{r.incarnation}"
            if self.sources.get(key) != r.totals and (key in self.sources or len(self.sources) < MAX_SOURCES):
                self.sources[key] = dict(r.totals)
                changed = True
        return changed

    def named(self, records: Iterable[ProgressRecord]) -> bool:
        """Take in the display names that progress records carry; True if any changed."""
        changed = False
        for r in records:
            if r.name and self.names.get(r.peer_id) != r.name and (r.peer_id in self.names or len(self.names) < MAX_NAMES):
                self.names[r.peer_id] = r.name
                changed = True
        return changed

    def table(self) -> list[dict]:
        """Rows ``{peer, name, samples, rounds, last_step}`` summed over sources, most samples first
        (``name``: the peer's display name, empty if it published none)."""
        totals: dict[str, list] = {}
        for credits in self.sources.values():
            for peer, (samples, rounds, last) in credits.items():
                t = totals.setdefault(peer, [0.0, 0.0, -1])
                t[0] += samples
                t[1] += rounds
                t[2] = max(t[2], last)
        return [{"peer": p, "name": self.names.get(p, ""), "samples": round(s), "rounds": round(r, 1), "last_step": last}
                for p, (s, r, last) in sorted(totals.items(), key=lambda kv: (-kv[1][0], kv[0]))]

    def to_csv(self) -> str:
        return rows_csv(self.table())

    def to_json(self) -> dict:
        return {"sources": {k: {p: list(v) for p, v in c.items()} for k, c in self.sources.items()},
                "names": dict(self.names)}

    @classmethod
    def from_json(cls, obj: dict) -> "Ledger":
        """A ledger from ``to_json``'s output; ValueError naming the problem if it is malformed."""
        try:
            sources = {str(k): {str(p): (float(s), float(r), int(last)) for p, (s, r, last) in c.items()}
                       for k, c in obj["sources"].items()}
            names = {str(p): n for p, n in obj.get("names", {}).items()}  # (a ledger saved before names: none)
            if not all(name_ok(n) for n in names.values()):
                raise ValueError("a name is not printable or too long")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed ledger: {e!r}") from None
        return cls(sources, names)

    def save(self, path: str) -> None:
        """Write to ``path`` atomically (a crash leaves the old file or the new one)."""
        write_atomically(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str) -> "Ledger":
        """The ledger saved at ``path``, or an empty one if there is none; ValueError if unreadable."""
        if not os.path.exists(path):
            return cls()
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the ledger {path}: {e}") from None


__all__ = ["Ledger", "rows_csv"]
