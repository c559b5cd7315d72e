"""An in-process collaboration for testing the optimizer's shell without a network.

``FakeRun`` holds what the DHT and the rounds would: progress records, offered states, and one
rendezvous per step. Each ``FakePeer`` implements ``PeerPort`` (dedloc/optim/port.py) over it,
so ``CollaborativeOptimizer(opt, run.peer(), config)`` runs in one process, in milliseconds:

    run = FakeRun()
    a, b = run.peer(), run.peer()

A round of step s closes once ``expected_peers`` and every training peer whose record shows s or
an earlier step contributed, or its gather window passed; a peer arriving after that misses it
(MissedRoundError), as a late joiner does. The average is the same
sample-weighted mean a real part computes (``PartAccumulator``). What it leaves out: the DHT's
delays and losses, failures inside a round, matchmaking rules (there is one group per step).
``FakeRun.fail(step)`` makes the round of ``step`` fail for its members (AveragingError).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dedloc.averaging.accumulator import PartAccumulator
from dedloc.averaging.bounds import WeightBounds
from dedloc.averaging.outcome import RoundOutcome
from dedloc.config import AveragingConfig
from dedloc.errors import AveragingError, MissedRoundError, StateError
from dedloc.optim.port import PeerPort
from dedloc.records import CollaborationView, ProgressRecord, Role


@dataclass
class _Round:
    step: int
    round_id: str
    until: float
    """Wall clock by which its members must have contributed."""
    vectors: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)
    closed: bool = False
    failed: str = ""
    result: torch.Tensor | None = None
    total: float = 0.0


class FakeRun:
    """Progress records, offered states and rounds shared by the ``FakePeer``s of one run."""

    def __init__(self, averaging: AveragingConfig | None = None):
        self.averaging = averaging or AveragingConfig(matchmaking_time=0.5, averaging_timeout=5.0)
        self._cond = threading.Condition()
        self.records: dict[str, ProgressRecord] = {}
        self.states: dict[str, tuple[int, bytes]] = {}
        self._wanted: set[str] = set()
        self._rounds: dict[int, _Round] = {}
        self._failing: set[int] = set()
        self._pool = cf.ThreadPoolExecutor(16, thread_name_prefix="fake-run")
        self._count = 0

    def peer(self, peer_id: str | None = None, role: Role = Role.TRAINER) -> "FakePeer":
        with self._cond:
            self._count += 1
            return FakePeer(self, peer_id or f"fake{self._count:03d}", role)

    def fail(self, step: int) -> None:
        """The next round of ``step`` will fail for every member (AveragingError, as when a part's
        aggregator and its backup both failed); the one after that runs."""
        with self._cond:
            self._failing.add(step)

    def view(self) -> CollaborationView:
        with self._cond:
            return CollaborationView.build(list(self.records.values()), time.time())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- rounds ----------------------------------------------------------------------------------
    def _average(self, me: str, vector: torch.Tensor, step: int, weight: float, expected: int,
                 gather: float) -> tuple[torch.Tensor, RoundOutcome]:
        with self._cond:
            r = self._rounds.get(step)
            if r is None:
                r = self._rounds[step] = _Round(step, os.urandom(16).hex(), time.time() + gather)
            if r.closed:
                raise MissedRoundError(f"step {step}: the round closed without {me}")
            r.vectors[me] = (vector.detach().clone(), float(weight))
            self._cond.notify_all()
            while not r.closed and len(r.vectors) < max(expected, self._at_step(step)) and time.time() < r.until:
                self._cond.wait(max(0.0, min(0.05, r.until - time.time())))
            if not r.closed:
                self._close(r)
            if r.failed:
                raise AveragingError(r.failed)
            peers = tuple(sorted(r.vectors))
            outcome = RoundOutcome(step, r.round_id, peers, tuple(r.vectors[p][1] for p in peers),
                                   tuple(1.0 for _ in peers), "fake",
                                   contributors=tuple(p for p in peers if r.vectors[p][1] > 0), total_weight=r.total)
            return r.result, outcome

    def _at_step(self, step: int) -> int:
        """Training peers whose records show ``step`` or an earlier one (resyncing too): a round waits
        for them within its gather window, so that who joins does not hang on thread timing (a real
        group of one waits for the trainers beside it too: rule 14)."""
        return sum(1 for r in self.records.values() if r.role.trains and r.step <= step)

    def _close(self, r: _Round) -> None:
        r.closed = True
        self._cond.notify_all()
        if r.step in self._failing:  # once: the members' next round of the step starts afresh
            self._failing.discard(r.step)
            del self._rounds[r.step]
            r.failed = f"step {r.step}: the round failed for every member"
            return
        peers = sorted(r.vectors)
        numel = next(iter(r.vectors.values()))[0].numel()
        part = PartAccumulator(set(range(len(peers))), numel)
        for i, p in enumerate(peers):
            vector, weight = r.vectors[p]
            if weight > 0:
                part.add(i, weight, vector.float())
        r.total = part.total_weight
        r.result = part.finish() if part.total_weight > 0 else torch.zeros(numel)

    def _pending(self, step: int) -> int:
        with self._cond:
            r = self._rounds.get(step)
            return 0 if r is None or r.closed or not r.vectors else next(iter(r.vectors.values()))[0].numel()

    def _deadline(self, step: int) -> float | None:
        with self._cond:
            r = self._rounds.get(step)
            return r.until + self.averaging.averaging_timeout if r is not None and r.closed else None


class FakePeer(PeerPort):
    """One member of a ``FakeRun`` (module docs)."""

    def __init__(self, run: FakeRun, peer_id: str, role: Role = Role.TRAINER):
        self.run, self.peer_id, self._role = run, peer_id, role
        self.averaging = run.averaging
        self.progress_ttl = 30.0

    @property
    def role(self) -> Role:
        return self._role

    # ---- progress --------------------------------------------------------------------------------
    def report(self, record: ProgressRecord) -> tuple[CollaborationView, bool]:
        with self.run._cond:
            self.run.records[self.peer_id] = record
            wanted = self.peer_id in self.run._wanted
            self.run._wanted.discard(self.peer_id)
        return self.run.view(), wanted

    def report_async(self, record: ProgressRecord) -> "cf.Future[tuple[CollaborationView, bool]]":
        return self.run._pool.submit(self.report, record)

    def collaboration(self) -> CollaborationView:
        return self.run.view()

    def leave(self) -> None:
        with self.run._cond:
            self.run.records.pop(self.peer_id, None)
            self.run.states.pop(self.peer_id, None)

    # ---- state -----------------------------------------------------------------------------------
    def offer_state(self, step: int, blob: bytes, history: list[str] | None = None) -> None:
        with self.run._cond:
            self.run.states[self.peer_id] = (step, bytes(blob))

    def download_state(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                       votes: dict[str, str] | None = None, max_step: int | None = None) -> tuple[int, bytes, str]:
        deadline = time.monotonic() + timeout
        while True:
            with self.run._cond:
                for donor in donors:
                    step, blob = self.run.states.get(donor, (-1, b""))
                    if min_step <= step and (max_step is None or step <= max_step) and \
                            (max_bytes is None or len(blob) <= max_bytes):
                        return step, blob, donor
                    self.run._wanted.add(donor)  # it offers its newer state at its next report
                if time.monotonic() >= deadline:
                    raise StateError(f"no donor of {donors} offers a state of step >= {min_step}")
                self.run._cond.wait(0.05)

    def download_state_async(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                             votes: dict[str, str] | None = None,
                             max_step: int | None = None) -> "cf.Future[tuple[int, bytes, str]]":
        return self.run._pool.submit(self.download_state, donors, min_step, timeout, max_bytes, votes, max_step)

    # ---- rounds ----------------------------------------------------------------------------------
    def average_async(self, tensor: torch.Tensor, *, step: int, weight: float, expected_peers: int | None = None,
                      timeout: float | None = None, gather_time: float | None = None,
                      bounds: WeightBounds | None = None) -> tuple[cf.Future, Callable[[], RoundOutcome]]:
        vector = tensor.detach().reshape(-1).clone()
        gather = self.averaging.matchmaking_time if gather_time is None else gather_time
        future = self.run._pool.submit(self.run._average, self.peer_id, vector, step, weight,
                                       expected_peers or 1, gather)

        def finish() -> RoundOutcome:
            result, outcome = future.result()
            with torch.no_grad():
                tensor.copy_(result.view_as(tensor))
            return outcome

        return future, finish

    def average(self, tensor: torch.Tensor, *, step: int, weight: float, expected_peers: int | None = None,
                timeout: float | None = None, gather_time: float | None = None,
                bounds: WeightBounds | None = None) -> RoundOutcome:
        _, finish = self.average_async(tensor, step=step, weight=weight, expected_peers=expected_peers,
                                       timeout=timeout, gather_time=gather_time, bounds=bounds)
        return finish()

    def pending_round(self, step: int) -> int:
        return self.run._pending(step)

    def round_deadline(self, step: int) -> float | None:
        return self.run._deadline(step)


__all__ = ["FakeRun", "FakePeer"]
