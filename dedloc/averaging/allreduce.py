"""Partitioned all-reduce (reduce-scatter and all-gather, streamed into each other) with failover of parts.

Member ``j`` with share > 0 aggregates part ``j`` of the vector (boundaries from the shares).
Every member opens two streams per other aggregator: one sends its part-``j`` contribution, the
other pulls the averaged part, which the aggregator streams segment by segment as soon as every
contributor's segment is in (dedloc.averaging.streamed_part). Members open every stream, so
client-mode peers (which accept no connections) take full part. See docs/averaging.md for the
protocol and its failure semantics.

Guarantees:
- the result is the sample-weighted mean over the contributions that arrived, renormalised;
  each part is computed by exactly one peer and copied to all, so all members hold identical values;
- a sender that dies, stalls or sends a bad contribution (size, dtype, weight, NaN/inf) before
  its aggregator fixed the part's contributors is excluded (with a logged reason naming the
  peer); after that, the aggregator abandons the part, cuts its result streams, and every
  member fails the part over to its backup, which re-reduces it without the failed sender;
- an aggregator that dies is replaced by the next aggregator (its backup), which serves the
  aggregator's result if it got it and otherwise re-reduces the part from re-sent contributions.
  The aggregator sends its result to all members at once, but holds back the last credit unit of
  every copy except the backup's until the backup ACKs: nobody else can complete the part first;
- if a part cannot be obtained, ``run()`` raises AveragingError before the round deadline and
  the caller's tensor is untouched (results go to a separate output buffer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import torch

from dedloc.averaging.accumulator import PartAccumulator
from dedloc.averaging.buffers import BufferPool
from dedloc.averaging.group import Group
from dedloc.averaging.streamed_part import PartAbandoned, StreamedPart
from dedloc.averaging.wire import (Header, Kind, ProtocolError, check_payload, read_error_text, read_header,
                                   read_payload_into, write_error, write_frame)
from dedloc.errors import AveragingError
from dedloc.net.bulk import Transfer, busy_seconds
from dedloc.net.rpc import wait_peer_closed
from dedloc.numerics import all_finite

logger = logging.getLogger(__name__)
ACK_GRACE = 10.0

OpenStream = Callable[[str], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class RoundStats:
    def __init__(self) -> None:
        self.failovers = 0
        self.excluded: dict[str, str] = {}
        self.part_weights: dict[int, float] = {}
        self.sent: list[Transfer] = []
        """Every payload this member sent (credited), for passive upload measurement."""
        self.received: list[Transfer] = []
        """Every payload this member received, for passive download measurement."""

        self.payloads: list[tuple[str, Transfer]] = []
        """Every payload with a label, for the DEBUG timeline: ``c3>3`` a contribution to part 3
        sent to member 3, ``r3<3`` part 3's result received from member 3, ``f`` a failover
        contribution, ``s4>`` / ``s4<`` ring step 4 sent / received."""

    def add_sent(self, transfer: Transfer | None, label: str) -> None:
        if transfer is not None:
            self.sent.append(transfer)
            self.payloads.append((label, transfer))

    def add_received(self, transfer: Transfer, label: str) -> None:
        self.received.append(transfer)
        self.payloads.append((label, transfer))

    def timeline(self, t0: float) -> str:
        """One line for the DEBUG log: what moved, and when (seconds since ``t0``)."""
        def span(ts: list[Transfer]) -> str:
            if not ts:
                return "nothing"
            return (f"{sum(t.nbytes for t in ts) / 1e6:.1f} MB in {len(ts)} payloads, {busy_seconds(ts):.2f} s busy, "
                    f"{min(t.start for t in ts) - t0:.2f}..{max(t.end for t in ts) - t0:.2f} s")
        each = " ".join(f"{label} {t.start - t0:.1f}-{t.end - t0:.1f}" for label, t in self.payloads)
        return f"sent {span(self.sent)}; received {span(self.received)}; payloads {each}"

    @property
    def queue_s(self) -> float:
        """The longest queueing delay a payload this member sent saw (write to credit; dedloc.net.bulk)."""
        return max((t.queue_s for t in self.sent), default=0.0)


class _Unconfirmed(Exception):
    """The backup did not confirm this aggregator's result: nobody else may complete it."""


class _Failover:
    def __init__(self, acc: PartAccumulator):
        self.acc = acc
        self.ready = asyncio.Event()
        self.error: str | None = None


class PartitionedRound:
    """One member's side of one partitioned all-reduce round."""

    def __init__(self, group: Group, me: int, local: torch.Tensor, weight: float, open_stream: OpenStream,
                 timeout: float, compression: str = "none", chunk_bytes: int = 4 << 20,
                 pool: BufferPool | None = None):
        self.group, self.me, self.local, self.weight = group, me, local, weight
        self.open_stream, self.chunk_bytes = open_stream, chunk_bytes
        self.pool = pool or BufferPool(0)
        self.wire_dtype = torch.float16 if compression == "float16" else torch.float32
        self.bounds = group.part_bounds(local.numel())
        self.output = torch.empty_like(local)
        self.stats = RoundStats()
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._t0 = time.monotonic()
        self._reduced_at = 0.0
        self.start_deadline = start + 0.25 * timeout  # every contribution stream opens at the round's start
        self.reduce_deadline = start + 0.5 * timeout  # contributions stream until near the end: results follow them
        self.result_deadline = start + 0.6 * timeout
        self.failover_deadline = start + 0.85 * timeout
        self.deadline = start + timeout
        self.aggregators = group.aggregators
        self.senders = {i for i, m in enumerate(group.members) if m.weight > 0}
        self._have = {j: loop.create_future() for j in self.aggregators}
        self._failovers: dict[int, _Failover] = {}
        self._failover_tasks: list[asyncio.Task] = []
        self.part: StreamedPart | None = None
        self._timers: list[asyncio.TimerHandle] = []
        if me in self.aggregators:
            s, e = self.bounds[me]
            out = self.output[s:e]
            # not pooled: result streams may read it after run() has returned
            wire = out if self.wire_dtype == torch.float32 else torch.empty(e - s, dtype=self.wire_dtype)
            self.part = StreamedPart(self.senders, out, wire)
            self._timers = [loop.call_at(self.start_deadline, self.part.expire_unstarted),
                            loop.call_at(self.reduce_deadline, self.part.expire)]
        fetch = group.members[me].fetch
        self._exchanges = [j for j in self.aggregators if j != me and (fetch or group.backup(j) == me)]
        self.undelivered = {k for k, m in enumerate(group.members) if m.fetch and k != me} \
            if me in self.aggregators else set()
        """Members that have not yet received this member's part (a leaving peer waits for them)."""
        self.served = asyncio.Event()
        """Set once this member's part reached every member, or at the result deadline (after it,
        members fetch from the backup), or once the part is abandoned: from then on this member
        serves nothing more in this round."""
        if not self.undelivered:
            self.served.set()
        else:
            loop.call_at(self.result_deadline, self.served.set)
        self._backup_connected = False
        self._backup_ok: asyncio.Future = loop.create_future()

    # ---- helpers -----------------------------------------------------------------------------
    def _name(self, i: int) -> str:
        return self.group.members[i].peer_id

    def _prefix(self) -> str:
        return f"step {self.group.step}"

    def _to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.wire_dtype else t.to(self.wire_dtype)

    def _rounded(self, t: torch.Tensor) -> torch.Tensor:
        """Round as the wire will, so the aggregator keeps exactly what others receive."""
        return t if self.wire_dtype == torch.float32 else t.to(self.wire_dtype).float()

    def _contribution(self, part: int) -> torch.Tensor | None:
        if self.weight <= 0:
            return None
        s, e = self.bounds[part]
        return self._to_wire(self.local[s:e])

    async def _read_part(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, header: Header,
                         part: int, sender: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Read a part's payload: straight into ``into`` when the wire is float32, else into a pooled
        buffer the caller gives back. Raises ProtocolError for NaN/inf values."""
        s, e = self.bounds[part]
        buf = into if into is not None and self.wire_dtype == torch.float32 else self.pool.take(e - s, self.wire_dtype)
        try:
            self.stats.add_received(await read_payload_into(reader, writer, header, buf),
                                    f"{header.kind.name[0].lower()}{part}<{sender}")
        except BaseException:
            if buf is not into:
                self.pool.give(buf)
            raise
        data = buf
        if buf.dtype != torch.float32:
            data = self.pool.take(e - s)
            data.copy_(buf)
            self.pool.give(buf)
        if not all_finite(data):
            if data is not into:
                self.pool.give(data)
            raise ProtocolError("contains NaN or inf values")
        return data

    async def _read_result(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, part: int,
                           who: int) -> None:
        header = await read_header(reader)
        if header.kind == Kind.ERROR:
            raise AveragingError(f"peer {self._name(who)} answered: {await read_error_text(reader, header)}")
        if header.kind != Kind.RESULT or header.part != part:
            raise ProtocolError(f"expected RESULT for part {part}, got {header.kind.name} for part {header.part}")
        s, e = self.bounds[part]
        out = self.output[s:e]
        try:
            data = await self._read_part(reader, writer, header, part, who, into=out)
        except asyncio.IncompleteReadError as e:
            raise ConnectionError(f"peer {self._name(who)} ended its result for part {part} "
                                  f"{e.expected} bytes short") from None
        if data is not out:
            out.copy_(data)
            self.pool.give(data)
        self.stats.part_weights[part] = header.weight

    # ---- member side ---------------------------------------------------------------------------
    async def run(self) -> torch.Tensor:
        """Average; returns the output buffer. Raises AveragingError on failure, before the deadline.

        A member that needs no result (aggregator-only) fetches only the parts it backs up, so
        the output holds its own part and those; nobody else's.
        """
        tasks = [asyncio.create_task(self._exchange(j)) for j in self._exchanges]
        if self.me in self.aggregators:
            tasks.append(asyncio.create_task(self._aggregate_own_part()))
        try:
            async with asyncio.timeout_at(self.deadline):
                results = await asyncio.gather(*tasks, return_exceptions=True)
        except TimeoutError:
            raise AveragingError(f"{self._prefix()}: round did not finish before its deadline") from None
        finally:
            for t in tasks:
                t.cancel()
        if logger.isEnabledFor(logging.DEBUG):
            reduced = f"; own part reduced at {self._reduced_at - self._t0:.2f} s" if self._reduced_at else ""
            logger.debug(f"{self._prefix()}: {self.stats.timeline(self._t0)}{reduced}")
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise AveragingError(f"{self._prefix()}: {len(errors)} part(s) could not be averaged: {errors[0]}")
        return self.output

    async def _exchange(self, j: int) -> None:
        """Contribute to part ``j`` (if this member has weight) and pull its result, both at once;
        fail the part over to its backup if the result does not come whole."""
        contribution = asyncio.create_task(self._contribute(j)) if self.weight > 0 else None
        reason = ""
        try:
            async with asyncio.timeout_at(self.result_deadline):
                reader, writer = await self.open_stream(self._name(j))
                try:
                    await write_frame(writer, Kind.PULL, self.group.round_id, j)
                    await self._read_result(reader, writer, j, j)
                    self._have[j].set_result(True)
                    if self.group.backup(j) == self.me:
                        await self._confirm(writer, j)
                        await wait_peer_closed(reader, ACK_GRACE)  # we wrote last: let the ACK arrive
                    if contribution is not None:  # its last credits may still be on the way
                        await asyncio.wait({contribution})
                    return
                finally:
                    writer.close()
        except TimeoutError:
            reason = "no result before the deadline"
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        finally:
            if contribution is not None and not contribution.done():
                contribution.cancel()
                await asyncio.gather(contribution, return_exceptions=True)
        if self._have[j].done():  # got the result; only the ACK failed
            return
        self._have[j].set_result(False)
        await self._failover(j, reason)

    async def _contribute(self, j: int) -> None:
        """Send this member's contribution to part ``j``; a refusal is logged (the result still comes)."""
        try:
            async with asyncio.timeout_at(self.reduce_deadline):
                reader, writer = await self.open_stream(self._name(j))
                try:
                    self.stats.add_sent(await write_frame(writer, Kind.CONTRIB, self.group.round_id, j, self.weight,
                                                          self._contribution(j), self.chunk_bytes, reader), f"c{j}>{j}")
                finally:
                    writer.close()
        except ProtocolError as e:
            logger.warning(f"{self._prefix()}: aggregator {self._name(j)} did not take our contribution to part {j}: {e}")
        except Exception as e:
            logger.debug(f"{self._prefix()}: contribution to part {j} did not arrive: {e!r}")

    async def _confirm(self, writer: asyncio.StreamWriter, j: int) -> None:
        """As part ``j``'s backup, tell its aggregator that we hold its result (it completes
        everyone else's copy only after this)."""
        await write_frame(writer, Kind.ACK, self.group.round_id, j)

    async def _failover(self, j: int, reason: str) -> None:
        b = self.group.backup(j)
        who = "we abandoned our part" if j == self.me else f"aggregator {self._name(j)} failed for part {j}"
        logger.warning(f"{self._prefix()}: {who} ({reason}); "
                       + (f"failing over to {self._name(b)}" if b is not None else "no backup"))
        if b is None:
            raise AveragingError(f"{who} ({reason}) and part {j} has no backup")
        self.stats.failovers += 1
        # an aggregator that abandoned its part re-reduces it itself when the backup is gone: the
        # failed contributor may be that backup (tried only if the backup cannot be reached)
        for target in (b, j):
            if target == self.me:
                state = self._failover_state(j)
                await state.ready.wait()
                if state.error:
                    raise AveragingError(f"failover of part {j} failed: {state.error}")
                return
            async with asyncio.timeout_at(self.deadline):
                try:
                    reader, writer = await self.open_stream(self._name(target))
                except Exception as e:
                    if target == j or j == b:
                        raise
                    logger.warning(f"{self._prefix()}: backup {self._name(b)} of part {j} is unreachable ({e}); "
                                   f"asking its aggregator {self._name(j)}")
                    continue
                try:
                    self.stats.add_sent(await write_frame(writer, Kind.FAILOVER, self.group.round_id, j, self.weight,
                                                          self._contribution(j), self.chunk_bytes, reader),
                                        f"f{j}>{target}")
                    await self._read_result(reader, writer, j, target)
                    return
                finally:
                    writer.close()

    # ---- aggregator side ---------------------------------------------------------------------
    async def _aggregate_own_part(self) -> None:
        """Add our own contribution, wait for the part to be produced (or abandoned: then fetch it
        from the backup like every other member)."""
        part = self.part
        s, e = self.bounds[self.me]
        try:
            if self.weight > 0:
                part.add_local(self.me, self.weight, self.local[s:e])
            await part.done.wait()
            self._reduced_at = time.monotonic()
            for k, why in part.rejected.items():
                self.stats.excluded[self._name(k)] = why
        finally:
            if not self._backup_connected and not self._backup_ok.done():
                self._backup_ok.set_result(True)  # backup never showed up: it cannot hold a stale copy
        if part.failed is None:
            self.stats.part_weights[self.me] = part.total_weight
            self._have[self.me].set_result(True)
            return
        self._have[self.me].set_result(False)
        self.served.set()  # members fetch this part from the backup now
        await self._failover(self.me, part.failed)

    async def _receive(self, k: int, header: Header, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       part: int, acc: PartAccumulator) -> None:
        member = self.group.members[k]
        try:
            if header.part != part:
                raise ProtocolError(f"sent part {header.part}, expected part {part}")
            s, e = self.bounds[part]
            if header.numel == 0 and (member.weight == 0 or e == s):
                if member.weight > 0:
                    acc.add(k, member.weight, self.local[s:e])  # an empty part: only the weight counts
                return
            if abs(header.weight - member.weight) > 1e-6 * max(1.0, member.weight):
                raise ProtocolError(f"weight {header.weight} differs from the agreed {member.weight}")
            data = await self._read_part(reader, writer, header, part, k)
            acc.add(k, member.weight, data)
            self.pool.give(data)
        except ProtocolError as e:
            logger.warning(f"{self._prefix()}: rejected contribution of peer {member.peer_id} to part {part}: {e}")
            acc.reject(k, str(e))
            self.stats.excluded[member.peer_id] = str(e)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.info(f"{self._prefix()}: peer {member.peer_id} left while sending part {part}")
            acc.reject(k, f"disconnected: {e}")
            raise ConnectionError("sender left") from None

    async def _confirmed(self) -> None:
        """Return once the backup holds this member's result; raise _Unconfirmed if it never will."""
        if not await asyncio.shield(self._backup_ok):
            raise _Unconfirmed()

    async def _send_result(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, part: int,
                           weight: float, to: int, hold: Callable[[], Awaitable[None]] | None = None) -> None:
        """Send a finished part (a failover's re-reduce)."""
        s, e = self.bounds[part]
        self.stats.add_sent(await write_frame(writer, Kind.RESULT, self.group.round_id, part, weight,
                                              self._to_wire(self.output[s:e]), self.chunk_bytes, reader, hold),
                            f"r{part}>{to}")

    async def _stream_result(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, to: int,
                             hold: Callable[[], Awaitable[None]] | None = None) -> None:
        """Send our part as it is produced; raises PartAbandoned (the caller cuts the stream)."""
        part = self.part
        self.stats.add_sent(await write_frame(writer, Kind.RESULT, self.group.round_id, self.me, part.total_weight,
                                              part.wire, self.chunk_bytes, reader, hold, supply=part),
                            f"r{self.me}>{to}")

    async def handle(self, peer_id: str, header: Header, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Serve one incoming stream of this round (its first header already read).

        Returns True when this side wrote last (the caller then waits for the peer to close first)."""
        k = self.group.index(peer_id)
        if k is None:
            logger.warning(f"{self._prefix()}: peer {peer_id} is not a member of this round; refused")
            await write_error(writer, self.group.round_id, "not a member of this round")
            return True
        if header.kind == Kind.CONTRIB and self.part is not None:
            return await self._serve_contribution(k, header, reader, writer)
        if header.kind == Kind.PULL and self.part is not None and header.part == self.me:
            return await self._serve_result(k, reader, writer)
        abandoned = header.part == self.me and self.part is not None and self.part.failed is not None
        if header.kind == Kind.FAILOVER and (self.group.backup(header.part) == self.me or abandoned):
            return await self._serve_failover(k, header, reader, writer)
        logger.warning(f"{self._prefix()}: unexpected {header.kind.name} for part {header.part} from {peer_id}")
        await write_error(writer, self.group.round_id, f"unexpected {header.kind.name} for part {header.part}")
        return True

    async def _serve_contribution(self, k: int, header: Header, reader: asyncio.StreamReader,
                                  writer: asyncio.StreamWriter) -> bool:
        """Read member ``k``'s contribution into the streamed part as it arrives. Answers ERROR if it
        is refused (before reading, or after: NaN/inf); a sender that leaves is taken out."""
        part, member = self.part, self.group.members[k]
        s, e = self.bounds[self.me]
        buf, began = None, False
        try:
            if header.part != self.me:
                raise ProtocolError(f"sent part {header.part}, expected part {self.me}")
            if member.weight <= 0:
                raise ProtocolError("a member with weight 0 has nothing to contribute")
            if abs(header.weight - member.weight) > 1e-6 * max(1.0, member.weight):
                raise ProtocolError(f"weight {header.weight} differs from the agreed {member.weight}")
            buf = self.pool.take(e - s, self.wire_dtype)
            check_payload(header, buf)
            if not part.begin(k, member.weight, buf):
                raise ProtocolError("too late, or a second contribution: this part does not expect one from you")
            began = True
            size = buf.element_size()
            self.stats.add_received(
                await read_payload_into(reader, writer, header, buf, lambda n: part.progress(k, n // size)),
                f"c{self.me}<{k}")
        except ProtocolError as e:
            logger.warning(f"{self._prefix()}: rejected contribution of peer {member.peer_id} to part {self.me}: {e}")
            if not began and part.contributors is None and k in part.pending:  # a bad first stream: left out
                part.reject(k, str(e))
                self.stats.excluded[member.peer_id] = str(e)
            await write_error(writer, self.group.round_id, str(e))
            return True
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.info(f"{self._prefix()}: peer {member.peer_id} left while sending part {self.me}")
            part.reject(k, f"disconnected: {e}")
            return False
        finally:
            if buf is not None:
                await part.done.wait()  # the part reads the buffer until then
                self.pool.give(buf)
        if k in part.rejected:  # e.g. NaN/inf, found when the part checked it
            logger.warning(f"{self._prefix()}: rejected contribution of peer {member.peer_id} to part {self.me}: "
                           f"{part.rejected[k]}")
            await write_error(writer, self.group.round_id, part.rejected[k])
            return True
        return False

    async def _serve_result(self, k: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Stream our part to member ``k`` as it is produced. The backup's copy goes unheld and is
        answered by its ACK; every other copy holds its last credit unit until that ACK. If the
        part is abandoned, the stream is cut mid-payload and the member fails over."""
        is_backup = self.group.backup(self.me) == k
        if is_backup:
            self._backup_connected = True
        try:
            return await self._serve_result_to(k, is_backup, reader, writer)
        finally:
            self._delivered(k)  # delivered, or never will be from here (the member fails over)

    async def _serve_result_to(self, k: int, is_backup: bool, reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> bool:
        try:
            async with asyncio.timeout_at(self.result_deadline):
                try:
                    await self.part.committed()
                except PartAbandoned as e:
                    await write_error(writer, self.group.round_id, str(e))
                    return True
                if is_backup:  # the backup writes last here (its ACK)
                    try:
                        await self._stream_result(reader, writer, k)
                        acked = (await read_header(reader)).kind == Kind.ACK
                    except (ConnectionError, asyncio.IncompleteReadError):
                        acked = True  # the backup is gone: it cannot serve a stale failover
                    if not self._backup_ok.done():
                        self._backup_ok.set_result(acked)
                    return False
                if self._backup_ok.done() and not self._backup_ok.result():
                    await write_error(writer, self.group.round_id, "backup did not confirm the result; fail over")
                    return True
                try:  # sent alongside the backup's copy, but completed only once the backup has confirmed it
                    await self._stream_result(reader, writer, k, hold=self._confirmed)
                except _Unconfirmed:
                    logger.debug(f"{self._prefix()}: withheld the end of part {self.me} from {self._name(k)}: "
                                 f"the backup did not confirm it")
                    return False  # the stream closes mid-payload: the member fails over to the backup
                return True
        except PartAbandoned as e:
            logger.debug(f"{self._prefix()}: cut part {self.me}'s result to {self._name(k)}: {e}")
            return False
        except Exception as e:
            if is_backup and not self._backup_ok.done():
                self._backup_ok.set_result(False)
            logger.debug(f"{self._prefix()}: could not deliver part {self.me} to {self._name(k)}: {e!r}")
            return False

    def _delivered(self, k: int) -> None:
        self.undelivered.discard(k)
        if not self.undelivered:
            self.served.set()

    # ---- backup side -------------------------------------------------------------------------
    def _failover_state(self, j: int) -> _Failover:
        if j not in self._failovers:
            s, e = self.bounds[j]
            # the failed aggregator is not waited for, but taken if it abandoned its part and re-sends
            state = _Failover(PartAccumulator(self.senders - {j}, e - s, self.pool.take(e - s, zero=True),
                                              optional={j} & self.senders))
            self._failovers[j] = state
            self._failover_tasks.append(asyncio.create_task(self._run_failover(j, state)))
        return self._failovers[j]

    async def _run_failover(self, j: int, state: _Failover) -> None:
        try:
            async with asyncio.timeout_at(self.deadline):
                if await self._have[j]:
                    return  # we hold the failed aggregator's result: serve that copy
                s, e = self.bounds[j]
                if self.weight > 0:
                    state.acc.add(self.me, self.weight, self.local[s:e])
                await state.acc.wait(self.failover_deadline)
                mean = state.acc.finish()
                self.output[s:e] = self._rounded(mean)
                self.pool.give(mean)
                self.stats.part_weights[j] = state.acc.total_weight
                logger.info(f"{self._prefix()}: re-reduced part {j} of failed aggregator {self._name(j)} "
                            f"from {len(state.acc.contributors)} contributions")
        except Exception as e:
            state.error = f"{type(e).__name__}: {e}"
        finally:
            state.ready.set()

    async def _serve_failover(self, k: int, header: Header, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> bool:
        j = header.part
        state = self._failover_state(j)
        try:
            await self._receive(k, header, reader, writer, j, state.acc)
        except ConnectionError:
            return False
        await state.ready.wait()
        if state.error:
            await write_error(writer, self.group.round_id, state.error)
        else:
            await self._send_result(reader, writer, j, self.stats.part_weights.get(j, 0.0), k)
        return True

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        if self.part is not None:
            self.part.abandon("the round ended")
        for t in self._failover_tasks:
            t.cancel()


__all__ = ["PartitionedRound", "RoundStats"]
