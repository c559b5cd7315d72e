"""What the training process may ask of its peer's background process: declared once, here.

:class:`dedloc.service.PeerService` implements this declaration (a missing method, or one whose
parameters differ, fails when service.py is imported: ``RemoteAPI``), and :class:`dedloc.peer.Peer`
calls through it (``runtime.call(PeerAPI.report, record, ttl)``: a wrong argument raises TypeError
in the caller before anything is sent; a type checker sees the arguments and the result).
Errors raised by a method arrive with their type (``dedloc.errors.from_wire``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from dedloc.averaging.bounds import WeightBounds
from dedloc.averaging.outcome import RoundOutcome
from dedloc.net.runtime import RemoteAPI
from dedloc.records import ProgressRecord


class PeerAPI(RemoteAPI, api=True):
    # ---- identity and connections ------------------------------------------------------------------
    @abstractmethod
    async def info(self) -> dict[str, Any]:
        """``peer_id``, ``maddrs``, ``client_mode``, ``reachable``, ``reachability``, and ``leftovers``
        (the files to remove if the process is killed)."""

    @abstractmethod
    async def ping(self) -> float:
        """The background process's wall clock (it answers)."""

    @abstractmethod
    async def connections(self) -> dict[str, dict[str, Any]]:
        """Open connections: peer id -> {"direct": any not through a relay, "addrs": remote addresses}."""

    @abstractmethod
    async def stream_counts(self) -> dict[str, int]:
        """Streams opened outside rounds (states, probes), by path: ``direct``, ``libp2p``."""

    @abstractmethod
    async def rejoin(self, maddrs: list[str], timeout: float) -> list[str]:
        """Reconnect to the run's peers at ``maddrs``; the peer ids that answered."""

    # ---- progress and records ----------------------------------------------------------------------
    @abstractmethod
    async def publish_progress(self, record: dict[str, Any], ttl: float) -> bool:
        """Store this peer's progress record (wire form) for ``ttl`` seconds."""

    @abstractmethod
    async def read_progress(self) -> list[ProgressRecord]:
        """Everyone's live progress records (``Peer.collaboration`` builds the view)."""

    @abstractmethod
    async def report(self, record: dict[str, Any], ttl: float) -> tuple[list[ProgressRecord], bool]:
        """Publish this peer's progress, then read everyone's; and whether a newcomer wants our state."""

    @abstractmethod
    async def leave(self, ttl: float) -> None:
        """Mark this peer as left (the others stop waiting for it)."""

    @abstractmethod
    async def read_records(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """The run's raw records under ``names`` (the monitor's): name -> {subkey: value}."""

    @abstractmethod
    async def publish_record(self, name: str, value: Any, ttl: float) -> bool:
        """Store ``value`` under this peer's subkey of record ``name`` (only ``ledger``)."""

    # ---- training state ------------------------------------------------------------------------------
    @abstractmethod
    async def offer_state(self, step: int, blob: bytes, history: list[str] | None = None) -> None:
        """Serve ``blob`` (a state at ``step``, with its lineage ``history``) to peers that ask."""

    @abstractmethod
    async def download_state(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                             votes: dict[str, str] | None = None,
                             max_step: int | None = None) -> tuple[int, bytes, str]:
        """A state at step >= ``min_step`` from the first donor that has one (``Peer.download_state``)."""

    # ---- averaging -----------------------------------------------------------------------------------
    @abstractmethod
    async def register_buffer(self, name: str, shm_name: str, numel: int) -> None:
        """Attach the training process's shared buffer ``shm_name`` under ``name``."""

    @abstractmethod
    async def average(self, name: str, step: int, weight: float, expected_peers: int | None = None,
                      timeout: float | None = None, gather_time: float | None = None,
                      bounds: WeightBounds | None = None) -> RoundOutcome:
        """Average buffer ``name`` in place over this step's group (``Peer.average``); the round's stats."""

    @abstractmethod
    async def pending_round(self, step: int) -> int:
        """The size of the vector contributing peers are ready to average for ``step`` (0: none)."""

    @abstractmethod
    async def closed_round(self, step: int) -> dict[str, list[str]]:
        """Members of each group that closed ``step`` (leader -> peer ids)."""

    @abstractmethod
    async def round_deadline(self, step: int) -> float | None:
        """Until when a round of ``step`` may still finish (None: no group closed it)."""

    # ---- planning ------------------------------------------------------------------------------------
    @abstractmethod
    async def probe(self, peers: list[str] | None = None) -> dict[str, Any]:
        """Measure bandwidth to ``peers`` now and publish it."""

    @abstractmethod
    async def capabilities(self) -> dict[str, Any]:
        """Everyone's capability records, and the last plan this peer made as a leader."""

    @abstractmethod
    async def reconfigure(self, changes: dict[str, Any]) -> None:
        """Change how rounds this peer leads are planned and run (``planner``, ``strategy``, ``compression``)."""
