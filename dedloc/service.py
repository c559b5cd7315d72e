"""What runs in a peer's background process: the engine node, progress records and the averager.

The training process reaches these methods through :class:`dedloc.net.runtime.Runtime`; only
those declared in :class:`dedloc.peer_api.PeerAPI` can be called.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time
from typing import Any

from dedloc.averaging.averager import Averager
from dedloc.averaging.bounds import WeightBounds
from dedloc.averaging.outcome import RoundOutcome
from dedloc.averaging.round_core import RoundStats
from dedloc.config import AveragingConfig, PeerConfig
from dedloc.errors import ConfigError, DedlocError
from dedloc.logs import PerPeerWarnings
from dedloc.monitor.peer_metrics import PeerMetrics
from dedloc.net import links
from dedloc.net.node import Node
from dedloc.net.peer_connections import PeerConnections
from dedloc.net.runtime import SharedBuffer
from dedloc.net.tcp import DirectTCP
from dedloc.peer_api import PeerAPI
from dedloc.planning.planner import Planner
from dedloc.records import MAX_REPORTED_ROUNDS, CollaborationView, CreditRecord, ProgressRecord, Role, RoundReport
from dedloc.state.transfer import StateServer

logger = logging.getLogger(__name__)
_warnings = PerPeerWarnings(logger)
DRAIN_TIMEOUT = 10.0
ROUNDS_TTL = 600.0
CREDITS_TTL = 3600.0
"""A departed aggregator's credits stay readable this long (a backbone reads them every few seconds)."""
MONITORED = frozenset({"progress", "caps", "rounds", "credits", "ledger"})


class PeerService(PeerAPI):
    """The peer's background side: implements :class:`dedloc.peer_api.PeerAPI` (documented there)."""

    def __init__(self, node: Node, averager: Averager, states: StateServer, planner: Planner,
                 peers: PeerConnections, metrics: PeerMetrics):
        self.node, self.averager, self.states, self.planner, self.peers = node, averager, states, planner, peers
        self.metrics = metrics
        self.buffers: dict[str, SharedBuffer] = {}
        self._rounds: collections.deque[RoundReport] = collections.deque(maxlen=MAX_REPORTED_ROUNDS)
        self._publishing: asyncio.Task | None = None
        self._credits: dict[str, tuple[float, float, int]] = {}
        """What this peer credited each contributor with as an aggregator (records.CreditRecord)."""
        self._incarnation = os.urandom(8).hex()
        self._progress: tuple[dict[str, Any], float] | None = None
        """The last progress record published (and its ttl), kept alive while a download blocks."""

    @classmethod
    async def create(cls, peer_config: PeerConfig, averaging_config: AveragingConfig) -> "PeerService":
        node = await Node.create(peer_config)
        me, cfg = node.peer_id.to_base58(), averaging_config
        tcp = DirectTCP(me, cfg.encryption, node.sign, node.authorizer.proven) if cfg.transport != "libp2p" else None
        peers = PeerConnections(node.streams, tcp, peer_config.run_id, cfg.encryption)
        planner = Planner(node, cfg, peers)
        metrics = PeerMetrics()

        def on_round(stats: RoundStats) -> None:
            planner.observe_round(stats)
            metrics.transfers(sum(t.nbytes for t in stats.sent), sum(t.nbytes for t in stats.received))

        try:
            if peer_config.metrics_port > 0:
                metrics.serve(peer_config.metrics_host, peer_config.metrics_port)
            async def progress() -> CollaborationView:
                return CollaborationView.build(await _read_progress(node))

            averager = Averager(node, cfg, tcp, planner.shares, on_round, progress)
            await averager.start()  # starts tcp's listener
            await peers.start()
            states = StateServer(node, peers)
            await states.start()
            await planner.start()
        except BaseException:
            metrics.close()
            await planner.close()
            if tcp is not None:
                await tcp.close()
            await node.shutdown()
            raise
        how = node.reachability
        mode = "client mode" if peer_config.client_mode else \
            f"public: {how.how}" if how.public else f"private ({how.how}): reached through relays and hole punching"
        logger.info(f"joined run {peer_config.run_id!r} as {node.peer_id.to_base58()} ({mode})")
        return cls(node, averager, states, planner, peers, metrics)

    async def info(self) -> dict[str, Any]:
        return {"peer_id": self.node.peer_id.to_base58(), "maddrs": await self.node.visible_maddrs(),
                "client_mode": self.node.config.client_mode,
                "reachable": self.node.reachable, "reachability": self.node.reachability.how, "leftovers": self.node.socket_paths()}

    async def connections(self) -> dict[str, dict[str, Any]]:
        """This peer's open connections: peer id -> {"direct": any connection not through a relay,
        "addrs": the remote address of each}."""
        return {peer: {"direct": not all(map(links.relayed, addrs)), "addrs": addrs}
                for peer, addrs in (await links.connections(self.node.p2p)).items()}

    async def stream_counts(self) -> dict[str, int]:
        """Streams this peer opened outside rounds (states, probes), by path: ``direct``, ``libp2p``."""
        return dict(self.peers.counts)

    async def ping(self) -> float:
        return time.time()

    async def publish_progress(self, record: dict[str, Any], ttl: float) -> bool:
        self._progress = (record, ttl)
        return await self._store_progress(record, ttl)

    async def _store_progress(self, record: dict[str, Any], ttl: float) -> bool:
        if self.node.config.name:  # who this peer says it is, with every record whichever role made it
            record = {**record, "name": self.node.config.name}
        return await self.node.store(self.node.key("progress"), self.node.peer_id.to_base58(), record, ttl)

    async def read_progress(self) -> list[ProgressRecord]:
        """Everyone's live progress records (``_read_progress``)."""
        return await _read_progress(self.node)

    async def report(self, record: dict[str, Any], ttl: float) -> tuple[list[ProgressRecord], bool]:
        """Publish this peer's progress, then read everyone's; also says whether a newcomer wants our state."""
        await self.states.progress(int(record["step"]), record.get("syncing") is True)
        self.planner.samples_per_second = float(record.get("samples_per_second", 0.0))
        self.metrics.progress(record)
        await self.publish_progress(record, ttl)
        return await self.read_progress(), self.states.wanted

    async def leave(self, ttl: float) -> None:
        """Tell the others this peer left, so they stop waiting for it before its record expires.

        The mark holds the time of leaving: it hides only the records published before it."""
        await self.node.store(self.node.key("left"), self.node.peer_id.to_base58(), time.time(), ttl)

    async def offer_state(self, step: int, blob: bytes, history: list[str] | None = None) -> None:
        await self.states.offer(step, blob, history or ())

    async def download_state(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                             votes: dict[str, str] | None = None, max_step: int | None = None) -> tuple[int, bytes, str]:
        """Download a state (see StateServer.download). Meanwhile the last progress record is
        republished before it expires: a peer blocked in a download stays visible to the others
        (were its record to expire, a newcomer could take an older checkpoint for the collaboration's
        state and fork from it)."""
        keepalive = asyncio.create_task(self._keep_visible())
        try:
            found = await self.states.download(donors, min_step, timeout, max_bytes, votes, max_step)
            self.metrics.state_downloads.inc()
            return found
        finally:
            keepalive.cancel()
            await asyncio.gather(keepalive, return_exceptions=True)

    async def _keep_visible(self) -> None:
        while self._progress is not None:
            record, ttl = self._progress
            await asyncio.sleep(ttl / 3)
            if self._progress is not None and self._progress[0] is record:  # nothing newer was published
                try:
                    await self._store_progress(record, ttl)
                except Exception as e:
                    logger.debug(f"could not refresh the progress record: {e!r}")

    async def register_buffer(self, name: str, shm_name: str, numel: int) -> None:
        if name in self.buffers:
            self.buffers.pop(name).close()
        self.buffers[name] = SharedBuffer(numel, shm_name)

    async def average(self, name: str, step: int, weight: float, expected_peers: int | None = None,
                      timeout: float | None = None, gather_time: float | None = None,
                      bounds: WeightBounds | None = None) -> RoundOutcome:
        if name not in self.buffers:
            raise DedlocError(f"unknown buffer {name!r}")
        if bounds is not None and not isinstance(bounds, WeightBounds):
            raise DedlocError(f"bounds must be WeightBounds, got {type(bounds).__name__}")
        stats = await self.averager.average(self.buffers[name].tensor, step, weight, expected_peers, timeout,
                                            gather_time, bounds)
        self._report_round(stats)
        self.metrics.round(stats)
        return stats

    def _report_round(self, stats: RoundOutcome) -> None:
        """Add this round to this peer's round reports and, if it aggregated, to its credits
        (records.RoundReport, records.CreditRecord); both are published in the background."""
        plan = self.planner.last_plan
        predicted = plan.predicted_s if plan is not None and set(plan.peer_ids) == set(stats.peers) else 0.0
        self._rounds.append(RoundReport(
            self.node.peer_id.to_base58(), stats.round_id, stats.step, stats.peers, stats.shares, stats.strategy,
            stats.allreduce_s, stats.matchmaking_s, stats.failovers, predicted, time.time()))
        fraction = stats.accepted_fraction
        for peer, weight in stats.accepted.items():
            samples, rounds, _ = self._credits.get(peer, (0.0, 0.0, 0))
            self._credits[peer] = (samples + fraction * weight, rounds + fraction, stats.step)
        if self._publishing is None or self._publishing.done():
            self._publishing = asyncio.create_task(self._publish_rounds())

    async def _publish_rounds(self) -> None:
        """Store the reports and credits until the newest are stored (rounds that end meanwhile are included)."""
        stored = None
        me = self.node.peer_id.to_base58()
        while self._rounds and self._rounds[-1] is not stored:
            stored = self._rounds[-1]
            try:
                await self.node.store(self.node.key("rounds"), me, [r.to_wire() for r in reversed(self._rounds)],
                                      ROUNDS_TTL)
                if self._credits:
                    await self.node.store(self.node.key("credits"), me,
                                          CreditRecord(me, self._incarnation, dict(self._credits)).to_wire(),
                                          CREDITS_TTL)
            except Exception as e:
                logger.debug(f"could not publish round reports: {e!r}")

    async def read_records(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """The run's DHT records under each of ``names`` (``progress``, ``caps``, ``rounds``,
        ``credits``, ``ledger``): name -> {subkey: value} (for the monitor's dashboard in a peer's process)."""
        if not set(names) <= MONITORED:
            raise DedlocError(f"only {sorted(MONITORED)} can be read, not {sorted(set(names) - MONITORED)}")
        found = await asyncio.gather(*(self.node.get(self.node.key(n)) for n in names))
        out = {n: {k: v for k, (v, _) in f.items()} for n, f in zip(names, found)}
        if "progress" in out:  # a member's claim of the backbone role shows as nobody's (``_counted``)
            out["progress"] = {k: v for k, v in out["progress"].items()
                               if (r := ProgressRecord.from_wire(k, v)) is None or _counted(self.node, r)}
        return out

    async def publish_record(self, name: str, value: Any, ttl: float) -> bool:
        """Store ``value`` under this peer's subkey of the run's record ``name`` (only ``ledger``)."""
        if name != "ledger":
            raise DedlocError(f"only the ledger record can be published this way, not {name!r}")
        return await self.node.store(self.node.key(name), self.node.peer_id.to_base58(), value, ttl)

    async def rejoin(self, maddrs: list[str], timeout: float) -> list[str]:
        """Reconnect to the run's peers at ``maddrs`` (``Node.rejoin``); the peer ids that answered."""
        return await self.node.rejoin(maddrs, timeout)

    async def probe(self, peers: list[str] | None = None) -> dict[str, Any]:
        """Probe ``peers`` now (default: a few random ones) and publish the new estimates."""
        result = await self.planner.probe_now(peers)
        return {} if result is None else dict(vars(result))

    async def capabilities(self) -> dict[str, Any]:
        """Everyone's published capabilities (as read now), and the last plan this peer made as a leader."""
        await self.planner.refresh()
        plan = self.planner.last_plan
        return {"peers": {p: r.to_wire() for p, r in self.planner.snapshot.items()},
                "plan": None if plan is None else {"peers": list(plan.peer_ids), "shares": list(plan.shares),
                                                   "strategy": plan.strategy, "predicted_s": plan.predicted_s}}

    async def reconfigure(self, changes: dict[str, Any]) -> None:
        """Change how rounds this peer leads are planned and run (``planner``, ``strategy``, ``compression``)."""
        allowed = {"planner", "strategy", "compression"}
        if not set(changes) <= allowed:
            raise ConfigError(f"only {sorted(allowed)} can change at run time, not {sorted(set(changes) - allowed)}")
        config = dataclasses.replace(self.averager.config, **changes).validate()
        self.averager.reconfigure(config)
        self.planner.config = config

    async def pending_round(self, step: int) -> int:
        return await self.averager.matchmaker.pending_numel(step)

    async def closed_round(self, step: int) -> dict[str, list[str]]:
        return await self.averager.matchmaker.closed_round(step)

    async def round_deadline(self, step: int) -> float | None:
        return await self.averager.matchmaker.round_deadline(step)

    async def shutdown(self, drain: bool = True) -> None:
        """Leave: finish serving parts others still read from us (``drain``, bounded), then stop.
        Without ``drain`` (the training process died), stop at once: its peer id is free for a restart."""
        if drain:
            await self.averager.drain(DRAIN_TIMEOUT)
        if self._publishing is not None:
            self._publishing.cancel()
            await asyncio.gather(self._publishing, return_exceptions=True)
        await self.averager.close()
        await self.planner.close()
        if self.peers.tcp is not None:
            await self.peers.tcp.close()
        for buf in self.buffers.values():
            buf.close()
        self.metrics.close()
        await self.node.shutdown()
        logger.info(f"left the collaboration ({self.node.peer_id.to_base58()})")


async def _read_progress(node: Node) -> list[ProgressRecord]:
    """Everyone's live progress records, less those published before their peer announced leaving
    (a peer restarted under the same identity is visible again from its first new record), and
    less the backbone records of members the run does not let act as one (``_counted``)."""
    entries, left = await asyncio.gather(node.get(node.key("progress")), node.get(node.key("left")))
    records = [r for p, (v, _) in entries.items()
               if (r := ProgressRecord.from_wire(p, v)) is not None and not _left_after(left.get(p), r)
               and _counted(node, r)]
    node.saw(r.peer_id for r in records if r.role != Role.CLIENT)  # DHT servers to stay in touch with
    return records


def _counted(node: Node, record: ProgressRecord) -> bool:
    """Whether ``record`` may count: a backbone's checkpoint step moves the run's step
    (records.py ``global_step``), so in an invite-only run it is read only from a member whose
    invitation lets it be one (auth/authorizer.py ``may_be_backbone``)."""
    if record.role != Role.BACKBONE or record.peer_id == node.peer_id.to_base58() \
            or node.authorizer.may_be_backbone(record.peer_id):
        return True
    _warnings.warn(record.peer_id, f"peer {record.peer_id} publishes a backbone's record (step {record.step}), but its "
                                   f"invitation does not let it act as one (`dedloc invite --backbone`): not counted")
    return False


def _left_after(mark: tuple[Any, float] | None, record: ProgressRecord) -> bool:
    """Whether a "left" mark hides ``record``: it was published no later than the peer left."""
    if mark is None:
        return False
    left_at = mark[0]
    if isinstance(left_at, bool) or not isinstance(left_at, (int, float)):
        return True  # a mark without a time hides every record of that peer until it expires
    return record.time <= left_at


async def create(peer_config: PeerConfig, averaging_config: AveragingConfig) -> PeerService:
    return await PeerService.create(peer_config, averaging_config)
