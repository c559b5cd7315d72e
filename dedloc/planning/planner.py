"""The planner of one peer: measures its links, publishes its capabilities, plans rounds it leads.

Lives in the runtime process. Owned background duties, cancelled by ``close()``:
- probe up to ``probe_peers`` random reachable peers every ``probe_interval`` seconds;
- publish this peer's :class:`CapabilityRecord` (expiring) every ``PUBLISH_INTERVAL`` seconds,
  and within ``MIN_PUBLISH`` seconds of a round that moved an estimate by more than ``REPUBLISH``;
- re-read everyone's records in the background when the leader's snapshot is older than
  ``MIN_REFRESH`` seconds. Plans are computed on demand by the matchmaking leader from that
  snapshot; the leader waits for a fresh one only when it is older than ``replan_interval``, or
  (at most every ``MIN_REFRESH`` seconds) while a member has no record or no measured rates in it.

Every member of a round uses the leader's plan, since the shares travel inside the Group.
A planning failure never fails a round: the leader falls back to equal shares and logs why.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time

from dedloc.averaging.round_core import RoundStats
from dedloc.averaging.group import Member
from dedloc.config import AveragingConfig
from dedloc.errors import ConfigError
from dedloc.net import links
from dedloc.net.bulk import busy_seconds
from dedloc.net.node import Node
from dedloc.net.transport import Transport
from dedloc.planning import lp
from dedloc.planning.estimate import LinkEstimates
from dedloc.planning.probe import ProbeResult, ProbeServer, probe
from dedloc.records import MAX_DIRECT, CapabilityRecord
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
PUBLISH_INTERVAL = 30.0
MIN_PUBLISH = 5.0
REPUBLISH = 0.25
FIRST_PROBE = 30.0
MIN_REFRESH = 10.0
MBIT = 1e6 / 8
PAIR_LIMIT = 0.25


class Planner:
    def __init__(self, node: Node, config: AveragingConfig, transport: Transport):
        """``transport``: the path probes take (the one round streams take: net/peer_connections.py)."""
        self.node, self.config, self.transport = node, config, transport
        self.me = node.peer_id.to_base58()
        up = config.upload_mbps * MBIT if config.upload_mbps is not None else None
        down = config.download_mbps * MBIT if config.download_mbps is not None else None
        self.links = LinkEstimates.create(up, down)
        self.samples_per_second = 0.0
        self.server = ProbeServer(node, transport)
        self.snapshot: dict[str, CapabilityRecord] = {}
        self._snapshot_time = -1e9
        self._last: lp.Plan | None = None
        self._tasks = Tasks("planner")
        self._refreshing: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._published: CapabilityRecord | None = None
        self._direct: tuple[str, ...] = ()
        """A private peer's peers with a direct connection to it, as of the last check."""

    async def start(self) -> None:
        await self.server.start()
        self._tasks.spawn(self._publish_loop(), name="dedloc-capabilities")
        if self.config.probe_interval > 0 and (self.config.upload_mbps is None or self.config.download_mbps is None):
            self._tasks.spawn(self._probe_loop(), name="dedloc-probes")

    async def close(self) -> None:
        await self._tasks.close()

    # ---- measurement ---------------------------------------------------------------------------
    def record(self) -> CapabilityRecord:
        return CapabilityRecord(self.me, self.links.upload.value(), self.links.download.value(),
                                self.links.pair_values(), self.node.config.client_mode, not self.node.reachable,
                                self._direct, self.config.aggregator_only, self.samples_per_second, time.time())

    def observe_round(self, stats: RoundStats) -> None:
        """Passive measurement from one averaging round: the bytes this peer sent (received) over
        the time at least one of its payloads was being sent (received). Payloads under the
        estimator's minimum size are left out: their time is mostly latency."""
        for estimate, transfers in ((self.links.upload, stats.sent), (self.links.download, stats.received)):
            big = [t for t in transfers if t.nbytes >= estimate.min_bytes]
            if big:
                estimate.observe(sum(t.nbytes for t in big), busy_seconds(big), passive=True)
        published = self._published
        if published is not None and any(
                abs(new - old) > REPUBLISH * old for new, old in ((self.links.upload.value(), published.upload),
                                                                 (self.links.download.value(), published.download))):
            self._changed.set()  # the publish loop sends it within MIN_PUBLISH seconds

    async def probe_now(self, peers: list[str] | None = None) -> ProbeResult | None:
        """Probe ``peers`` (default: well-connected and random reachable ones) and publish the new estimates."""
        if peers is None:
            await self.refresh()
            push_to, pull_from = self._probe_targets("download"), self._probe_targets("upload")
        else:
            push_to = pull_from = list(peers)
        if not push_to and not pull_from:
            return None
        n = int(self.config.probe_mb * (1 << 20))
        result = await probe(self.transport, self.node.config.run_id, push_to, pull_from, n)
        for peer, rate in result.pushed.items():
            self.links.observe_pair(peer, n, n / rate)
        if result.upload:
            self.links.upload.observe(n * len(result.pushed), n * len(result.pushed) / result.upload)
        if result.download:
            self.links.download.observe(n * len(result.pulled), n * len(result.pulled) / result.download)
        for peer, why in result.failed.items():
            logger.debug(f"probe of {peer} failed: {why}")
        logger.debug(f"probed: upload {result.upload / MBIT:.1f} Mbit/s to {len(result.pushed)} peers, "
                     f"download {result.download / MBIT:.1f} Mbit/s from {len(result.pulled)} peers")
        await self.publish()
        return result

    def _probe_targets(self, their: str) -> list[str]:
        """Reachable peers with the best known ``their`` rate (a slow far end would hide our own
        rate: push to fast downloaders, pull from fast uploaders), plus one at random."""
        k = self.config.probe_peers
        candidates = [r for p, r in self.snapshot.items() if p != self.me and not r.client]
        known = sorted((r for r in candidates if getattr(r, their) > 0), key=lambda r: -getattr(r, their))
        chosen = [r.peer_id for r in known[:max(0, k - 1)]]
        rest = [r.peer_id for r in candidates if r.peer_id not in chosen]
        return chosen + random.sample(rest, min(k - len(chosen), len(rest)))

    async def publish(self) -> None:
        rec = self.record()
        await self.node.store(self.node.key("caps"), self.me, rec.to_wire(), ttl=3 * PUBLISH_INTERVAL)
        self.snapshot[self.me] = self._published = rec

    async def _direct_peers(self) -> tuple[str, ...]:
        """Peers with a direct (not relayed) connection to this one: punched paths for a NAT'd peer."""
        conns = await links.connections(self.node.p2p)
        return tuple(sorted(p for p, addrs in conns.items() if not all(map(links.relayed, addrs)))[:MAX_DIRECT])

    async def _publish_loop(self) -> None:
        while True:
            self._changed.clear()
            try:
                await self.publish()
            except Exception as e:
                logger.debug(f"could not publish capabilities: {e!r}")
            await asyncio.sleep(MIN_PUBLISH)
            loop = asyncio.get_running_loop()
            until = loop.time() + PUBLISH_INTERVAL - MIN_PUBLISH
            while not self._changed.is_set() and loop.time() < until:
                if not self.node.reachable and not self.node.config.client_mode:
                    direct = await self._direct_peers()  # a new punched path: publish it soon
                    if direct != self._direct:
                        self._direct = direct
                        break
                try:
                    await asyncio.wait_for(self._changed.wait(), max(0.0, min(MIN_PUBLISH, until - loop.time())))
                except TimeoutError:
                    pass

    async def _probe_loop(self) -> None:
        # not at start-up, when the first rounds form: until then, unknown peers plan as equals
        await asyncio.sleep(random.uniform(FIRST_PROBE / 2, FIRST_PROBE))
        while True:
            try:
                await self.probe_now()
            except Exception as e:
                logger.debug(f"probing failed: {e!r}")
            await asyncio.sleep(self.config.probe_interval * random.uniform(0.8, 1.2))

    async def refresh(self) -> None:
        """Read everyone's capability records now."""
        entries = await self.node.get(self.node.key("caps"))
        snap = {p: r for p, (v, _) in entries.items() if (r := CapabilityRecord.from_wire(p, v)) is not None}
        snap[self.me] = self.record()
        self.snapshot, self._snapshot_time = snap, time.monotonic()

    async def _refresh_within(self, budget: float) -> None:
        """Re-read the records, waiting at most ``budget`` seconds: the leader plans between closing
        its group and answering its joiners, who give up at their deadline. A read past the budget
        goes on in the background, and this round plans with the snapshot it has (a read that reaches
        a frozen peer must not hold the leader's answers past its joiners' deadline: they would fail
        the step while the leader runs its round with members that left it)."""
        self._refresh_soon()
        try:
            await asyncio.wait_for(asyncio.shield(self._refreshing), budget)
        except asyncio.TimeoutError:
            logger.debug(f"capability records not read within {budget:.2f} s: planning with the snapshot in hand")

    def _refresh_soon(self) -> None:
        """Re-read the records in the background (one read at a time), off the round's critical path."""
        if self._refreshing is not None and not self._refreshing.done():
            return

        async def read() -> None:
            try:
                await self.refresh()
            except Exception as e:
                logger.debug(f"could not re-read capability records: {e!r}")

        self._refreshing = self._tasks.spawn(read(), name="dedloc-capabilities-read")

    def _unknown(self, peer: str) -> bool:
        """No record of ``peer`` in the snapshot, or one without measured rates yet (a newcomer
        publishes before its first probe): planned with the median until the next refresh."""
        rec = self.snapshot.get(peer)
        return rec is None or rec.upload <= 0 or rec.download <= 0

    # ---- planning ------------------------------------------------------------------------------
    def plan_peers(self, members: tuple[Member, ...]) -> tuple[list[lp.PlanPeer], dict[tuple[int, int], float]]:
        """The LP's view of ``members``: measured rates, unknown ones filled with the median of the known."""
        recs = [self.snapshot.get(m.peer_id) for m in members]
        known_up = [r.upload for r in recs if r is not None and r.upload > 0]
        known_down = [r.download for r in recs if r is not None and r.download > 0]
        fill_up = statistics.median(known_up) if known_up else 1.0
        fill_down = statistics.median(known_down) if known_down else 1.0
        peers = []
        for m, r in zip(members, recs):
            peers.append(lp.PlanPeer(
                m.peer_id, r.upload if r is not None and r.upload > 0 else fill_up,
                r.download if r is not None and r.download > 0 else fill_down,
                sends=m.weight > 0, receives=m.fetch,
                can_aggregate=m.share > 0 and not m.client and (not m.private or self._direct_to_all(m, r, members)),
                samples_per_second=r.samples_per_second if r is not None else 0.0))
        index = {m.peer_id: i for i, m in enumerate(members)}
        pairs = {}
        for i, r in enumerate(recs):
            for other, rate in ((r.pairs or {}).items() if r is not None else ()):
                j = index.get(other)
                # a probed pair rate is a lower bound taken while up to probe_peers streams shared
                # the link; only a path far slower than both of its ends is a real pairwise limit
                if j is not None and 0 < rate < PAIR_LIMIT * min(peers[i].upload, peers[j].download):
                    pairs[(i, j)] = rate
        return peers, pairs

    @staticmethod
    def _direct_to_all(m: Member, rec: CapabilityRecord | None, members: tuple[Member, ...]) -> bool:
        """A NAT'd member may aggregate only if its record shows a direct path to every other member:
        a member with no path to its aggregator would lose its part of the round."""
        direct = set(rec.direct) if rec is not None else set()
        return all(o.peer_id in direct for o in members if o.peer_id != m.peer_id)

    async def shares(self, members: tuple[Member, ...], numel: int) -> tuple[float, ...]:
        """The shares for one round among ``members``; equal shares (with a logged reason) on any failure.

        The vector's size on the wire follows the current compression setting (it may change at run time)."""
        mode = self.config.planner
        bytes_per_element = 2 if self.config.compression == "float16" else 4
        if mode == "declared":  # a NAT'd member's paths are not known to the peer that declared its share
            return tuple(0.0 if m.private else m.share for m in members)
        peers: list[lp.PlanPeer] = []
        try:
            if mode in ("lp", "bandwidth"):
                age = time.monotonic() - self._snapshot_time
                if age > self.config.replan_interval or (
                        age > MIN_REFRESH and any(self._unknown(m.peer_id) for m in members)):
                    await self._refresh_within(self.config.matchmaking_time / 4)
                elif age > MIN_REFRESH:
                    self._refresh_soon()  # this round plans with the snapshot it has, the next with a fresher one
            peers, pairs = self.plan_peers(members)
            if mode != "equal" and all(self._unknown(m.peer_id) for m in members):
                logger.debug(f"no link measured yet among {len(members)} peers: equal shares")
                return tuple(lp.equal_shares(peers))
            nbytes = max(1, numel) * bytes_per_element
            if mode == "equal":
                plan = lp.plan_with(peers, lp.equal_shares(peers), nbytes)
            elif mode == "bandwidth":
                plan = lp.plan_with(peers, lp.bandwidth_shares(peers), nbytes)
            else:
                plan = lp.choose(peers, nbytes, pairs)
        except ConfigError as e:
            logger.warning(f"planning failed ({e}); using equal shares")
            return tuple(lp.equal_shares(peers)) if peers else tuple(0.0 if m.private else m.share for m in members)
        self._log(plan, peers, nbytes)
        return plan.shares

    def _log(self, plan: lp.Plan, plan_peers: list[lp.PlanPeer], nbytes: int) -> None:
        last = self._last
        self._last = plan
        if last is not None and last.peer_ids == plan.peer_ids and last.strategy == plan.strategy and max(
                abs(a - b) for a, b in zip(last.shares, plan.shares)) < 0.05:
            return
        active = sum(1 for g in plan.shares if g > 0)
        logger.info(f"plan: {plan.strategy} over {len(plan.peer_ids)} peers ({active} aggregate), predicted "
                    f"{plan.predicted_s:.2f} s for {nbytes / 1e6:.1f} MB (solved in {plan.solve_s * 1e3:.0f} ms)")
        logger.debug("plan shares (Mbit/s up/down): " + ", ".join(
            f"..{p.peer_id[-6:]}={g:.3f} ({p.upload / MBIT:.0f}/{p.download / MBIT:.0f})"
            for p, g in zip(plan_peers, plan.shares)))

    @property
    def last_plan(self) -> lp.Plan | None:
        return self._last
