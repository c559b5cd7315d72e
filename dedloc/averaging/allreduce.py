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
  aggregator's result if it got it (or can fetch it again) and otherwise re-reduces the part from
  re-sent contributions; a member that cannot reach the backup asks the aggregator, which serves
  its finished part past the result deadline.
  The aggregator sends its result to all members at once, but holds back the last credit unit of
  every copy except the backup's until the backup ACKs: nobody else can complete the part first;
- every part of a member's result averages one and the same contributor set (``stats.contributors``):
  a part whose set is larger than the others' (a sender that failed after reaching some
  aggregators only) is re-reduced with the common set before ``run()`` returns (round_amend.py);
- if a part cannot be obtained, ``run()`` raises AveragingError before the round deadline and
  the caller's tensor is untouched (results go to a separate output buffer).

Structure: the roles' shared state is a RoundCore (round_core.py); MemberRole (round_member.py)
contributes to and pulls every other part, AggregatorRole (round_aggregator.py) reduces and
streams this member's own part, FailoverRole (round_failover.py) re-reduces a failed aggregator's
part as its backup, AmendRole (round_amend.py) makes the parts' contributor sets one.
PartitionedRound owns the four: it runs and awaits (or cancels) their tasks,
dispatches incoming streams to them, and ``close()`` cancels their timers and tasks. The averager
closes every round when its lifetime ends.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from dedloc.averaging.buffers import BufferPool
from dedloc.averaging.group import Group
from dedloc.averaging.round_aggregator import AggregatorRole
from dedloc.averaging.round_amend import AmendRole
from dedloc.averaging.round_core import OpenStream, RoundCore, RoundStats
from dedloc.averaging.round_failover import FailoverRole
from dedloc.averaging.round_member import MemberRole
from dedloc.averaging.round_verifier import VerifierRole
from dedloc.averaging.wire import Header, Kind, write_error
from dedloc.errors import AveragingError

logger = logging.getLogger(__name__)


class PartitionedRound:
    """One member's side of one partitioned all-reduce round (see the module doc)."""

    member_role = MemberRole
    """The member role's class (a test substitutes a misbehaving one)."""
    aggregator_role = AggregatorRole
    """The aggregator role's class (likewise)."""

    def __init__(self, group: Group, me: int, local: torch.Tensor, weight: float, open_stream: OpenStream,
                 timeout: float, compression: str = "none", chunk_bytes: int = 4 << 20,
                 pool: BufferPool | None = None):
        self.core = RoundCore(group, me, local, weight, open_stream, timeout, compression, chunk_bytes, pool)
        self.group, self.me = group, me
        self.verifier = VerifierRole(self.core)
        self.failover = FailoverRole(self.core, self.verifier)
        self.member = self.member_role(self.core, self.failover, self.verifier)
        self.aggregator = self.aggregator_role(self.core, self.member) if me in self.core.aggregators else None
        self.amend = AmendRole(self.core)
        self.served = self.aggregator.served if self.aggregator is not None else asyncio.Event()
        """Set once this member's part reached every member, or at the result deadline (after it,
        members fetch from the backup), or once the part is abandoned: from then on this member
        serves nothing more in this round. Set at once for a member that aggregates nothing."""
        if self.aggregator is None:
            self.served.set()

    @property
    def stats(self) -> RoundStats:
        return self.core.stats

    @property
    def output(self) -> torch.Tensor:
        return self.core.output

    async def run(self) -> torch.Tensor:
        """Average; returns the output buffer. Raises AveragingError on failure, before the deadline.

        A member that needs no result (aggregator-only) fetches only the parts it backs up, so
        the output holds its own part and those; nobody else's.
        """
        c = self.core
        tasks = [asyncio.create_task(self.member.exchange(j)) for j in self.member.exchanges]
        if self.aggregator is not None:
            tasks.append(asyncio.create_task(self.aggregator.aggregate()))
        try:
            async with asyncio.timeout_at(c.deadline):
                results = await asyncio.gather(*tasks, return_exceptions=True)
                if not any(isinstance(r, BaseException) for r in results) and self.group.members[self.me].fetch:
                    await self.amend.agree(self.member.send_errors)
        except TimeoutError:
            raise AveragingError(f"{c.prefix()}: round did not finish before its deadline") from None
        finally:
            for t in tasks:
                t.cancel()
        if logger.isEnabledFor(logging.DEBUG):
            at = self.aggregator.reduced_at if self.aggregator is not None else 0.0
            reduced = f"; own part reduced at {at - c.t0:.2f} s" if at else ""
            logger.debug(f"{c.prefix()}: {c.stats.timeline(c.t0)}{reduced}")
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise AveragingError(f"{c.prefix()}: {len(errors)} part(s) could not be averaged: {errors[0]}")
        return c.output

    async def handle(self, peer_id: str, header: Header, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Serve one incoming stream of this round (its first header already read).

        Returns True when this side wrote last (the caller then waits for the peer to close first)."""
        c, agg = self.core, self.aggregator
        k = self.group.index(peer_id)
        if k is None:
            logger.warning(f"{c.prefix()}: peer {peer_id} is not a member of this round; refused")
            await write_error(writer, self.group.round_id, "not a member of this round")
            return True
        if header.kind == Kind.CONTRIB and agg is not None:
            return await agg.serve_contribution(k, header, reader, writer)
        if header.kind == Kind.PULL and agg is not None and header.part == self.me:
            return await agg.serve_result(k, header, reader, writer)
        abandoned = header.part == self.me and agg is not None and agg.abandoned
        if header.kind == Kind.FAILOVER and (self.group.backup(header.part) == self.me or abandoned):
            return await self.failover.serve(k, header, reader, writer)
        if header.kind == Kind.FAILOVER and header.part == self.me and agg is not None and agg.final:
            return await agg.serve_final(k, header, reader, writer)  # the member cannot reach our backup
        if header.kind == Kind.CHECK and self.verifier.checks(header.part):
            return await self.verifier.serve_copy(k, header, reader, writer)
        if header.kind == Kind.VERDICT and self.verifier.checks(header.part):
            return await self.verifier.serve_verdict(k, header, writer)
        if header.kind == Kind.CONTRIBUTORS and self.amend.fixes(header.part):
            return await self.amend.serve(k, header, reader, writer)
        logger.warning(f"{c.prefix()}: unexpected {header.kind.name} for part {header.part} from {peer_id}")
        await write_error(writer, self.group.round_id, f"unexpected {header.kind.name} for part {header.part}")
        return True

    def close(self) -> None:
        """Cancel every timer and task of the round (it serves nothing more)."""
        if self.aggregator is not None:
            self.aggregator.close()
        self.failover.close()
        self.verifier.close()
        self.amend.close()


__all__ = ["PartitionedRound", "RoundStats"]
