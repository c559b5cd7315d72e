"""A verified round's checks (``Group.verify``): the backup recomputes the part it backs up, and
every member checks its copy against the backup's.

Let ``b`` be the backup of part ``j``. Every sender streams a copy of its part-``j`` contribution
to ``b`` (CHECK frames, alongside its CONTRIB to ``j``; ``j`` sends its own too). ``b`` reduces the
copies in a StreamedPart exactly as ``j`` does: the same commitment rule and deadlines, the same
contributor order, the same arithmetic, so on the same platform the two results are bit-identical.
When ``j``'s result reaches ``b`` (the backup's copy is never held back), ``b`` compares it with its
own recomputation and ACKs only a match; on a mismatch it answers ERROR, which makes ``j`` withhold
the end of every other copy, and everyone, ``j`` included, takes part ``j`` from ``b``.

An aggregator that sends the backup one result and the members another is caught by the second
check: a member holding ``j``'s copy asks ``b`` for its verdict (VERDICT) and compares ``b``'s
digest (DIGEST, blake2b-256 of the wire bytes ``b`` settled on) with its own copy's. A mismatch,
or a verdict that the part is not verified, fails the part over to ``b``.

Guarantees, with ``j`` malicious and ``b`` honest: no honest member keeps a part ``j`` that differs
from the weighted mean of the contributions both received, beyond rounding (relative
``2 * eps`` of the wire dtype, for platforms whose arithmetic differs), unless ``b`` is unreachable
when the member asks (the copy is then kept, unverified, with a WARNING naming both peers).
``j`` is named in a WARNING. What it does not cover: a malicious backup (it can force a failover to
itself and serve anything, as in unverified rounds), the ring strategy, and a hierarchical
round's final broadcast by a representative (docs/security.md).

The role owns one StreamedPart and its two deadline timers per part it backs up; ``close()``
cancels the timers and abandons the parts.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import torch

from dedloc.averaging.round_core import RoundCore
from dedloc.averaging.streamed_part import StreamedPart
from dedloc.averaging.wire import DIGEST_BYTES, Header, Kind, ProtocolError, pack_header, read_error_text, \
    read_header, write_error, write_frame

logger = logging.getLogger(__name__)


def digest(t: torch.Tensor) -> bytes:
    """blake2b-256 of a CPU tensor's bytes."""
    return hashlib.blake2b(t.contiguous().view(-1).view(torch.uint8).numpy(), digest_size=DIGEST_BYTES).digest()


class Unverified(Exception):
    """A part's result did not pass verification; the message says why and names the aggregator."""


class _Check:
    """One backed-up part at this member: its recomputation and the copy this member settled on."""

    def __init__(self, part: StreamedPart, timers: list[asyncio.TimerHandle]):
        self.part, self.timers = part, timers
        self.settled: asyncio.Future = asyncio.get_running_loop().create_future()
        """The digest of this member's final copy of the part, or an Unverified exception."""


class VerifierRole:
    """Recompute the parts this member backs up (verified rounds only), answer verdicts on them,
    and check this member's copies of the others against their backups."""

    def __init__(self, core: RoundCore):
        self.c = core
        self._checks: dict[int, _Check] = {}
        if not core.group.verify:
            return
        loop = asyncio.get_running_loop()
        for j in core.aggregators:
            if core.group.backup(j) != core.me:
                continue
            s, e = core.bounds[j]
            out = torch.empty(e - s, dtype=torch.float32)  # not pooled: read until the round closes
            wire = out if core.wire_dtype == torch.float32 else torch.empty(e - s, dtype=core.wire_dtype)
            part = StreamedPart(core.senders, out, wire)
            timers = [loop.call_at(core.start_deadline, part.expire_unstarted),
                      loop.call_at(core.reduce_deadline, part.expire)]
            self._checks[j] = _Check(part, timers)
            core.add_own(part, j)

    # ---- as the backup -----------------------------------------------------------------------
    def checks(self, j: int) -> bool:
        """Whether this member verifies part ``j`` (a verified round, and it backs ``j`` up)."""
        return j in self._checks

    async def serve_copy(self, k: int, header: Header, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> bool:
        """Read member ``k``'s copy of its contribution to a part this member backs up."""
        return await self.c.serve_streamed(self._checks[header.part].part, header.part, k, header, reader, writer)

    async def judge(self, j: int, weight: float) -> str | None:
        """Compare aggregator ``j``'s result (in the output, with its header ``weight``) with the
        recomputation; None if it matches (this member then settles on it), else why not."""
        c, check = self.c, self._checks[j]
        await check.part.done.wait()
        if check.part.failed is not None:
            return f"the backup could not recompute it ({check.part.failed})"
        s, e = c.bounds[j]
        ours, theirs = check.part.out, c.output[s:e]
        if c.stats.part_sets.get(j) != tuple(check.part.contributors):
            return (f"its contributors {list(c.stats.part_sets.get(j, ()))} differ from the recomputation's "
                    f"{check.part.contributors}")
        if abs(weight - check.part.total_weight) > 1e-9 * max(1.0, weight):
            return (f"its weight {weight} differs from the recomputation's {check.part.total_weight} "
                    f"(different contributors)")
        if not torch.equal(ours, theirs):
            eps = 2 * torch.finfo(c.wire_dtype).eps
            err = (ours - theirs).abs_()
            size = ours.abs()
            tol = size.add_(size.mean()).mul_(eps)
            if not bool((err <= tol).all()):
                return f"its values differ from the recomputation by up to {float(err.max()):.3g}"
            logger.debug(f"{c.prefix()}: part {j} matched its recomputation within rounding, not bit for bit")
        c.stats.verified += 1
        self.settle(j)
        return None

    async def recomputation(self, j: int) -> StreamedPart | None:
        """This member's recomputation of part ``j`` once it has finished (by the reduce deadline at
        the latest): a failover serves it. None if this member does not check ``j`` or it failed."""
        check = self._checks.get(j)
        if check is None:
            return None
        await check.part.done.wait()
        return check.part if check.part.failed is None else None

    def settle(self, j: int, error: str | None = None) -> None:
        """This member's copy of part ``j`` is final (the output holds it), or there is none (``error``)."""
        check = self._checks.get(j)
        if check is None or check.settled.done():
            return
        if error is not None:
            check.settled.set_exception(Unverified(error))
            check.settled.exception()  # retrieved: nobody may ask
            return
        s, e = self.c.bounds[j]
        check.settled.set_result(digest(self.c.to_wire(self.c.output[s:e])))

    async def serve_verdict(self, k: int, header: Header, writer: asyncio.StreamWriter) -> bool:
        """Answer member ``k``: the digest of the copy of the part this member settled on, or ERROR."""
        c, check = self.c, self._checks[header.part]
        try:
            async with asyncio.timeout_at(c.deadline):
                value = await asyncio.shield(check.settled)
        except TimeoutError:
            await write_error(writer, c.group.round_id, f"part {header.part} was not settled before the deadline")
        except Unverified as e:
            await write_error(writer, c.group.round_id, f"part {header.part} is not verified: {e}")
        else:
            writer.write(pack_header(Kind.DIGEST, c.group.round_id, header.part, numel=len(value)) + value)
            await writer.drain()
        return True

    # ---- as a member ---------------------------------------------------------------------------
    async def confirm_copy(self, j: int) -> None:
        """Check this member's copy of part ``j`` (from its aggregator) against the backup's digest.
        Raises Unverified on a mismatch or a refusal (the caller fails the part over); keeps the copy,
        with a WARNING, if the backup cannot be reached."""
        c = self.c
        b = c.group.backup(j)
        if not c.group.verify or b is None or b == c.me or j == c.me:
            return
        try:
            reader, writer = await c.open_stream(c.name(b))
        except (ConnectionError, OSError) as e:
            logger.warning(f"{c.prefix()}: part {j} from {c.name(j)} is unverified: its backup {c.name(b)} "
                           f"is unreachable ({e})")
            return
        try:
            await write_frame(writer, Kind.VERDICT, c.group.round_id, j)
            header = await read_header(reader)
            if header.kind == Kind.ERROR:
                raise Unverified(f"backup {c.name(b)} answered: {await read_error_text(reader, header)}")
            if header.kind != Kind.DIGEST or header.part != j:
                raise ProtocolError(f"expected DIGEST for part {j}, got {header.kind.name} for part {header.part}")
            theirs = await reader.readexactly(DIGEST_BYTES)
        finally:
            writer.close()
        s, e = c.bounds[j]
        if theirs != digest(c.to_wire(c.output[s:e])):  # named in the failover's WARNING
            raise Unverified(f"aggregator {c.name(j)}'s result differs from the copy its backup verified")
        c.stats.verified += 1

    def close(self) -> None:
        for j, check in self._checks.items():
            for timer in check.timers:
                timer.cancel()
            check.part.abandon("the round ended")
            self.settle(j, "the round ended")


__all__ = ["VerifierRole", "Unverified", "digest"]
