"""The averaging service of one peer: matchmaking, then the round, for each requested step.

Runs inside the runtime process. ``average()`` is the one entry point; incoming streams are
dispatched to the round they name. Guarantees (beyond those of the rounds):
- the caller's tensor is overwritten only when the whole round succeeded;
- every call returns or raises within matchmaking (about 2x matchmaking_time) plus the round's
  timeout, which the leader sets for every member (the smallest that a member asked for: its
  averaging_timeout, or the timeout its caller passed), so no member gives up on a round another
  still serves; a round that fails
  at the peer that led it takes up to one more matchmaking_time, to withdraw its closed record
  (matchmaking rule 5);
- a stream naming an unknown round, or with a malformed header, is answered with an ERROR
  frame and a logged reason naming the peer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import torch
from hivemind.utils.multiaddr import Multiaddr

from dedloc.averaging.allreduce import PartitionedRound, RoundStats
from dedloc.averaging.bounds import WeightBounds, weight_ok
from dedloc.averaging.buffers import BufferPool
from dedloc.averaging.group import Group, sub_round_id
from dedloc.averaging.matchmaking import Matchmaker, SharePolicy
from dedloc.averaging.outcome import RoundOutcome
from dedloc.averaging.ring import RingRound
from dedloc.averaging.round_core import OpenStream
from dedloc.averaging.wire import UNKNOWN_ROUND, Header, Kind, read_header, read_payload_into, write_error, write_frame
from dedloc.config import AveragingConfig
from dedloc.errors import AveragingError, ProtocolError
from dedloc.net.node import Node
from dedloc.net.reachability import observed_ip
from dedloc.net.messages import wait_peer_closed
from dedloc.net.tcp import DirectTCP, RoundConnections
from dedloc.net.transport import Handler, StreamPair, Transport
from dedloc.numerics import all_finite
from dedloc.records import CollaborationView
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
ROUND_GRACE = 30.0


class _Round(Protocol):
    async def handle(self, peer_id: str, header: Header, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Serve one stream; True if this side wrote last (the peer must close first)."""

    def close(self) -> None:
        """Cancel the round's timers and tasks (it serves nothing more)."""


class _Broadcast:
    """A subgroup representative's final result, fetched by the subgroup's members."""

    def __init__(self, members: set[str], chunk_bytes: int):
        self.members, self.chunk_bytes = members, chunk_bytes
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handle(self, peer_id: str, header: Header, reader, writer) -> bool:
        if peer_id not in self.members or header.kind != Kind.FETCH:
            await write_error(writer, header.round_id, "not a member of this subgroup")
            return True
        try:
            result, weight = await asyncio.shield(self.result)
        except Exception as e:
            await write_error(writer, header.round_id, f"top-level reduce failed: {e}")
            return True
        await write_frame(writer, Kind.RESULT, header.round_id, 0, weight, result, self.chunk_bytes, reader)
        return True

    def close(self) -> None:
        if not self.result.done():
            self.result.cancel()


@dataclass
class _Served:
    """A round this peer serves: the round, its direct-connection secret (b"": libp2p only) and
    members, and the timer that closes it."""

    round: _Round
    key: bytes
    members: frozenset[str]
    expiry: asyncio.TimerHandle


class _RoundStreams(Transport):
    """libp2p streams as rounds see them: a refusal (the peer is not a member to us, or we are over
    its limits) raises ConnectionError with the peer's reason, like a peer the daemon cannot reach,
    so every round handles it as the broken connection it is."""

    def __init__(self, streams: Transport):
        self.streams = streams

    async def open(self, peer_id: str, protocol: str) -> StreamPair:
        try:
            return await self.streams.open(peer_id, protocol)
        except ProtocolError as e:
            raise ConnectionError(str(e)) from None

    async def serve(self, protocol: str, handler: Handler) -> None:
        await self.streams.serve(protocol, handler)


class Averager:
    """One peer's averaging: call ``average`` once per step with that step's tensor."""

    def __init__(self, node: Node, config: AveragingConfig, tcp: DirectTCP | None = None,
                 policy: SharePolicy | None = None, on_round: Callable[[RoundStats], None] | None = None,
                 progress: Callable[[], Awaitable[CollaborationView]] | None = None):
        """``tcp``: this peer's direct connections (None: round streams use libp2p only); the
        averager starts its listener, which admits rounds' members, and the caller closes it.
        ``policy`` sets the shares of rounds this peer leads (None: the members' declared shares);
        ``on_round(stats)`` is told what each round (or subround) sent and received, for bandwidth
        estimates. ``progress()``: the live progress records, for matchmaking's rules 10 and 11."""
        self.node, self.config = node, config.validate()
        if config.aggregator_only and not node.reachable:
            raise AveragingError("an aggregator-only peer must accept connections from every peer (it cannot be in "
                                 f"client mode or behind NAT; here: {node.reachability.how})")
        share = config.share if config.share is not None else (0.0 if node.config.client_mode else 1.0)
        self.matchmaker = Matchmaker(node, config, share, policy, progress)
        self.on_round = on_round
        self.pool = BufferPool()  # receive buffers and partial sums, reused across rounds
        self.me = node.peer_id.to_base58()
        self.proto = f"dedloc.{node.config.run_id}.allreduce"
        self._rounds: dict[bytes, _Served] = {}
        """The rounds this peer serves, by round id."""
        self._arrivals: dict[bytes, asyncio.Event] = {}
        """Streams waiting for a round not registered yet (``_lookup``)."""
        self._serving = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._reporters = Tasks("round reports")
        """Passive measurements waiting for their round to finish sending (bounded by its deadline)."""
        self._libp2p = _RoundStreams(node.streams)
        self.tcp = tcp
        """Direct connections for round streams (None: libp2p streams only; net/tcp.py)."""

    async def start(self) -> None:
        await self.matchmaker.start()
        if not self.node.config.client_mode:
            await self._libp2p.serve(self.proto, self._on_stream)
        if self.tcp is None:
            return
        where = await self._data_address() if self.node.reachable else None
        if where is not None:
            await self.tcp.serve(self.proto, self._on_stream)
            endpoint = await self.tcp.listen(*where, self.config.data_port, self._round_key)
            self.matchmaker.data = endpoint.to_wire()

    async def _data_address(self) -> tuple[str, str] | None:
        """(address to bind, address to announce) for direct connections: the host the daemon listens
        on, announced as the address it announces (a non-loopback one if it has one)."""
        def ip4(maddr: str) -> ipaddress.IPv4Address | None:
            ip = observed_ip(Multiaddr(maddr))
            return ipaddress.IPv4Address(ip) if ip is not None and "." in ip else None

        bind = next((h for h in map(ip4, self.node.config.listen_maddrs()) if h), None)
        seen = [h for h in map(ip4, await self.node.visible_maddrs()) if h and not h.is_unspecified]
        if bind is None or not seen:
            logger.info("no IPv4 address to announce for direct connections; round streams use libp2p")
            return None
        outside = [h for h in seen if not h.is_loopback]
        return str(bind), str((outside or seen)[0])

    async def _round_key(self, round_id: bytes) -> tuple[bytes, frozenset[str]] | None:
        """The secret and members of a round this peer serves (waiting briefly for it to start)."""
        if round_id not in self._rounds:
            await self._lookup(round_id, 2 * self.config.matchmaking_time)
        served = self._rounds.get(round_id)
        return (served.key, served.members) if served is not None and served.key else None

    def _opener(self, group: Group, outcome: RoundOutcome) -> OpenStream:
        """How this round reaches a member: a direct connection where the group and the member allow
        it, else (or if it fails) a libp2p stream (net/tcp.RoundConnections); counted in ``outcome.streams``."""
        rt = RoundConnections(self.tcp, group.round_id, group.key, {m.peer_id: m.data for m in group.members},
                              group.encryption, self._libp2p, outcome.streams)
        return lambda peer_id: rt.open(peer_id, self.proto)

    def reconfigure(self, config: AveragingConfig) -> None:
        """Run the rounds this peer leads from now on with ``config`` (validated; it changes only how
        they are planned and run: ``strategy``, ``compression``, ``planner``)."""
        self.config = self.matchmaker.config = config

    # ---- round registry -------------------------------------------------------------------------
    def _register(self, round_id: bytes, rnd: _Round, lifetime: float, group: Group) -> None:
        """Serve ``rnd``'s streams for ``lifetime`` seconds (its deadlines and a grace for late
        streams), then close it: the averager owns every round, and no timer or task outlives it.
        ``group``: the round's (or its parent's) members and direct-connection secret."""
        expiry = asyncio.get_running_loop().call_later(lifetime, self._expire, round_id)
        self._rounds[round_id] = _Served(rnd, group.key, frozenset(m.peer_id for m in group.members), expiry)
        self._arrivals.pop(round_id, asyncio.Event()).set()

    def _expire(self, round_id: bytes) -> None:
        """Stop serving the round and close it (from its timer, or early at shutdown)."""
        served = self._rounds.pop(round_id, None)
        if served is not None:
            served.expiry.cancel()  # a no-op when the timer itself fired
            served.round.close()

    async def close(self) -> None:
        """Close every round still registered (at shutdown, after drain)."""
        for round_id in list(self._rounds):
            self._expire(round_id)
        await self._reporters.close()
        await self.matchmaker.close()

    async def _lookup(self, round_id: bytes, wait: float) -> _Round | None:
        if round_id not in self._rounds:
            event = self._arrivals.setdefault(round_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), wait)
            except asyncio.TimeoutError:
                self._arrivals.pop(round_id, None)
        served = self._rounds.get(round_id)
        return served.round if served is not None else None

    async def drain(self, timeout: float) -> bool:
        """Wait (bounded) until no stream is being served and every round this peer aggregated has
        delivered its part to every member (or passed its result deadline, after which members
        fetch from the backup): a peer leaving right after its step still serves slower members.
        True if that happened in time."""
        async def settled() -> None:
            while True:  # a stream may start while we wait: check both again until both hold at once
                unserved = [r.round.served for r in self._rounds.values()
                            if isinstance(r.round, PartitionedRound) and not r.round.served.is_set()]
                if self._idle.is_set() and not unserved:
                    return
                await asyncio.gather(self._idle.wait(), *(e.wait() for e in unserved))

        try:
            await asyncio.wait_for(settled(), timeout)
            await self._reporters.wait()  # served: they finish at once
            return True
        except asyncio.TimeoutError:
            self._reporters.cancel()
            logger.info(f"left while {self._serving} stream(s) were still being served (gave up after {timeout:.0f} s)")
            return False

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._serving += 1
        self._idle.clear()
        try:
            await self._serve_stream(info, reader, writer)
        finally:
            self._serving -= 1
            if not self._serving:
                self._idle.set()

    async def _serve_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        wrote_last = False
        try:
            header = await asyncio.wait_for(read_header(reader), 30)
            rnd = await self._lookup(header.round_id, 2 * self.config.matchmaking_time)
            if rnd is None:
                logger.warning(f"peer {peer} sent a {header.kind.name} for an unknown round; refused")
                await write_error(writer, header.round_id, UNKNOWN_ROUND)
                wrote_last = True
                return
            wrote_last = await rnd.handle(peer, header, reader, writer)
        except ProtocolError as e:  # tell the member why, then let the serving helper log it
            try:
                await write_error(writer, bytes(16), str(e))
                wrote_last = True
            except Exception:
                pass
            raise
        finally:  # waited here, not by the helper, so that drain() counts it as serving
            if wrote_last:  # closing first could make the daemon drop the tail of what we wrote
                await wait_peer_closed(reader, self.config.averaging_timeout)

    # ---- the entry point ----------------------------------------------------------------------------
    async def average(self, tensor: torch.Tensor, step: int, weight: float, expected_peers: int | None = None,
                      timeout: float | None = None, gather_time: float | None = None,
                      bounds: WeightBounds | None = None) -> RoundOutcome:
        """Average ``tensor`` (flat, float32, CPU) in place with this step's group.

        Returns the round's outcome: members, weights, excluded peers, failovers and timings.
        Raises MissedRoundError / MatchmakingError / AveragingError; the tensor is then untouched.
        """
        if tensor.dtype != torch.float32 or tensor.dim() != 1 or tensor.device.type != "cpu":
            raise AveragingError(f"expected a flat float32 CPU tensor, got {tensor.dtype} {tuple(tensor.shape)} "
                                 f"on {tensor.device}")
        if not weight_ok(weight):
            raise AveragingError(f"weight must be finite, >= 0 and at most 2^40, got {weight}")
        if self.config.aggregator_only and weight != 0:
            raise AveragingError(f"an aggregator-only peer contributes nothing; got weight {weight}")
        if weight > 0 and not all_finite(tensor):
            raise AveragingError(f"step {step}: local tensor has NaN or inf values; refusing to send it")
        timeout = timeout or self.config.averaging_timeout
        t0 = time.perf_counter()
        group = await self.matchmaker.form_group(step, weight, expected_peers, gather_time, tensor.numel(), timeout,
                                                 bounds)
        timeout = group.timeout or timeout  # the leader's: every member gives up on the round together
        t1 = time.perf_counter()
        me = group.index(self.me)
        stats = RoundOutcome(step, group.round_id.hex(), tuple(m.peer_id for m in group.members),
                             tuple(m.weight for m in group.members), tuple(m.share for m in group.members),
                             group.strategy)
        try:
            output, total = await self._run(group, me, tensor, weight, timeout, stats)
        except Exception:
            await self.matchmaker.round_failed(step, group)  # the others must not wait on this group
            raise
        if group.members[me].fetch:
            tensor.copy_(output)
        stats.total_weight, stats.matchmaking_s, stats.allreduce_s = total, t1 - t0, time.perf_counter() - t1
        logger.info(f"step {step} averaged with {len(group.members)} peers in {time.perf_counter() - t0:.2f} s"
                    + (f" ({stats.failovers} failovers, excluded {sorted(stats.excluded)})"
                       if stats.failovers or stats.excluded else ""))
        return stats

    async def _run(self, group: Group, me: int, tensor: torch.Tensor, weight: float, timeout: float,
                   stats: RoundOutcome) -> tuple[torch.Tensor, float]:
        """The round itself, by the group's strategy: (the averaged vector, its total weight)."""
        if len(group.members) == 1:
            return tensor.clone(), weight
        if group.strategy == "ring":
            rnd = RingRound(group, me, tensor, weight, self._opener(group, stats), timeout, self.config.chunk_bytes)
            self._register(group.round_id, rnd, timeout + ROUND_GRACE, group)
            try:
                out = await rnd.run()
                stats.accepted = {m.peer_id: m.weight for m in group.members}  # each member reduces 1/n
                stats.contributors = tuple(m.peer_id for m in group.members if m.weight > 0)  # all or nobody
                stats.accepted_fraction = 1 / len(group.members)
                return out, group.total_weight
            finally:
                self._observed(rnd.stats, stats)
        if group.subgroups:  # no one member sees every subgroup's contributors
            return await self._hierarchical(group, me, tensor, weight, timeout, stats)
        return await self._partitioned(group, me, tensor, weight, timeout, stats, agreed=True)

    async def _partitioned(self, group: Group, me: int, local: torch.Tensor, weight: float, timeout: float,
                           stats: RoundOutcome, agreed: bool = False, credits: bool = True) -> tuple[torch.Tensor, float]:
        """One partitioned round; with ``agreed`` (a flat group), ``stats.contributors`` names the one
        contributor set all its parts averaged. With ``credits``, what it aggregated goes into
        ``stats.accepted`` (not for a hierarchical round's top round, whose contributors are the
        subgroups' representatives, not peers)."""
        rnd = PartitionedRound(group, me, local, weight, self._opener(group, stats), timeout, group.compression,
                               self.config.chunk_bytes, self.pool)
        self._register(group.round_id, rnd, timeout + ROUND_GRACE, group)
        try:
            output = await rnd.run()
        finally:
            stats.failovers += rnd.stats.failovers
            stats.verified += rnd.stats.verified
            stats.excluded.update(rnd.stats.excluded)
            if credits:
                stats.accepted, stats.accepted_fraction = dict(rnd.stats.accepted), rnd.stats.accepted_fraction
            self._observed(rnd.stats, stats, rnd.served)
        if agreed and rnd.stats.contributors is not None:
            stats.contributors = tuple(group.members[i].peer_id for i in rnd.stats.contributors)
        weights = rnd.stats.part_weights
        total = min(weights.values()) if weights else weight
        return output, total

    def _observed(self, rnd: RoundStats, stats: RoundOutcome, served: asyncio.Event | None = None) -> None:
        """Record the round's queueing delay now; tell ``on_round`` once this member has sent all it
        will send in the round (``served``: an aggregator's results may still be going out)."""
        stats.queue_s = max(stats.queue_s, rnd.queue_s)
        if self.on_round is None:
            return
        if served is None or served.is_set():
            self._report(rnd)
        else:  # served is set by the round's result deadline at the latest
            self._reporters.spawn(self._report_when(served, rnd), name="dedloc-round-report")

    async def _report_when(self, served: asyncio.Event, rnd: RoundStats) -> None:
        await served.wait()
        self._report(rnd)

    def _report(self, rnd: RoundStats) -> None:
        try:
            self.on_round(rnd)
        except Exception as e:  # a measurement must never fail a round
            logger.debug(f"round observer failed: {e!r}")

    async def _hierarchical(self, group: Group, me: int, local: torch.Tensor, weight: float, timeout: float,
                            stats: RoundOutcome) -> tuple[torch.Tensor, float]:
        """Reduce within subgroups, then among their representatives, then fetch from the representative."""
        k = group.subgroup_of(me)
        sub = group.subgroup(k)
        rep = group.representative(k)
        final_id = sub_round_id(group.round_id, f"final{k}")
        broadcast = None
        if me == rep:
            broadcast = _Broadcast({group.members[i].peer_id for i in group.subgroups[k]} - {self.me},
                                   self.config.chunk_bytes)
            self._register(final_id, broadcast, timeout + ROUND_GRACE, group)
        try:
            sub_out, total = await self._partitioned(sub, sub.index(self.me), local, weight, timeout / 3, stats)
            if not group.members[me].fetch:  # aggregator-only: its work ends with its subgroup
                return sub_out, total
            if me != rep:
                return await self._fetch(group, rep, final_id, local.numel(), timeout / 3, stats)
            declared = {group.representative(j): sum(group.members[i].weight for i in group.subgroups[j])
                        for j in range(len(group.subgroups))}
            top = group.top_group(declared)
            out, total = await self._partitioned(top, top.index(self.me), sub_out, declared[rep], timeout / 3, stats,
                                                 credits=False)
            broadcast.result.set_result((out, total))
            return out, total
        except BaseException as e:
            if broadcast is not None and not broadcast.result.done():
                broadcast.result.set_exception(AveragingError(str(e)))
                broadcast.result.exception()  # mark retrieved
            raise

    async def _fetch(self, group: Group, rep: int, final_id: bytes, numel: int, timeout: float,
                     stats: RoundOutcome) -> tuple[torch.Tensor, float]:
        peer = group.members[rep].peer_id
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await self._opener(group, stats)(peer)
                try:
                    await write_frame(writer, Kind.FETCH, final_id)
                    header = await read_header(reader)
                    if header.kind != Kind.RESULT:
                        raise ProtocolError(f"representative {peer} answered {header.kind.name}")
                    out = torch.empty(numel, dtype=torch.float32)
                    await read_payload_into(reader, writer, header, out)
                    return out, header.weight
                finally:
                    writer.close()
        except Exception as e:
            raise AveragingError(f"step {group.step}: could not fetch the result from representative {peer}: "
                                 f"{type(e).__name__}: {e}") from None
