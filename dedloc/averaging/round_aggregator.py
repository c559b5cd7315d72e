"""A partitioned round's aggregator role: reduce this member's own part and stream it to everyone.

Contributions are read into a StreamedPart segment by segment as they arrive; each finished
segment streams at once to every member that pulls the result. The backup's copy goes unheld and
is answered by its ACK; every other copy holds its last credit unit until that ACK, so nobody else
can complete the part before the backup holds it. If the part is abandoned (a contributor failed
after the part's contributors were fixed), result streams are cut mid-payload and every member,
this one included, fails the part over. The role owns the part's two deadline timers; ``close()``
cancels them and abandons the part.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import torch

from dedloc.averaging.round_core import RoundCore
from dedloc.averaging.round_member import MemberRole
from dedloc.averaging.streamed_part import PartAbandoned, StreamedPart
from dedloc.averaging.wire import Header, Kind, ProtocolError, read_error_text, read_header, write_contributors, \
    write_error, write_frame

logger = logging.getLogger(__name__)


class _Unconfirmed(Exception):
    """The backup did not confirm this aggregator's result: nobody else may complete it."""


class AggregatorRole:
    """This member's own part (only for members with a share)."""

    def __init__(self, core: RoundCore, member: MemberRole):
        self.c, self.member = core, member
        loop = asyncio.get_running_loop()
        s, e = core.bounds[core.me]
        out = core.output[s:e]
        # not pooled: result streams may read it after run() has returned
        wire = out if core.wire_dtype == torch.float32 else torch.empty(e - s, dtype=core.wire_dtype)
        self.part = StreamedPart(core.senders, out, wire)
        self._timers = [loop.call_at(core.start_deadline, self.part.expire_unstarted),
                        loop.call_at(core.reduce_deadline, self.part.expire)]
        self.reduced_at = 0.0
        self.undelivered = {k for k, m in enumerate(core.group.members) if m.fetch and k != core.me}
        """Members that have not yet received this part (a leaving peer waits for them)."""
        self.served = asyncio.Event()
        """Set once this part reached every member, or at the result deadline (after it, members fetch
        from the backup), or once the part is abandoned."""
        if not self.undelivered:
            self.served.set()
        else:
            self._timers.append(loop.call_at(core.result_deadline, self.served.set))
        self._backup_connected = False
        self._backup_ok: asyncio.Future = loop.create_future()
        self._refused: str | None = None
        """Why the backup refused our result (a verified round's mismatch), if it did."""

    async def aggregate(self) -> None:
        """Add our own contribution, wait for the part to be produced (or abandoned: then fetch it
        from the backup like every other member). In a verified round, also send our contribution's
        copy to the backup, and take the part from the backup if it refuses our result."""
        c, part = self.c, self.part
        s, e = c.bounds[c.me]
        b = c.group.backup(c.me)
        copy = None
        if c.group.verify and c.weight > 0 and b is not None:
            copy = asyncio.create_task(self.member.contribute(c.me, to=b))
        try:
            c.add_own(part, c.me)
            await part.done.wait()
            self.reduced_at = time.monotonic()
            for k, why in part.rejected.items():
                c.stats.excluded[c.name(k)] = why
            if copy is not None:
                await copy  # bounded by the reduce deadline
        finally:
            if copy is not None and not copy.done():
                copy.cancel()
                await asyncio.gather(copy, return_exceptions=True)
            if not self._backup_connected and not self._backup_ok.done():
                self._backup_ok.set_result(True)  # backup never showed up: it cannot hold a stale copy
        failed = part.failed
        if failed is None and c.group.verify and b is not None:
            await asyncio.shield(self._backup_ok)
            if self._refused is not None:  # everyone else takes the backup's copy: so must we
                failed = f"our backup {c.name(b)} did not verify our result ({self._refused})"
        if failed is None:
            c.stats.part_weights[c.me] = part.total_weight
            c.stats.part_sets[c.me] = tuple(part.contributors)
            c.stats.accepted = {c.name(k): part.weight_of(k) for k in part.contributors or ()}
            c.stats.accepted_fraction = (e - s) / max(1, c.local.numel())
            c.have[c.me].set_result(True)
            return
        c.have[c.me].set_result(False)
        self.served.set()  # members fetch this part from the backup now
        await self.member.fail_over(c.me, failed)

    @property
    def abandoned(self) -> bool:
        return self.part.failed is not None

    async def serve_contribution(self, k: int, header: Header, reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> bool:
        """Read member ``k``'s contribution into the streamed part as it arrives (RoundCore.serve_streamed)."""
        return await self.c.serve_streamed(self.part, self.c.me, k, header, reader, writer)

    @property
    def final(self) -> bool:
        """Our part is produced, not abandoned, and ours to hand on after the result deadline (not in a
        verified round: there the backup's verdict decides)."""
        have = self.c.have[self.c.me]
        return not self.c.group.verify and have.done() and have.result()

    async def serve_final(self, k: int, header: Header, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> bool:
        """Answer member ``k``'s late request for our finished part (past the result deadline): the
        backup fetching it once more before it would re-reduce (a PULL), or a member whose copy was
        withheld or cut and who cannot reach the backup (a FAILOVER, whose re-sent contribution is read
        and dropped). Serving the one result we hold keeps every member's copy of the part identical:
        the backup, whose own pull failed, fetches this copy before it re-reduces (round_failover)."""
        c = self.c
        if not self.final:
            await write_error(writer, c.group.round_id, f"part {c.me} is not final here")
            return True
        try:
            if header.kind == Kind.FAILOVER and header.numel > 0:
                c.pool.give(await c.read_part(reader, writer, header, c.me, k))
            await c.send_result(reader, writer, c.me, c.stats.part_weights[c.me], k)
        except ProtocolError as e:
            await write_error(writer, c.group.round_id, str(e))
            return True
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug(f"{c.prefix()}: could not deliver part {c.me} late to {c.name(k)}: {e!r}")
            return False
        finally:
            self._delivered(k)
        logger.info(f"{c.prefix()}: served our part {c.me} to {c.name(k)} after the result deadline "
                    f"({'a late pull' if header.kind == Kind.PULL else 'its backup was out of reach'})")
        return True

    async def serve_result(self, k: int, header: Header, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        """Stream our part to member ``k`` as it is produced (see the module doc); past the result
        deadline, answer with the finished part (``serve_final``)."""
        if asyncio.get_running_loop().time() >= self.c.result_deadline:
            return await self.serve_final(k, header, reader, writer)
        is_backup = self.c.group.backup(self.c.me) == k
        if is_backup:
            self._backup_connected = True
        try:
            return await self._serve_result_to(k, is_backup, reader, writer)
        finally:
            self._delivered(k)  # delivered, or never will be from here (the member fails over)

    async def _serve_result_to(self, k: int, is_backup: bool, reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> bool:
        c = self.c
        try:
            async with asyncio.timeout_at(c.result_deadline):
                try:
                    await self.part.committed()
                except PartAbandoned as e:
                    await write_error(writer, c.group.round_id, str(e))
                    return True
                if is_backup:  # the backup writes last here (its ACK)
                    try:
                        await self._stream(reader, writer, k)
                        answer = await read_header(reader)
                        acked = answer.kind == Kind.ACK
                        if answer.kind == Kind.ERROR:
                            self._refused = await read_error_text(reader, answer)
                            logger.warning(f"{c.prefix()}: our backup {c.name(k)} refused our result for part "
                                           f"{c.me}: {self._refused}")
                    except (ConnectionError, asyncio.IncompleteReadError):
                        acked = True  # the backup is gone: it cannot serve a stale failover
                    if not self._backup_ok.done():
                        self._backup_ok.set_result(acked)
                    return False
                if self._backup_ok.done() and not self._backup_ok.result():
                    await write_error(writer, c.group.round_id, "backup did not confirm the result; fail over")
                    return True
                try:  # sent alongside the backup's copy, but completed only once the backup has confirmed it
                    await self._stream(reader, writer, k, hold=self._confirmed)
                except _Unconfirmed:
                    logger.debug(f"{c.prefix()}: withheld the end of part {c.me} from {c.name(k)}: "
                                 f"the backup did not confirm it")
                    return False  # the stream closes mid-payload: the member fails over to the backup
                return True
        except PartAbandoned as e:
            logger.debug(f"{c.prefix()}: cut part {c.me}'s result to {c.name(k)}: {e}")
            return False
        except Exception as e:
            if is_backup and not self._backup_ok.done():
                self._backup_ok.set_result(False)
            logger.debug(f"{c.prefix()}: could not deliver part {c.me} to {c.name(k)}: {e!r}")
            return False

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, to: int,
                      hold: Callable[[], Awaitable[None]] | None = None) -> None:
        """Send our part's contributor set, then the part as it is produced; raises PartAbandoned
        (the caller cuts the stream)."""
        c, part = self.c, self.part
        await write_contributors(writer, c.group.round_id, c.me, tuple(part.contributors), len(c.group.members))
        c.stats.add_sent(await write_frame(writer, Kind.RESULT, c.group.round_id, c.me, part.total_weight,
                                           part.wire, c.chunk_bytes, reader, hold, supply=part),
                         f"r{c.me}>{to}")

    async def _confirmed(self) -> None:
        """Return once the backup holds this member's result; raise _Unconfirmed if it never will."""
        if not await asyncio.shield(self._backup_ok):
            raise _Unconfirmed()

    def _delivered(self, k: int) -> None:
        self.undelivered.discard(k)
        if not self.undelivered:
            self.served.set()

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.part.abandon("the round ended")


__all__ = ["AggregatorRole"]
