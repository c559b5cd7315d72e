"""What the collaborative optimizer asks of its peer: the seam between the step logic and the network.

``dedloc.Peer`` is the real implementation (a background process with the p2p daemon and the DHT);
``dedloc.testing.fake_peer.FakePeer`` an in-process one, several of which share a ``FakeRun``, so
the optimizer's shell can be tested without a network in milliseconds. tests/test_peer_port.py
runs one scenario against both.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
from typing import Callable

import torch

from dedloc.averaging.bounds import WeightBounds
from dedloc.averaging.outcome import RoundOutcome
from dedloc.config import AveragingConfig
from dedloc.records import CollaborationView, ProgressRecord, Role


class PeerPort(abc.ABC):
    """A member of a collaboration, as its optimizer sees it."""

    peer_id: str
    """This peer's id (base58 libp2p peer id for a real peer)."""
    averaging: AveragingConfig
    """How its rounds form (the optimizer reads the matchmaking and round windows)."""
    progress_ttl: float
    """Seconds its progress record lives after its last report (``PeerConfig.progress_ttl``)."""

    @property
    @abc.abstractmethod
    def role(self) -> Role:
        """Trainer, client-mode trainer, aggregator or backbone."""

    # ---- progress --------------------------------------------------------------------------------
    @abc.abstractmethod
    def report(self, record: ProgressRecord) -> tuple[CollaborationView, bool]:
        """Publish ``record`` and read everyone's; also whether a peer asked for a newer state than
        the one this peer offers (it should offer its own once it holds a complete one)."""

    @abc.abstractmethod
    def report_async(self, record: ProgressRecord) -> "cf.Future[tuple[CollaborationView, bool]]":
        """``report`` in the background."""

    @abc.abstractmethod
    def collaboration(self) -> CollaborationView:
        """Read everyone's progress (publishing nothing)."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Tell the others this peer left."""

    # ---- state -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def offer_state(self, step: int, blob: bytes, history: list[str] | None = None) -> None:
        """Make ``blob`` (the state of ``step``, with its lineage's fingerprints) downloadable."""

    @abc.abstractmethod
    def download_state(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                       votes: dict[str, str] | None = None, max_step: int | None = None) -> tuple[int, bytes, str]:
        """(step, blob, donor) of a state of step in ``[min_step, max_step]`` from one of ``donors``;
        StateError when none sends one within ``timeout``, ForkError for donors whose state's
        header the ``votes`` refuse, ProtocolError for a donor whose bytes are not a state."""

    @abc.abstractmethod
    def download_state_async(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                             votes: dict[str, str] | None = None,
                             max_step: int | None = None) -> "cf.Future[tuple[int, bytes, str]]":
        """``download_state`` in the background."""

    # ---- rounds ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def average(self, tensor: torch.Tensor, *, step: int, weight: float, expected_peers: int | None = None,
                timeout: float | None = None, gather_time: float | None = None,
                bounds: WeightBounds | None = None) -> RoundOutcome:
        """Replace ``tensor`` by the sample-weighted mean over this step's group; MissedRoundError
        when the step closed without this peer, MatchmakingError or AveragingError when the round
        failed."""

    @abc.abstractmethod
    def average_async(self, tensor: torch.Tensor, *, step: int, weight: float, expected_peers: int | None = None,
                      timeout: float | None = None, gather_time: float | None = None,
                      bounds: WeightBounds | None = None) -> tuple[cf.Future, Callable[[], RoundOutcome]]:
        """Start ``average``; (its future, ``finish``), where ``finish()`` writes the result into
        ``tensor`` and returns the outcome (or raises what the round raised)."""

    @abc.abstractmethod
    def pending_round(self, step: int) -> int:
        """The size of the vector that contributing peers are ready to average for ``step`` (their
        ready records; 0: none is ready yet)."""

    @abc.abstractmethod
    def round_deadline(self, step: int) -> float | None:
        """The latest deadline (wall clock) of a group that closed ``step``, plus a grace for clock
        skew; None if no group closed it."""


__all__ = ["PeerPort"]
