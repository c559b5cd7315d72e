"""An aggregator-only peer: a CPU box with good bandwidth that averages for the trainers.

It holds no model and contributes no samples (weight 0). It takes part in every round the
trainers start, aggregating whatever share the round's plan gives it (possibly 0), and needs
no result, so its download carries only the parts it aggregates. This is how a collaboration
gets BytePS-style help from cheap servers (docs/planning.md).

It learns each round's vector size from the trainers' ready records, and announces itself
with an AGGREGATOR progress record, so trainers count it among the peers they wait for.
A failed or missed round is logged and skipped: it never holds up the trainers beyond their
gather deadline. A round it led for clients alone and left to the trainers (matchmaking rule 4)
is tried again, so it serves theirs.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time

import torch

from dedloc.config import AveragingConfig, PeerConfig
from dedloc.errors import ConfigError, DedlocError, LeftToTrainersError, MissedRoundError
from dedloc.peer import Peer
from dedloc.records import CollaborationView, ProgressRecord, Role

logger = logging.getLogger(__name__)
POLL = 0.2


class Aggregator:
    def __init__(self, peer_config: PeerConfig, averaging: AveragingConfig | None = None):
        if peer_config.client_mode:
            raise ConfigError("invalid config: an aggregator-only peer cannot run in client mode (others must reach it)")
        self.averaging = dataclasses.replace(averaging or AveragingConfig(), aggregator_only=True).validate()
        self.peer = Peer(peer_config, self.averaging)
        self.rounds = 0
        """Rounds this peer took part in."""
        self.aggregated = 0
        """Rounds in which the plan gave it a share > 0."""
        self.next_step = 0

    @property
    def maddrs(self) -> list[str]:
        return self.peer.maddrs

    def _report(self) -> CollaborationView:
        record = ProgressRecord(self.peer.peer_id, self.next_step, 0, 0.0, Role.AGGREGATOR, 0.0, time.time())
        view, _ = self.peer.report(record)
        return view

    def serve_once(self, view: CollaborationView) -> bool:
        """Join the oldest round the trainers are forming; True if there was one."""
        first = max(self.next_step, view.global_step - 1)
        for step in range(first, view.global_step + 1):
            try:
                numel = self.peer.pending_round(step)
            except cf.TimeoutError:  # a runtime stuck on a slow DHT: look again on the next pass
                logger.debug(f"step {step}: its ready records could not be read in time")
                continue
            if not numel:
                continue
            expected = len(view.trainers_at(step)) + len(view.aggregators)
            try:
                stats = self.peer.average(torch.zeros(numel), step=step, weight=0.0, expected_peers=expected,
                                          gather_time=self.averaging.matchmaking_time)
                self.rounds += 1
                share = stats.share_of(self.peer.peer_id)
                self.aggregated += share > 0
                logger.debug(f"step {step}: aggregated a share of {share:.3f}")
            except MissedRoundError:
                logger.debug(f"step {step}: the round closed before this aggregator joined")
            except LeftToTrainersError as e:  # their round is still to come: serve it (bounded: a lead per try)
                logger.debug(f"{e}; serving their round")
                return True
            except DedlocError as e:
                logger.warning(f"step {step}: could not aggregate: {e}")
            self.next_step = step + 1
            return True
        return False

    def run(self, stop: threading.Event) -> None:
        """Serve rounds until ``stop`` is set."""
        while not stop.is_set():
            view = self._report()
            if not self.serve_once(view):
                stop.wait(POLL)

    def close(self) -> None:
        self.peer.close()
