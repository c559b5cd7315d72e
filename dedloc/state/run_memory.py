"""What a backbone remembers of its run across a restart (``run.json`` beside its checkpoints).

A backbone is the run's one well-known address: after a reboot it comes back with its own command
line, no initial peers and a checkpoint that may be a minute old. Without a memory it would be an
island: newcomers bootstrapping through it would see only its old checkpoint and retake steps the
run already took. So it keeps

- ``newest``: the newest fingerprint (``"<applied step>:<hash>"``, state/lineage.py) it saw the
  run's trainers hold; until it sees the run again at or past that step, it offers no older state
  as the run's (roles/backbone.py);
- ``live``: whether trainers were live when it last looked: a backbone killed or restarted then
  looks for them before it serves its checkpoint, since the run may be past the newest step it saw
  (that step is at most one report old), while one that saw every trainer leave serves it at once;
- ``peers``: the addresses of the run's peers it was connected to, to bootstrap from.

Written atomically (temporary file, fsync, rename) whenever it changes; a torn, foreign or
hostile file reads as no memory, with a warning naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from dedloc.files import write_atomically
from dedloc.records import parse_fingerprint

logger = logging.getLogger(__name__)

MAX_PEERS = 64
"""Peers remembered (each with up to MAX_ADDRS addresses); more recent connections first."""
MAX_ADDRS = 4
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class RunMemory:
    newest: str = ""
    """The newest fingerprint seen held by the run's trainers (empty: none yet)."""
    peers: tuple[str, ...] = ()
    """Full multiaddrs (``.../p2p/<peer id>``) of the run's peers this backbone was connected to."""
    live: bool = False
    """Trainers were live when this backbone last read the run's progress."""

    @property
    def newest_step(self) -> int:
        """The applied step of ``newest`` (-1: none)."""
        parsed = parse_fingerprint(self.newest)
        return -1 if parsed is None else parsed[0]

    @property
    def peer_ids(self) -> set[str]:
        """The peers whose addresses are remembered."""
        return {_peer_of(a) for a in self.peers}

    def saw(self, fingerprint: str) -> "RunMemory":
        """This memory with ``fingerprint`` as the newest if it is further than the one held."""
        parsed = parse_fingerprint(fingerprint)
        if parsed is None or parsed[0] <= self.newest_step:
            return self
        return dataclasses.replace(self, newest=fingerprint)

    def with_peers(self, connections: dict[str, list[str]], members: set[str]) -> "RunMemory":
        """This memory with the addresses of ``connections`` (peer id -> addresses) that belong to
        ``members`` (peers publishing progress in this run); kept when none is connected now."""
        fresh = []
        for peer in sorted(connections):
            if peer not in members:
                continue
            addrs = [a for a in connections[peer] if "/p2p-circuit" not in a][:MAX_ADDRS]
            fresh += [a if a.endswith(f"/p2p/{peer}") else f"{a}/p2p/{peer}" for a in addrs]
        if not fresh:
            return self
        fresh_ids = {_peer_of(a) for a in fresh}
        older = [a for a in self.peers if _peer_of(a) not in fresh_ids]
        kept, ids = [], []
        for a in fresh + older:
            peer = _peer_of(a)
            if peer not in ids:
                if len(ids) == MAX_PEERS:
                    break
                ids.append(peer)
            kept.append(a)
        return dataclasses.replace(self, peers=tuple(kept))

    def to_json(self) -> str:
        return json.dumps({"newest": self.newest, "live": self.live, "peers": list(self.peers)}, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunMemory":
        """The memory in ``path``; an empty one if there is none or it is unreadable (logged)."""
        path = Path(path)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            obj = json.loads(path.read_text())
            newest, peers, live = obj.get("newest", ""), obj.get("peers", []), obj.get("live", False)
            if not isinstance(live, bool):
                raise ValueError(f"live must be true or false, not {live!r}")
            if not isinstance(newest, str) or (newest and parse_fingerprint(newest) is None):
                raise ValueError(f"malformed newest fingerprint {newest!r}")
            if not isinstance(peers, list) or not all(isinstance(a, str) and a.startswith("/") and "/p2p/" in a
                                                      for a in peers):
                raise ValueError("peers must be a list of multiaddrs ending in /p2p/<peer id>")
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, AttributeError) as e:
            logger.warning(f"ignoring the run memory {path}: {e}")
            return cls()
        return cls(newest, tuple(peers[:MAX_PEERS * MAX_ADDRS]), live)

    def save(self, path: str | os.PathLike) -> None:
        write_atomically(path, self.to_json())


def _peer_of(maddr: str) -> str:
    """The peer id a full multiaddr ends with (``.../p2p/<peer id>``)."""
    return maddr.rsplit("/p2p/", 1)[1]


__all__ = ["RunMemory", "MAX_PEERS"]
