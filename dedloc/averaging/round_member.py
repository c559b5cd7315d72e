"""A partitioned round's member role: contribute to every part, pull every result, fail a part over.

For each other aggregator ``j`` a member opens two streams at once: one sends its contribution
to part ``j`` (if it has weight), the other pulls part ``j``'s result. If the result does not come
whole before the result deadline, the member fails the part over to its backup (or, if the
backup cannot be reached, to its aggregator: it re-reduces a part it abandoned, and serves one
it finished). Failure of one part is
that part's error; the caller (PartitionedRound.run) owns the tasks and gathers them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from dedloc.averaging.round_core import RoundCore
from dedloc.averaging.round_verifier import Unverified, VerifierRole
from dedloc.averaging.wire import Kind, ProtocolError, write_error, write_frame
from dedloc.errors import AveragingError
from dedloc.net.messages import wait_peer_closed

if TYPE_CHECKING:
    from dedloc.averaging.round_failover import FailoverRole

logger = logging.getLogger(__name__)
ACK_GRACE = 10.0


class MemberRole:
    """Every member's side of every part that another member aggregates."""

    def __init__(self, core: RoundCore, failover: "FailoverRole", verifier: VerifierRole):
        self.c, self.failover_role, self.verifier = core, failover, verifier
        fetch = core.group.members[core.me].fetch
        self.exchanges = [j for j in core.aggregators if j != core.me and (fetch or core.group.backup(j) == core.me)]
        """Parts this member takes part in as a member: all others' (only those it backs up, if it
        needs no result)."""
        self.send_errors: dict[int, str] = {}
        """Why this member's contribution to a part did not arrive, per part (as far as it can tell)."""

    async def exchange(self, j: int) -> None:
        """Contribute to part ``j`` (if this member has weight) and pull its result, both at once;
        fail the part over to its backup if the result does not come whole (or, in a verified round,
        does not pass verification)."""
        c, v = self.c, self.verifier
        sends = []
        if c.weight > 0:
            sends.append(asyncio.create_task(self.contribute(j)))
            b = c.group.backup(j)
            if c.group.verify and b is not None and b != c.me:
                sends.append(asyncio.create_task(self.contribute(j, to=b)))
        reason = ""
        try:
            async with asyncio.timeout_at(c.result_deadline):
                reader, writer = await c.open_stream(c.name(j))
                try:
                    await write_frame(writer, Kind.PULL, c.group.round_id, j)
                    await c.read_result(reader, writer, j, j)
                    if v.checks(j):
                        why = await v.judge(j, c.stats.part_weights[j])
                        if why is not None:
                            await write_error(writer, c.group.round_id, f"your result for part {j} is not verified: "
                                                                        f"{why}")
                            await wait_peer_closed(reader, ACK_GRACE)  # it must read the refusal, not a reset
                            raise Unverified(why)
                    elif c.group.backup(j) != c.me:
                        await v.confirm_copy(j)
                    c.have[j].set_result(True)
                    if c.group.backup(j) == c.me:
                        await self.confirm(writer, j)
                        await wait_peer_closed(reader, ACK_GRACE)  # we wrote last: let the ACK arrive
                    if sends:  # their last credits may still be on the way
                        await asyncio.wait(sends)
                    return
                finally:
                    writer.close()
        except TimeoutError:
            reason = "no result before the deadline"
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        finally:
            for send in sends:
                if not send.done():
                    send.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
        if c.have[j].done():  # got the result; only the ACK failed
            return
        c.have[j].set_result(False)
        await self.fail_over(j, reason)

    async def contribute(self, j: int, to: int | None = None) -> None:
        """Send this member's contribution to part ``j`` to its aggregator (or, as a CHECK copy in a
        verified round, to member ``to``, the part's backup); a refusal is logged (the result still comes)."""
        c = self.c
        target = j if to is None else to
        kind, label = (Kind.CONTRIB, f"c{j}>{j}") if to is None else (Kind.CHECK, f"v{j}>{to}")
        try:
            async with asyncio.timeout_at(c.reduce_deadline):
                reader, writer = await c.open_stream(c.name(target))
                try:
                    c.stats.add_sent(await write_frame(writer, kind, c.group.round_id, j, c.weight,
                                                       c.contribution(j), c.chunk_bytes, reader), label)
                finally:
                    writer.close()
        except ProtocolError as e:
            logger.warning(f"{c.prefix()}: {c.name(target)} did not take our {kind.name} for part {j}: {e}")
            if to is None:
                self.send_errors[j] = f"{c.name(target)} refused it: {e}"
        except Exception as e:
            logger.debug(f"{c.prefix()}: {kind.name} for part {j} did not arrive at {c.name(target)}: {e!r}")
            if to is None:
                self.send_errors[j] = f"it did not reach {c.name(target)}: {type(e).__name__}: {e}"

    async def confirm(self, writer: asyncio.StreamWriter, j: int) -> None:
        """As part ``j``'s backup, tell its aggregator that we hold its result (it completes
        everyone else's copy only after this)."""
        await write_frame(writer, Kind.ACK, self.c.group.round_id, j)

    async def fail_over(self, j: int, reason: str) -> None:
        """Get part ``j`` from its backup (re-reduced there from re-sent contributions, or the copy
        it holds); raises AveragingError if that fails too."""
        c = self.c
        b = c.group.backup(j)
        who = "we abandoned our part" if j == c.me else f"aggregator {c.name(j)} failed for part {j}"
        logger.warning(f"{c.prefix()}: {who} ({reason}); "
                       + (f"failing over to {c.name(b)}" if b is not None else "no backup"))
        if b is None:
            raise AveragingError(f"{who} ({reason}) and part {j} has no backup")
        c.stats.failovers += 1
        # the aggregator, tried only if the backup cannot be reached: it re-reduces a part it abandoned
        # (the failed contributor may be that backup), or serves the part it finished (a paused backup)
        for target in (b, j):
            if target == c.me:
                state = self.failover_role.state(j)
                await state.ready.wait()
                if state.error:
                    raise AveragingError(f"failover of part {j} failed: {state.error}")
                return
            async with asyncio.timeout_at(c.deadline):
                try:
                    reader, writer = await c.open_stream(c.name(target))
                except Exception as e:
                    if target == j or j == b:
                        raise
                    logger.warning(f"{c.prefix()}: backup {c.name(b)} of part {j} is unreachable ({e}); "
                                   f"asking its aggregator {c.name(j)}")
                    continue
                try:
                    c.stats.add_sent(await write_frame(writer, Kind.FAILOVER, c.group.round_id, j, c.weight,
                                                       c.contribution(j), c.chunk_bytes, reader), f"f{j}>{target}")
                    await c.read_result(reader, writer, j, target)
                    return
                finally:
                    writer.close()


__all__ = ["MemberRole", "ACK_GRACE"]
