"""Handing a peer's state on before it leaves, so that the steps it took outlive it.

A group's update is held by its members alone. When every member that can serve the state (a
trainer: clients accept no streams, aggregator-only peers hold none) leaves right after the round,
nobody can hand that step on: the others take it again with other samples, and the group's clients
fork and step back. So before it leaves, a peer that no other serving peer has caught up with yet
keeps serving its state and publishing its progress, until one holds its step: the others see the
step taken (the closed record, a newer global step), miss their round of it, and download it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from dedloc.optim.port import PeerPort
from dedloc.records import CollaborationView, ProgressRecord, Role

logger = logging.getLogger(__name__)

POLL = 1.0
"""Seconds between two progress reports while waiting."""


def holds(record: ProgressRecord, step: int, backbone: bool = False) -> bool:
    """Whether ``record``'s peer can serve the state of ``step`` or a later one: a backbone that
    checkpointed it, or (unless ``backbone``) a trainer whose parameters are at it, not resyncing."""
    if record.role == Role.BACKBONE:
        return record.step >= step
    applied = record.applied_step
    return not backbone and record.role == Role.TRAINER and not record.syncing and applied is not None \
        and applied >= step


class Leaving(Protocol):
    """What handing on asks of an optimizer (``CollaborativeOptimizer``)."""

    peer: PeerPort

    @property
    def applied_step(self) -> int: ...

    def drop_gradients(self) -> None: ...

    def offer_state(self) -> None: ...

    def report(self) -> CollaborationView: ...


def hand_on(opt: Leaving, timeout: float, stop: threading.Event | None = None,
            backbone: bool = False) -> bool:
    """Serve ``opt``'s state and publish its progress until another peer holds its applied step
    (``backbone``: until a backbone has checkpointed it). Returns True once one does (at once,
    after one progress report, when one already did); False when no other trainer (``backbone``:
    no backbone) is alive to take it, ``timeout`` passes or ``stop`` is set. The gradients in hand
    are dropped: this peer contributes nothing more. Raises what a progress report raises
    (RuntimeClosedError, DedlocError); a KeyboardInterrupt ends the wait and propagates."""
    me, step = opt.peer.peer_id, opt.applied_step
    opt.drop_gradients()
    opt.offer_state()
    deadline = time.monotonic() + timeout
    waiting = False
    while True:
        view: CollaborationView = opt.report()
        if any(holds(r, step, backbone) for r in view.peers if r.peer_id != me):
            if waiting:
                logger.info(f"step {step} is held by another peer; leaving")
            return True
        # who would take it: a backbone pulls on its own schedule (checkpoint_interval), so only a
        # planned exit waits for one; other trainers download it as soon as they miss its round
        takers = [r for r in view.peers if r.peer_id != me and r.role == (Role.BACKBONE if backbone else Role.TRAINER)]
        if not takers or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            if takers:
                logger.warning(f"leaving at step {step} before " +
                               ("a backbone checkpointed it" if backbone else "another trainer holds it"))
            return False
        if not waiting:
            logger.info(f"no other peer holds step {step} yet: serving it for up to {timeout:.0f} s before leaving")
            waiting = True
        (stop or threading.Event()).wait(min(POLL, max(0.0, deadline - time.monotonic())))
