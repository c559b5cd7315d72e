"""A backbone peer: a cheap, stable, CPU-only member that trains nothing.

It keeps the DHT alive and serves as an initial peer; every ``checkpoint_interval`` it pulls the
newest state from a trainer (when the global step has advanced), writes it as a checkpoint and
serves it to newcomers. Started with ``resume``, it loads its newest checkpoint and serves it,
so a stopped collaboration continues from there. It never needs the model's code: states are
opaque blobs to it. It keeps the contribution ledger (monitor/ledger.py) next to its checkpoints,
and can serve the run's dashboard (``dashboard_port``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time

from dedloc.config import AveragingConfig, BackboneConfig, MonitorConfig, PeerConfig
from dedloc.errors import ConfigError, DedlocError
from dedloc.monitor.ledger import Ledger
from dedloc.monitor.server import DashboardThread
from dedloc.peer import Peer
from dedloc.records import MAX_LEDGER_ROWS, CollaborationView, CreditRecord, LedgerRecord, ProgressRecord, Role
from dedloc.state.checkpoint import CheckpointStore

logger = logging.getLogger(__name__)


class Backbone:
    def __init__(self, peer_config: PeerConfig, config: BackboneConfig | None = None,
                 averaging: AveragingConfig | None = None):
        self.config = (config or BackboneConfig()).validate()
        if peer_config.client_mode:
            raise ConfigError("invalid config: a backbone peer cannot run in client mode (others must reach it)")
        if peer_config.relay_service is None:
            peer_config = dataclasses.replace(peer_config, relay_service=True)  # it relays for private peers
        self.store = CheckpointStore(self.config.checkpoint_dir, self.config.keep_checkpoints)
        self.step = -1
        self.held_bytes: int | None = None
        """Size of the state this backbone holds and serves (None before its first)."""
        self.ledger_path = os.path.join(self.config.checkpoint_dir, self.config.ledger)
        try:
            self.ledger = Ledger.load(self.ledger_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.peer = Peer(peer_config, averaging)
        self.dashboard: DashboardThread | None = None
        try:
            if self.config.dashboard_port >= 0:
                self.dashboard = DashboardThread(self.peer.read_records, peer_config.run_id,
                                                 MonitorConfig(port=self.config.dashboard_port))
            if self.config.resume and (found := self.store.latest()) is not None:
                self.step, blob = found
                self.held_bytes = len(blob)
                self.peer.offer_state(self.step, blob)
                logger.info(f"resuming from checkpoint {self.store.path(self.step)} (step {self.step})")
            self.view = self._report()
        except BaseException:
            self.close()
            raise

    @property
    def maddrs(self) -> list[str]:
        return self.peer.maddrs

    def _report(self) -> CollaborationView:
        record = ProgressRecord(self.peer.peer_id, max(self.step, 0), 0, 0.0, Role.BACKBONE, 0.0, time.time())
        view, _ = self.peer.report(record)
        return view

    def _max_state_bytes(self) -> int | None:
        """A backbone has no model: it accepts states up to twice the one it holds plus 256 MiB
        (None, the protocol's cap, before its first)."""
        return None if self.held_bytes is None else 2 * self.held_bytes + (256 << 20)

    def pull(self) -> bool:
        """Download and checkpoint the newest state if the collaboration moved past ours; True if it did."""
        view = self._report()
        self.view = view
        target = view.global_step
        if target <= self.step:
            return False
        donors = [r.peer_id for r in view.trainers_at(target) if r.role == Role.TRAINER]
        if not donors:
            return False
        random.shuffle(donors)
        try:
            step, blob, donor = self.peer.download_state(donors, target, 60.0, self._max_state_bytes())
        except DedlocError as e:
            logger.warning(f"could not pull the state of step {target}: {e}")
            return False
        path = self.store.write(step, blob)
        self.step, self.held_bytes = step, len(blob)
        self.peer.offer_state(step, blob)
        self._report()
        logger.info(f"checkpoint of step {step} from {donor} written to {path} ({len(blob) / 1e6:.1f} MB)")
        return True

    def account(self) -> bool:
        """Take the aggregators' newest credits into the contribution ledger (monitor/ledger.py),
        save it next to the checkpoints if it changed, and publish its table (and the checkpoints
        held) for monitors. True if the ledger changed."""
        try:
            raw = self.peer.read_records(["credits"])["credits"]
        except DedlocError as e:
            logger.debug(f"could not read the credits: {e}")
            return False
        changed = self.ledger.observe(r for p, v in raw.items() if (r := CreditRecord.from_wire(p, v)) is not None)
        if changed:
            self.ledger.save(self.ledger_path)
        try:
            record = LedgerRecord(self.peer.peer_id, tuple(self.ledger.table()[:MAX_LEDGER_ROWS]),
                                  tuple(self.store.steps()))
            self.peer.publish_record("ledger", record.to_wire(), self.peer.config.progress_ttl)
        except DedlocError as e:
            logger.debug(f"could not publish the ledger: {e}")
        return changed

    def run(self, stop: threading.Event) -> None:
        """Pull and checkpoint every ``checkpoint_interval`` until ``stop`` is set; keeps the record alive."""
        next_pull = time.monotonic()
        refresh = max(1.0, self.peer.config.progress_ttl / 3)
        while not stop.is_set():
            if time.monotonic() >= next_pull:
                self.pull()
                next_pull = time.monotonic() + self.config.checkpoint_interval
            else:
                self.view = self._report()
            self.account()
            stop.wait(min(refresh, max(0.05, next_pull - time.monotonic())))

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
        self.peer.close()
