"""A partitioned round's amendment: one contributor set for every part.

Each aggregator fixes its part's contributors on its own (streamed_part.py), so a sender that dies,
stalls or is refused after reaching some aggregators but not others leaves parts that average
different sets of samples. Every RESULT is preceded by its contributor set (CONTRIBUTORS), and every
member holds the same copy of each part, so once a member holds every part it knows whether the
sets differ, and every member decides alike:

- equal sets (the common case): nothing more happens; the cost is the set's few bytes per result;
- different sets: the round's contributors ``C`` are the intersection of the parts' sets, and every
  part whose set is larger is re-reduced with exactly ``C``. Its *fixer* is the part's backup (or,
  for a member that cannot reach the backup or that the backup answers it does not know the round, as
  a restarted one does to everyone, the part's aggregator). Every member asks the fixer
  with CONTRIBUTORS(C) then AMEND; members of ``C`` re-send their contribution in the AMEND frame.
  The fixer reads the contributions one at a time, in member order, and reduces them in that
  order, so the backup and the aggregator produce the same bits from the same inputs; it answers
  everyone with CONTRIBUTORS(C) and RESULT. Cost: the amended parts' bytes once more.

Failure: a member of ``C`` that does not deliver its contribution, a request naming another set,
or the round deadline fail the amended part for everyone who asked it; ``run()`` then raises
AveragingError on every member, and no member takes an update that mixes sets. Each amendment is
owned by this role; ``close()`` fails the unfinished ones.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from dedloc.averaging.round_core import RoundCore
from dedloc.averaging.wire import Header, Kind, ProtocolError, UnknownRound, read_contributors, read_header, \
    write_contributors, write_error, write_frame
from dedloc.errors import AveragingError

logger = logging.getLogger(__name__)


class Amendment:
    """One part re-reduced at its fixer with exactly the agreed contributors, in member order."""

    def __init__(self, core: RoundCore, j: int, agreed: tuple[int, ...]):
        self.c, self.j, self.agreed = core, j, agreed
        s, e = core.bounds[j]
        self.out = torch.zeros(e - s, dtype=torch.float32)  # not pooled: result streams may read it late
        self.total_weight = sum(core.group.members[k].weight for k in agreed)
        self.turn = 0
        """Index into ``agreed`` of the contribution to add next."""
        self.error: str | None = None
        self.done = asyncio.Event()
        self._changed = asyncio.Event()
        self._timer = asyncio.get_running_loop().call_at(core.deadline, self.fail, "the round's deadline passed")
        self._advance()

    def fail(self, why: str) -> None:
        if not self.done.is_set():
            self.error = f"the amendment of part {self.j} failed: {why}"
            self._finish()

    async def take(self, k: int, header: Header, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read member ``k``'s re-sent contribution when its turn comes (a member outside the
        agreed set sends none). Raises ProtocolError or ConnectionError for a bad or broken one
        (the caller fails the amendment)."""
        c = self.c
        if k not in self.agreed:
            if header.numel:
                raise ProtocolError(f"sent a contribution to part {self.j}, but it is not among the agreed "
                                    f"contributors")
            return
        c.check_weight(header, c.group.members[k])
        while not self.done.is_set() and self.agreed[self.turn] != k:
            await self._changed.wait()
        if self.done.is_set():
            return
        data = await c.read_part(reader, writer, header, self.j, k)
        self._add(k, data)
        c.pool.give(data)

    async def serve(self, k: int, writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> None:
        """Answer member ``k`` with the amended part (or ERROR) once it is done."""
        c = self.c
        await self.done.wait()
        if self.error is not None:
            await write_error(writer, c.group.round_id, self.error)
            return
        await write_contributors(writer, c.group.round_id, self.j, self.agreed, len(c.group.members))
        c.stats.add_sent(await write_frame(writer, Kind.RESULT, c.group.round_id, self.j, self.total_weight,
                                           c.to_wire(self.out), c.chunk_bytes, reader), f"a{self.j}>{k}")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _add(self, k: int, data: torch.Tensor) -> None:
        if self.done.is_set():
            return
        weight = self.c.group.members[k].weight
        if self.turn == 0:
            self.out.copy_(data).mul_(weight)
        else:
            self.out.add_(data, alpha=weight)
        self.turn += 1
        self._advance()

    def _advance(self) -> None:
        """Add this member's own contribution when its turn comes; finish after the last."""
        c = self.c
        if self.turn < len(self.agreed) and self.agreed[self.turn] == c.me:
            s, e = c.bounds[self.j]
            self._add(c.me, c.rounded(c.local[s:e]))
            return
        if self.turn == len(self.agreed):
            self.out.div_(self.total_weight)
            self.out.copy_(c.rounded(self.out))  # keep exactly what the members receive
            self._finish()
        else:
            self._notify()

    def _finish(self) -> None:
        self._timer.cancel()
        self.done.set()
        self._notify()


class AmendRole:
    """Check the parts' contributor sets (as a member) and serve amendments (as a fixer)."""

    def __init__(self, core: RoundCore):
        self.c = core
        self._parts: dict[int, Amendment] = {}
        self.amended: list[int] = []
        """Parts this member took amended."""

    def fixers(self, j: int) -> list[int]:
        """Who re-reduces part ``j``: its backup, else (unreachable) its aggregator."""
        b = self.c.group.backup(j)
        return [j] if b is None or b == j else [b, j]

    def fixes(self, j: int) -> bool:
        return j in self.c.aggregators and self.c.me in self.fixers(j)

    def state(self, j: int, agreed: tuple[int, ...]) -> Amendment:
        """Part ``j``'s amendment at this member, started on first use. ProtocolError if another
        member named another set."""
        part = self._parts.get(j)
        if part is None:
            part = self._parts[j] = Amendment(self.c, j, agreed)
        elif part.agreed != agreed:
            raise ProtocolError(f"named contributors {list(agreed)} for part {j}, whose amendment uses "
                                f"{list(part.agreed)}")
        return part

    # ---- as a member -------------------------------------------------------------------------
    async def agree(self, send_errors: dict[int, str]) -> None:
        """Called once this member holds every part: amend the parts whose contributor set is not
        the round's (see the module doc); set ``stats.contributors``. Raises AveragingError if an
        amendment fails. ``send_errors``: why this member's own contributions did not arrive, per
        part, for the log."""
        c = self.c
        sets = {j: c.stats.part_sets[j] for j in c.aggregators
                if j in c.stats.part_sets and c.bounds[j][1] > c.bounds[j][0]}  # an empty part averages nothing
        distinct = set(sets.values())
        if len(distinct) <= 1:
            c.stats.contributors = distinct.pop() if distinct else tuple(sorted(c.senders))
            return
        agreed = tuple(sorted(set.intersection(*map(set, distinct))))
        if not any(c.group.members[k].weight > 0 for k in agreed):
            raise AveragingError(f"{c.prefix()}: the parts averaged different contributors and none is common "
                                 f"to all: {self._describe(sets, agreed)}")
        todo = sorted(j for j, found in sets.items() if found != agreed)
        ours = "; ".join(f"our contribution to part {j}: {why}" for j, why in sorted(send_errors.items())
                         if c.me not in sets.get(j, (c.me,)))
        logger.warning(f"{c.prefix()}: the parts averaged different contributors ({self._describe(sets, agreed)}"
                       + (f"; {ours}" if ours else "") + f"); re-reducing part(s) {todo} with the {len(agreed)} "
                       f"contributors every part has")
        results = await asyncio.gather(*(self._amend(j, agreed) for j in todo), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise AveragingError(f"{c.prefix()}: {len(errors)} part(s) could not be re-reduced with one contributor "
                                 f"set: {errors[0]}")
        self.amended = todo
        c.stats.contributors = agreed

    def _describe(self, sets: dict[int, tuple[int, ...]], agreed: tuple[int, ...]) -> str:
        """Which parts include whom beyond the agreed set, and how many parts each such sender reached."""
        c = self.c
        extra = sorted(set().union(*map(set, sets.values())) - set(agreed))
        return "; ".join(f"{c.name(k)} reached {sum(k in f for f in sets.values())} of {len(sets)} parts "
                         f"(missing from part(s) {sorted(j for j, f in sets.items() if k not in f)})" for k in extra)

    async def _amend(self, j: int, agreed: tuple[int, ...]) -> None:
        c = self.c
        targets = self.fixers(j)
        for i, target in enumerate(targets):
            if target == c.me:
                part = self.state(j, agreed)
                await part.done.wait()
                if part.error is not None:
                    raise AveragingError(part.error)
                s, e = c.bounds[j]
                c.output[s:e] = part.out
                c.stats.part_weights[j], c.stats.part_sets[j] = part.total_weight, agreed
                return
            try:
                reader, writer = await c.open_stream(c.name(target))
            except Exception as e:
                if i + 1 == len(targets):
                    raise
                logger.warning(f"{c.prefix()}: {c.name(target)} cannot be reached to re-reduce part {j} ({e}); "
                               f"asking {c.name(targets[i + 1])}")
                continue
            try:
                await write_contributors(writer, c.group.round_id, j, agreed, len(c.group.members))
                mine = c.me in agreed
                c.stats.add_sent(await write_frame(writer, Kind.AMEND, c.group.round_id, j, c.weight if mine else 0.0,
                                                   c.contribution(j) if mine else None, c.chunk_bytes, reader),
                                 f"a{j}>{target}")
                await c.read_result(reader, writer, j, target)
            except UnknownRound:  # it restarted: it holds nothing of the round, and says so to everyone
                if i + 1 == len(targets):
                    raise
                logger.warning(f"{c.prefix()}: {c.name(target)} does not know the round (it restarted), so it cannot "
                               f"re-reduce part {j}; asking {c.name(targets[i + 1])}")
                continue
            finally:
                writer.close()
            if c.stats.part_sets[j] != agreed:
                raise ProtocolError(f"{c.name(target)} re-reduced part {j} with contributors "
                                    f"{list(c.stats.part_sets[j])}, not the agreed {list(agreed)}")
            return

    # ---- as a fixer --------------------------------------------------------------------------
    async def serve(self, k: int, header: Header, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve member ``k``'s amendment request (its CONTRIBUTORS header read): take its contribution
        in turn, answer the amended part. True if this side wrote last."""
        c, j = self.c, header.part
        member = c.group.members[k]
        part = None
        try:
            agreed = c.check_contributors(await read_contributors(reader, header, len(c.group.members)), j)
            part = self.state(j, agreed)
            request = await read_header(reader)
            if request.kind != Kind.AMEND or request.part != j:
                raise ProtocolError(f"expected AMEND for part {j}, got {request.kind.name} for part {request.part}")
            await part.take(k, request, reader, writer)
        except ProtocolError as e:
            logger.warning(f"{c.prefix()}: refused the amendment request of peer {member.peer_id} for part {j}: {e}")
            if part is not None and k in part.agreed:  # its contribution will not come
                part.fail(f"the contribution of {member.peer_id} was refused ({e})")
            await write_error(writer, c.group.round_id, str(e))
            return True
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.info(f"{c.prefix()}: peer {member.peer_id} left while re-sending part {j}")
            if part is not None and k in part.agreed:
                part.fail(f"the contribution of {member.peer_id} did not arrive ({type(e).__name__}: {e})")
            return False
        await part.serve(k, writer, reader)
        return True

    def close(self) -> None:
        for part in self._parts.values():
            part.fail("the round ended")


__all__ = ["AmendRole", "Amendment"]
