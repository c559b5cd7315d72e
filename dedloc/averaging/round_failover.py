"""A partitioned round's failover role: the backup of a failed aggregator's part.

When members fail part ``j`` over to this member (its backup), it serves the result it already
pulled from the aggregator if it has it (in a verified round: if it passed verification); in a
verified round, otherwise its own recomputation of the part; otherwise it asks the aggregator
for its finished part once more (our pull may have failed only because this peer was paused),
and only if that fails re-reduces the part from the contributions the members re-send (FAILOVER
frames), waiting for every sender but the failed aggregator until the failover deadline. Each
part's failover runs as a task this role owns; ``close()`` cancels them.
"""

from __future__ import annotations

import asyncio
import logging

from dedloc.averaging.accumulator import PartAccumulator
from dedloc.averaging.round_core import RoundCore
from dedloc.averaging.round_verifier import VerifierRole
from dedloc.averaging.wire import Header, Kind, ProtocolError, write_error, write_frame
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
REFETCH_WAIT = 2.0
"""How long a backup whose pull failed tries to reach the aggregator again before it re-reduces."""


class Failover:
    """One part's failover at this member: the contributions re-sent to it, and its outcome."""

    def __init__(self, acc: PartAccumulator):
        self.acc = acc
        self.ready = asyncio.Event()
        self.error: str | None = None


class FailoverRole:
    def __init__(self, core: RoundCore, verifier: VerifierRole):
        self.c, self.verifier = core, verifier
        self._parts: dict[int, Failover] = {}
        self._tasks = Tasks("failover")

    def state(self, j: int) -> Failover:
        """Part ``j``'s failover at this member, started on first use."""
        if j not in self._parts:
            c = self.c
            s, e = c.bounds[j]
            # the failed aggregator is not waited for, but taken if it abandoned its part and re-sends
            state = Failover(PartAccumulator(c.senders - {j}, e - s, c.pool.take(e - s, zero=True),
                                             optional={j} & c.senders))
            self._parts[j] = state
            self._tasks.spawn(self._run(j, state), name=f"dedloc-failover-{j}")
        return self._parts[j]

    async def _run(self, j: int, state: Failover) -> None:
        c = self.c
        try:
            async with asyncio.timeout_at(c.deadline):
                if await c.have[j]:
                    return  # we hold the failed aggregator's (verified) result: serve that copy
                s, e = c.bounds[j]
                recomputed = await self.verifier.recomputation(j)  # a verified round: we hold the part already
                if recomputed is not None:
                    c.output[s:e] = recomputed.out
                    c.stats.part_weights[j] = recomputed.total_weight
                    c.stats.part_sets[j] = tuple(recomputed.contributors)
                    logger.info(f"{c.prefix()}: serving our recomputation of part {j} in place of aggregator "
                                f"{c.name(j)}'s result")
                    return
                c.add_own(state.acc, j)
                if await self._refetch(j):  # re-sent contributions keep arriving meanwhile
                    return
                await state.acc.wait(c.failover_deadline)
                mean = state.acc.finish()
                c.output[s:e] = c.rounded(mean)
                c.pool.give(mean)
                c.stats.part_weights[j] = state.acc.total_weight
                c.stats.part_sets[j] = tuple(sorted(state.acc.contributors))
                logger.info(f"{c.prefix()}: re-reduced part {j} of failed aggregator {c.name(j)} "
                            f"from {len(state.acc.contributors)} contributions")
        except Exception as e:
            state.error = f"{type(e).__name__}: {e}"
        finally:
            self.verifier.settle(j, state.error)
            state.ready.set()

    async def _refetch(self, j: int) -> bool:
        """Fetch aggregator ``j``'s finished part once more (our pull failed: e.g. this peer was paused
        past the result deadline, and the aggregator gave up waiting for our confirmation). While it
        is alive and holds the part, serving that copy keeps every member's part ``j`` identical:
        members that cannot reach us fetch the same copy from it; a re-reduction would differ. False
        within REFETCH_WAIT if it is gone or frozen, or at once if it does not hold a final part."""
        c = self.c
        try:
            async with asyncio.timeout(REFETCH_WAIT):
                reader, writer = await c.open_stream(c.name(j))
        except Exception as e:
            logger.debug(f"{c.prefix()}: could not fetch part {j} again from {c.name(j)}: {e!r}")
            return False
        try:
            async with asyncio.timeout_at(c.failover_deadline):
                await write_frame(writer, Kind.PULL, c.group.round_id, j)
                await c.read_result(reader, writer, j, j)
        except Exception as e:
            logger.debug(f"{c.prefix()}: could not fetch part {j} again from {c.name(j)}: {e!r}")
            return False
        finally:
            writer.close()
        logger.info(f"{c.prefix()}: serving aggregator {c.name(j)}'s result for part {j}, fetched again after "
                    f"our first pull failed (not re-reduced: members that cannot reach us get the same copy)")
        return True

    async def serve(self, k: int, header: Header, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> bool:
        """Take member ``k``'s re-sent contribution to the part it names, and answer the part's result."""
        c = self.c
        j = header.part
        state = self.state(j)
        try:
            await self._receive(k, header, reader, writer, j, state.acc)
        except ConnectionError:
            return False
        await state.ready.wait()
        if state.error:
            await write_error(writer, c.group.round_id, state.error)
        else:
            await c.send_result(reader, writer, j, c.stats.part_weights.get(j, 0.0), k)
        return True

    async def _receive(self, k: int, header: Header, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       part: int, acc: PartAccumulator) -> None:
        c = self.c
        member = c.group.members[k]
        try:
            if header.part != part:
                raise ProtocolError(f"sent part {header.part}, expected part {part}")
            s, e = c.bounds[part]
            if header.numel == 0 and (member.weight == 0 or e == s):
                if member.weight > 0:
                    acc.add(k, member.weight, c.local[s:e])  # an empty part: only the weight counts
                return
            c.check_weight(header, member)
            data = await c.read_part(reader, writer, header, part, k)
            acc.add(k, member.weight, data)
            c.pool.give(data)
        except ProtocolError as e:
            logger.warning(f"{c.prefix()}: rejected contribution of peer {member.peer_id} to part {part}: {e}")
            acc.reject(k, str(e))
            c.stats.excluded[member.peer_id] = str(e)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.info(f"{c.prefix()}: peer {member.peer_id} left while sending part {part}")
            acc.reject(k, f"disconnected: {e}")
            raise ConnectionError("sender left") from None

    def close(self) -> None:
        self._tasks.cancel()


__all__ = ["FailoverRole", "Failover"]
