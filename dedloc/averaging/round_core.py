"""What one partitioned round's roles share: the group, this member's vector and output, the
part boundaries and deadlines, the per-part outcome futures, the stats, and the few helpers that
read and write parts. Holds no task: each role (round_member, round_aggregator, round_failover)
owns its own, and PartitionedRound (allreduce.py) owns the roles.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable

import torch

from dedloc.averaging.accumulator import PartAccumulator
from dedloc.averaging.buffers import BufferPool
from dedloc.averaging.group import Group, Member
from dedloc.averaging.streamed_part import StreamedPart
from dedloc.averaging.wire import UNKNOWN_ROUND, Header, Kind, ProtocolError, check_payload, read_contributors, \
    read_error_text, read_header, read_payload_into, refusal, write_contributors, write_error, write_frame
from dedloc.errors import AveragingError
from dedloc.net.bulk import Transfer, busy_seconds
from dedloc.averaging.bounds import MAX_WEIGHTED, TOO_LARGE
from dedloc.numerics import bounded

logger = logging.getLogger(__name__)

OpenStream = Callable[[str], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]

# A partitioned round's deadlines, as fractions of its timeout T (docs/averaging.md, failure table):
START_BY = 0.25
"""Every contribution stream has opened (they open at the round's start); an aggregator stops
waiting for senders that have not begun."""
REDUCE_BY = 0.5
"""Every contribution has arrived: an aggregator reduces without the late ones (results follow)."""
RESULT_BY = 0.6
"""Every result has arrived: a member fails a part it lacks over to the part's backup, and an
aggregator whose part is final serves it to members that cannot reach the backup."""
FAILOVER_BY = 0.85
"""A backup re-reduces a failed part with the re-sent contributions it holds."""


def _differs(weight: float, agreed: float) -> bool:
    """Whether a weight is not the one agreed when the group formed (beyond float noise)."""
    return abs(weight - agreed) > 1e-6 * max(1.0, agreed)


class RoundStats:
    def __init__(self) -> None:
        self.failovers = 0
        self.verified = 0
        """Parts this member verified (a verified round): recomputed as their backup, or checked
        against their backup's digest."""
        self.excluded: dict[str, str] = {}
        self.part_weights: dict[int, float] = {}
        self.part_sets: dict[int, tuple[int, ...]] = {}
        """Per part this member holds: the member indices whose contributions it averages."""
        self.contributors: tuple[int, ...] | None = None
        """The one contributor set every part of the round averaged (set once the round agreed;
        None for a member that holds only some parts, or before)."""
        self.accepted: dict[str, float] = {}
        """Contributors to the part this member aggregated, with the weights it reduced them with
        (the contribution ledger counts these, not what peers claim)."""
        self.accepted_fraction = 0.0
        """The fraction of the vector that part is."""
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


class RoundCore:
    """The shared state of one member's side of one partitioned round (see the module doc)."""

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
        self.t0 = time.monotonic()
        self.start_deadline = start + START_BY * timeout
        self.reduce_deadline = start + REDUCE_BY * timeout
        self.result_deadline = start + RESULT_BY * timeout
        self.failover_deadline = start + FAILOVER_BY * timeout
        self.deadline = start + timeout  # the round fails
        self.aggregators = group.aggregators
        self.senders = {i for i, m in enumerate(group.members) if m.weight > 0}
        self.have = {j: loop.create_future() for j in self.aggregators}
        """Per part: True once this member holds its result from the aggregator, False if it must fail over."""
        agreed = group.members[me].weight
        self.own_refused: str | None = None
        """Why this member's own contribution is left out of every part (None: it is not)."""
        if weight > 0 and _differs(weight, agreed):
            # e.g. a join whose answer came too late: the leader kept it in the group, and the peer,
            # having dropped those gradients, joined again with new ones. The other aggregators refuse
            # its contributions for the weight; its own part must leave it out too
            self.own_refused = f"weight {weight} differs from the agreed {agreed}"
            logger.warning(f"{self.prefix()}: this peer is in the group with weight {agreed} (an earlier join for this "
                           f"step) but now brings {weight}: its contribution is left out of this round")

    def add_own(self, part: "StreamedPart | PartAccumulator", j: int) -> None:
        """Add this member's own contribution to its copy of part ``j`` (or, if its weight is not the
        agreed one, take it out there as every other aggregator does)."""
        if self.weight <= 0:
            return
        if self.own_refused is not None:
            part.reject(self.me, self.own_refused)
            return
        s, e = self.bounds[j]
        if isinstance(part, StreamedPart):
            part.add_local(self.me, self.weight, self.local[s:e])
        else:
            part.add(self.me, self.weight, self.local[s:e])

    def name(self, i: int) -> str:
        return self.group.members[i].peer_id

    def prefix(self) -> str:
        return f"step {self.group.step}"

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.wire_dtype else t.to(self.wire_dtype)

    def rounded(self, t: torch.Tensor) -> torch.Tensor:
        """Round as the wire will, so the aggregator keeps exactly what others receive."""
        return t if self.wire_dtype == torch.float32 else t.to(self.wire_dtype).float()

    @staticmethod
    def check_weight(header: Header, member: Member) -> None:
        """A contribution must carry the weight the member declared when the group formed."""
        if _differs(header.weight, member.weight):
            raise ProtocolError(f"weight {header.weight} differs from the agreed {member.weight}")

    def check_contributors(self, contributors: tuple[int, ...], part: int) -> tuple[int, ...]:
        """A contributor set a peer sent for ``part``; ProtocolError if it is empty or names a member
        with weight 0 (who has nothing to contribute)."""
        if not contributors or any(self.group.members[i].weight <= 0 for i in contributors):
            raise ProtocolError(f"the contributor set {list(contributors)} of part {part} is empty or names a "
                                f"member with weight 0")
        return contributors

    def contribution(self, part: int) -> torch.Tensor | None:
        if self.weight <= 0:
            return None
        s, e = self.bounds[part]
        return self.to_wire(self.local[s:e])

    async def read_part(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, header: Header,
                        part: int, sender: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Read a part's payload: straight into ``into`` when the wire is float32, else into a pooled
        buffer the caller gives back. Raises ProtocolError for NaN/inf values, and for a contribution
        (not a result) whose values times its weight exceed MAX_WEIGHTED."""
        limit = MAX_WEIGHTED / max(1.0, header.weight) if header.kind != Kind.RESULT else math.inf
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
        if not bounded(data, limit):
            if data is not into:
                self.pool.give(data)
            raise ProtocolError("contains NaN or inf values" if limit == math.inf else TOO_LARGE)
        return data

    async def serve_streamed(self, part: StreamedPart, j: int, k: int, header: Header, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> bool:
        """Read member ``k``'s contribution to part ``j`` into ``part`` as it arrives (the aggregator's
        CONTRIB, or a verifying backup's CHECK copy). Answers ERROR if it is refused (before reading,
        or after: NaN/inf); a sender that leaves is taken out. True if this side wrote last."""
        member = self.group.members[k]
        s, e = self.bounds[j]
        buf, began = None, False
        what = "contribution" if header.kind == Kind.CONTRIB else "copy of the contribution"
        try:
            if header.part != j:
                raise ProtocolError(f"sent part {header.part}, expected part {j}")
            if member.weight <= 0:
                raise ProtocolError("a member with weight 0 has nothing to contribute")
            self.check_weight(header, member)
            buf = self.pool.take(e - s, self.wire_dtype)
            check_payload(header, buf)
            if not part.begin(k, member.weight, buf):
                raise ProtocolError("too late, or a second contribution: this part does not expect one from you")
            began = True
            size = buf.element_size()
            label = f"{'c' if header.kind == Kind.CONTRIB else 'v'}{j}<{k}"
            self.stats.add_received(
                await read_payload_into(reader, writer, header, buf, lambda n: part.progress(k, n // size)), label)
        except ProtocolError as e:
            logger.warning(f"{self.prefix()}: rejected {what} of peer {member.peer_id} to part {j}: {e}")
            if not began and part.contributors is None and k in part.pending:  # a bad first stream: left out
                part.reject(k, str(e))
                self.stats.excluded[member.peer_id] = str(e)
            await write_error(writer, self.group.round_id, str(e))
            return True
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.info(f"{self.prefix()}: peer {member.peer_id} left while sending part {j}")
            part.reject(k, f"disconnected: {e}")
            return False
        finally:
            if buf is not None:
                await part.done.wait()  # the part reads the buffer until then
                self.pool.give(buf)
        if k in part.rejected:  # e.g. NaN/inf, found when the part checked it
            logger.warning(f"{self.prefix()}: rejected {what} of peer {member.peer_id} to part {j}: "
                           f"{part.rejected[k]}")
            await write_error(writer, self.group.round_id, part.rejected[k])
            return True
        return False

    async def read_result(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, part: int,
                          who: int) -> None:
        """Read part ``part``'s result (its contributor set, then the values) from member ``who``
        into the output; its weight and contributor set into the stats."""
        header = await read_header(reader)
        if header.kind == Kind.ERROR:
            text = await read_error_text(reader, header)
            if text == UNKNOWN_ROUND:
                raise refusal(f"peer {self.name(who)}", text)
            raise AveragingError(f"peer {self.name(who)} answered: {text}")
        if header.kind != Kind.CONTRIBUTORS or header.part != part:
            raise ProtocolError(f"expected CONTRIBUTORS for part {part}, got {header.kind.name} for part {header.part}")
        contributors = self.check_contributors(await read_contributors(reader, header, len(self.group.members)), part)
        header = await read_header(reader)
        if header.kind != Kind.RESULT or header.part != part:
            raise ProtocolError(f"expected RESULT for part {part}, got {header.kind.name} for part {header.part}")
        s, e = self.bounds[part]
        out = self.output[s:e]
        try:
            data = await self.read_part(reader, writer, header, part, who, into=out)
        except asyncio.IncompleteReadError as e:
            raise ConnectionError(f"peer {self.name(who)} ended its result for part {part} "
                                  f"{e.expected} bytes short") from None
        if data is not out:
            out.copy_(data)
            self.pool.give(data)
        self.stats.part_weights[part] = header.weight
        self.stats.part_sets[part] = contributors

    async def send_result(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, part: int,
                          weight: float, to: int) -> None:
        """Send a finished part from the output (a failover's re-reduce), after its contributor set."""
        s, e = self.bounds[part]
        await write_contributors(writer, self.group.round_id, part, self.stats.part_sets[part], len(self.group.members))
        self.stats.add_sent(await write_frame(writer, Kind.RESULT, self.group.round_id, part, weight,
                                              self.to_wire(self.output[s:e]), self.chunk_bytes, reader),
                            f"r{part}>{to}")


__all__ = ["RoundCore", "RoundStats", "OpenStream"]
