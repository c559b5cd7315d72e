"""A backbone peer: a cheap, stable, CPU-only member that trains nothing.

It keeps the DHT alive and serves as an initial peer; every ``checkpoint_interval`` it pulls the
newest state from a trainer (when the global step has advanced), writes it as a checkpoint and
serves it to newcomers. Started with ``resume``, it loads its newest checkpoint and serves it,
so a stopped collaboration continues from there. It never needs the model's code: states are
opaque blobs to it. It keeps the contribution ledger (monitor/ledger.py) next to its checkpoints,
and can serve the run's dashboard (``dashboard_port``).

Restarts (docs/optimizer.md, "Islands and partitions"): it remembers the newest step the run's
trainers held, whether they were live, and the addresses of its peers (state/run_memory.py).
Restarted while they were live, it reconnects to those peers and, until a trainer holds its
checkpoint's step or the newest it saw, publishes that step and serves no state, so a newcomer
bootstrapping through it waits for the run instead of retaking steps from an old checkpoint. It
looks every second; once found it pulls the run's state as usual, and after ``refind_timeout``
without a trainer the run has shown it ended there, and it serves its checkpoint.
A pulled state whose lineage the live peers outvote (a fork) is never checkpointed; one that
rewrites the history of the checkpoint held (the live peers took the other history) is logged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time

from dedloc.auth.authorizer import make_authorizer
from dedloc.config import AveragingConfig, BackboneConfig, MonitorConfig, PeerConfig
from dedloc.errors import ConfigError, DedlocError
from dedloc.monitor.ledger import Ledger
from dedloc.monitor.server import DashboardThread
from dedloc.peer import Peer
from dedloc.records import ATTEST, MAX_LEDGER_ROWS, CollaborationView, CreditRecord, LedgerRecord, ProgressRecord, Role, \
    parse_fingerprint
from dedloc.state import lineage, snapshot
from dedloc.state.checkpoint import CheckpointStore
from dedloc.state.run_memory import RunMemory

logger = logging.getLogger(__name__)
LOOK_EVERY = 1.0
"""Seconds between reads of the run's progress while a restarted backbone looks for its run."""
PEERS_EVERY = 10.0
"""Seconds between refreshes of the remembered peers' addresses (at once when a new peer shows up)."""


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
        self.history: dict[int, str] = {}
        """The lineage of the checkpoint held (state/lineage.py)."""
        self.ledger_path = os.path.join(self.config.checkpoint_dir, self.config.ledger)
        try:
            self.ledger = Ledger.load(self.ledger_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.memory_path = os.path.join(self.config.checkpoint_dir, self.config.memory)
        self.memory = RunMemory.load(self.memory_path) if self.config.resume else RunMemory()
        self.refinding_since: float | None = None
        """While not None: restarted while its run was live, it looks for the run (since, monotonic)."""
        self._peers_at = 0.0
        self._found = False
        """It just found its run again: its next pull is the run's state, however far past its
        checkpoint (``_unattested``)."""
        self._refused: tuple[int, set[str]] = (-1, set())
        """The target step of the last pulls, and the donors whose state of it was not checkpointed."""
        self.peer = Peer(peer_config, averaging)
        self.dashboard: DashboardThread | None = None
        try:
            if not make_authorizer(peer_config.run_id, peer_config.owner, peer_config.invite,
                                   self.peer.peer_id).backbone_invited():
                raise ConfigError(f"invalid config: invite: this peer's invitation does not let it act as the run's "
                                  f"backbone; the owner issues one with `dedloc invite {self.peer.peer_id} --backbone`")
            if self.config.dashboard_port >= 0:
                self.dashboard = DashboardThread(self.peer.read_records, peer_config.run_id,
                                                 MonitorConfig(port=self.config.dashboard_port))
            blob = None
            if self.config.resume and (found := self.store.latest()) is not None:
                self.step, blob = found
                self.held_bytes = len(blob)
                self.history = lineage.of_state(snapshot.decode(blob))
            if self.memory.live:
                self.refinding_since = time.monotonic()
                self.view = self._report()  # at once: the newest step it saw, before a newcomer reads
                logger.info(f"restarted with the checkpoint of step {self.step} while the run was live at step "
                            f"{self.memory.newest_step} or later: looking for the run before serving any state "
                            f"({len(self.memory.peers)} remembered addresses)")
            elif blob is not None:
                self._offer(blob)
                logger.info(f"resuming from checkpoint {self.store.path(self.step)} (step {self.step})")
            if self.memory.peers:
                answered = self.peer.rejoin(list(self.memory.peers))
                logger.info(f"reconnected to {len(answered)} of the run's "
                            f"{len(self.memory.peer_ids)} remembered peers")
            self.view = self._report()
        except BaseException:
            self.close()
            raise

    @property
    def maddrs(self) -> list[str]:
        return self.peer.maddrs

    def _report(self) -> CollaborationView:
        """Publish this backbone's record (while it looks for its run: the newest step it saw, so that
        nobody takes its older checkpoint for the run's state), read everyone's, and remember what
        they show."""
        step = max(self.step, self.memory.newest_step, 0) if self.refinding_since is not None else max(self.step, 0)
        record = ProgressRecord(self.peer.peer_id, step, 0, 0.0, Role.BACKBONE, 0.0, time.time())
        view, _ = self.peer.report(record)
        self._remember(view)
        return view

    def _remember(self, view: CollaborationView) -> None:
        """Take the newest fingerprint the trainers hold (up to the step the run attests, and within
        ``lineage.KEEP`` steps of the checkpoint: one member's far claim is not the run's), and (every PEERS_EVERY s) the addresses of the run's peers it is
        connected to, into the run memory; saved when it changed."""
        memory = dataclasses.replace(self.memory, live=any(r.role.trains for r in view.peers))
        for r in view.peers:
            applied = r.applied_step or 0
            if r.role.trains and not r.syncing and view.votes(r) and applied <= view.global_step \
                    and (self.step < 0 or applied - self.step < lineage.KEEP):
                memory = memory.saw(r.fingerprint)
        remembered = memory.peer_ids
        if time.monotonic() - self._peers_at >= PEERS_EVERY or \
                any(r.peer_id not in remembered and r.role != Role.CLIENT for r in view.peers if r.peer_id != self.peer.peer_id):
            self._peers_at = time.monotonic()
            try:
                connections = {p: c["addrs"] for p, c in self.peer.connections().items()}
            except DedlocError as e:
                logger.debug(f"could not list the connections: {e}")
                connections = {}
            memory = memory.with_peers(connections, {r.peer_id for r in view.peers})
        if memory != self.memory:
            self.memory = memory
            try:
                memory.save(self.memory_path)
            except OSError as e:
                logger.warning(f"could not save the run memory {self.memory_path}: {e}")

    def _refound(self, view: CollaborationView) -> bool:
        """Whether this backbone may serve and pull states: it is not looking for its run, or a trainer
        holds the newest step it saw (found), or none did for ``refind_timeout`` (the run ended there)."""
        if self.refinding_since is None:
            return True
        newest = max(self.step, self.memory.newest_step)  # the memory takes in what it reads meanwhile
        holder = next((r for r in view.peers if r.role.trains and not r.syncing
                       and (r.applied_step if r.applied_step is not None else r.step) >= newest), None)
        if holder is not None:
            logger.info(f"found the run again after {time.monotonic() - self.refinding_since:.1f} s: "
                        f"{holder.peer_id} holds step "
                        f"{holder.applied_step if holder.applied_step is not None else holder.step}")
        elif time.monotonic() - self.refinding_since >= self.config.refind_timeout:
            logger.warning(f"no trainer of the run holds step {newest} after {self.config.refind_timeout:.0f} s: the "
                           f"run ended there; serving the checkpoint of step {self.step}"
                           + (f" (steps {self.step + 1}-{newest} are lost)" if newest > self.step else ""))
            if self.held_bytes is not None:
                self._offer(self.store.path(self.step).read_bytes())
        else:
            return False
        self.refinding_since = None
        self._found = holder is not None
        return True

    def _offer(self, blob: bytes) -> None:
        self.peer.offer_state(self.step, blob, [f for _, f in sorted(self.history.items())])

    def _max_state_bytes(self) -> int | None:
        """A backbone has no model: it accepts states up to twice the one it holds plus 256 MiB
        (None, the protocol's cap, before its first)."""
        return None if self.held_bytes is None else 2 * self.held_bytes + (256 << 20)

    def pull(self) -> bool:
        """Download and checkpoint the newest state if the collaboration moved past ours; True if it did."""
        view = self._report()
        self.view = view
        if not self._refound(view):
            return False
        target = view.global_step
        if target <= self.step:
            return False
        if self._refused[0] != target:
            self._refused = (target, set())
        donors = [r.peer_id for r in view.trainers_at(target) if r.role == Role.TRAINER
                  and r.peer_id not in self._refused[1]]
        if not donors:
            return False
        random.shuffle(donors)
        votes = lineage.fingerprints(view)
        try:
            step, blob, donor = self.peer.download_state(donors, target, 60.0, self._max_state_bytes(), votes,
                                                         max_step=target + 1)
            history = lineage.of_state(snapshot.decode(blob))
        except DedlocError as e:
            logger.warning(f"could not pull the state of step {target}: {e}")
            return False
        if lineage.votes(history, view).outvoted(own=donor):  # its header may have hidden the fork
            logger.warning(f"the state of step {step} from {donor} rewrites step "
                           f"{lineage.first_conflict_of(history, votes)}, which the live peers took otherwise "
                           f"(a fork): not checkpointed")
            return False
        unattested = "" if self._found else self._unattested(step, history, view)
        if unattested:
            self._refused[1].add(donor)
            logger.warning(f"the state of step {step} from {donor} is not checkpointed: {unattested}")
            return False
        self._found = False
        rewritten = lineage.divergence(self.history, history)
        if rewritten is not None:
            logger.warning(f"the run's history changed: the checkpoint held (step {self.step}, "
                           f"{self.history.get(max(self.history))}) took step {rewritten} as {self.history[rewritten]}, "
                           f"the state of step {step} from {donor} as {history[rewritten]}, and the live peers "
                           f"hold the latter ({len(lineage.votes(history, view).agree)} against "
                           f"{len(lineage.votes(self.history, view).agree)}): following them")
        path = self.store.write(step, blob)
        self.step, self.held_bytes, self.history = step, len(blob), history
        self._offer(blob)
        self._report()
        logger.info(f"checkpoint of step {step} from {donor} written to {path} ({len(blob) / 1e6:.1f} MB)")
        return True

    def _unattested(self, step: int, history: dict[int, str], view: CollaborationView) -> str:
        """Why a pulled state of ``step`` (its lineage ``history``) is not one the run attests ("" if
        it is). It is if it continues a history this backbone saw: the checkpoint it holds, or the
        newest state its run memory saw trainers hold, within ``lineage.KEEP`` steps (a lineage
        reaches no further, so a donor cannot bridge a far jump); or if ``ATTEST`` trainers publish
        its fingerprint. A backbone with no checkpoint and no memory takes the first state. So a
        member left alone in the run cannot get a far step of its own checkpointed."""
        anchors = sorted({f for f in (self.history.get(self.step), self.memory.newest) if f})
        if not anchors:
            return ""
        for anchor in anchors:
            at = parse_fingerprint(anchor)[0]
            if 0 <= step - at < lineage.KEEP and history.get(at) == anchor:
                return ""
        head = history.get(step)
        holders = {r.peer_id for r in view.peers if r.role.trains and head and r.fingerprint == head}
        if len(holders) >= ATTEST:
            return ""
        return (f"it does not continue the history this backbone saw (the state of step "
                f"{', '.join(str(parse_fingerprint(a)[0]) for a in anchors)} within {lineage.KEEP} steps), and "
                f"{len(holders)} trainer(s) hold it (a far step of one member's own); waiting for the run to attest it")

    def account(self, view: CollaborationView | None = None) -> bool:
        """Take the aggregators' newest credits into the contribution ledger (monitor/ledger.py), and
        the peers' display names from ``view`` (the run loop's, just read; without one the progress
        records are read here), save it next to the checkpoints if it changed, and publish its table
        (and the checkpoints held) for monitors. True if the ledger changed."""
        try:
            raw = self.peer.read_records(["credits"] if view is not None else ["credits", "progress"])
        except DedlocError as e:
            logger.debug(f"could not read the credits: {e}")
            return False
        changed = self.ledger.observe(r for p, v in raw.get("credits", {}).items()
                                      if (r := CreditRecord.from_wire(p, v)) is not None)
        records = view.peers if view is not None else [r for p, v in raw.get("progress", {}).items()
                                                       if (r := ProgressRecord.from_wire(p, v)) is not None]
        changed = self.ledger.named(records) or changed
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
        """Pull and checkpoint every ``checkpoint_interval`` (sooner once the run is ``lineage.KEEP / 2``
        steps past the checkpoint) until ``stop`` is set; keeps the record alive."""
        next_pull = time.monotonic()
        refresh = max(1.0, self.peer.config.progress_ttl / 3)
        while not stop.is_set():
            looking = self.refinding_since is not None
            if time.monotonic() >= next_pull or looking:  # it pulls at once when it finds the run
                self.pull()
                if not looking or self.refinding_since is None:
                    next_pull = time.monotonic() + self.config.checkpoint_interval
            else:
                self.view = self._report()
                if self.step >= 0 and self.view.global_step - self.step >= lineage.KEEP // 2:
                    next_pull = time.monotonic()  # pulled before the run outruns a lineage (``_unattested``)
            self.account(self.view)
            stop.wait(LOOK_EVERY if self.refinding_since is not None else
                      min(refresh, max(0.05, next_pull - time.monotonic())))

    def in_background(self) -> "Pulling":
        """Run :meth:`run` in a daemon thread until the handle's ``stop()``."""
        return Pulling(self)

    def close(self) -> None:
        """Stop serving; a last read of the run's progress first records in the run memory whether
        trainers are still live (then a restart looks for them before serving its checkpoint)."""
        if self.dashboard is not None:
            self.dashboard.close()
        try:
            self._report()
        except Exception as e:
            logger.debug(f"no last read of the run's progress: {e!r}")
        self.peer.close()


class Pulling:
    """A backbone's :meth:`Backbone.run` in a daemon thread (``Backbone.in_background``)."""

    def __init__(self, backbone: Backbone):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=backbone.run, args=(self._stop,), name="backbone", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop after its current pull, waiting up to ``timeout`` s (idempotent)."""
        self._stop.set()
        self._thread.join(timeout)
