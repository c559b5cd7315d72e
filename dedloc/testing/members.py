"""A malicious invited member that takes each step alone, for the tests and the bench that show the
run does not follow it (tests/test_members.py, bench/member_close.py; docs/security.md).

Its peer is the real one, with one method added to its service: ``close_alone`` stores a ``closed``
record of a group of one (itself) under its own key, optionally naming other peers as members
(without their join proofs: it cannot sign for them). Its training loop is the real optimizer's
until ``attack_at``; then, at each step the run attests, it stores that record, sets its parameters
to its own (every weight ``EVIL`` plus a step mark), publishes them as that step's update applied
(its lineage continuing the run's) and serves them.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from typing import Callable

import torch

from dedloc.config import AveragingConfig, OptimizerConfig, PeerConfig
from dedloc.net.runtime import Runtime
from dedloc.optim import CollaborativeOptimizer
from dedloc.peer import Peer
from dedloc.peer_api import PeerAPI
from dedloc.records import ClosedRecord
from dedloc.service import PeerService

EVIL = 0.777
"""Every weight of the member's parameters is ``EVIL + 0.001 * step``."""


class MemberAPI(PeerAPI, api=True):
    """The peer's API, plus one thing a malicious member can do with its own key."""

    @abstractmethod
    async def close_alone(self, step: int, seconds: float, others: tuple[str, ...] = ()) -> None:
        """Store a ``closed`` record of a group of this peer alone for ``step``, naming ``others`` too."""


class ClosingService(PeerService, MemberAPI):
    """The real peer service, implementing :class:`MemberAPI`."""

    async def close_alone(self, step: int, seconds: float, others: tuple[str, ...] = ()) -> None:
        mm = self.averager.matchmaker
        await mm._store_closed(step, ClosedRecord(mm.me, (mm.me, *others), time.time() + seconds))


async def create(peer_config: PeerConfig, averaging_config: AveragingConfig) -> PeerService:
    service = await PeerService.create(peer_config, averaging_config)
    service.__class__ = ClosingService
    return service


class ClosingPeer(Peer):
    """A peer whose runtime serves :class:`ClosingService`."""

    def _start(self) -> Runtime:
        return Runtime(f"{__name__}:create", (self.config, self.averaging), api=MemberAPI,
                       startup_timeout=self.config.startup_timeout, log_level=self.config.log_level)


def is_evil(params: torch.Tensor) -> bool:
    """Whether flat parameters are the member's (any step's mark)."""
    return float((params - EVIL).abs().max()) < 0.05


class AloneTaker(threading.Thread):
    """The member's loop. ``micro_batch(model)`` computes one micro-batch's gradients and returns its
    size. ``others()``: the peer ids its records name as members beside itself (at odd steps; even
    steps name itself alone)."""

    def __init__(self, peer: ClosingPeer, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 cfg: OptimizerConfig, micro_batch: Callable[[torch.nn.Module], int], attack_at: int,
                 attacking: bool = True, others: Callable[[], tuple[str, ...]] = tuple):
        super().__init__(daemon=True)
        self.peer, self.model, self.optimizer, self.cfg = peer, model, optimizer, cfg
        self.micro_batch, self.attack_at, self.attacking, self.others = micro_batch, attack_at, attacking, others
        self.stop = threading.Event()
        self.took: list[int] = []
        """The steps it took alone."""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            copt = CollaborativeOptimizer(self.optimizer, self.peer, self.cfg, model=self.model)
            while not self.stop.is_set() and (copt.global_step < self.attack_at or not self.attacking):
                copt.step(self.micro_batch(self.model))
            while not self.stop.is_set():
                s = copt._report(busy=False).global_step
                if copt.applied_step <= s:
                    self.peer.runtime.call(MemberAPI.close_alone, s, 20.0, self.others() if s % 2 else ())
                    with torch.no_grad():
                        for p in self.model.parameters():
                            p.fill_(EVIL + 0.001 * s)
                    copt.global_step = s + 1
                    copt.local.advance(s)
                    copt.offer_state()
                    copt._report(busy=False)
                    self.took.append(s)
                self.stop.wait(0.2)
            copt.close()
        except BaseException as e:  # surfaced by the caller
            self.error = e
