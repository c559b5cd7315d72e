"""The aggregator's streamed part (dedloc/averaging/streamed_part.py): results become final
segment by segment while contributions arrive, over a contributor set fixed before the first
result byte; a contributor that fails after that abandons the part."""

import asyncio
import math

import pytest
import torch

from dedloc.averaging.bounds import TOO_LARGE
from dedloc.averaging.streamed_part import PartAbandoned, StreamedPart

SEG = 1000


def make(expected, numel=3500, wire_dtype=torch.float32):
    out = torch.full((numel,), math.nan)
    wire = out if wire_dtype == torch.float32 else torch.empty(numel, dtype=wire_dtype)
    part = StreamedPart(set(expected), out, wire)
    part.segment = SEG
    return part


def inputs(n, numel=3500):
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(numel, generator=gen) for _ in range(n)]


def test_segments_become_final_as_every_contributor_delivers_them():
    async def main():
        part = make({0, 1, 2})
        xs, ws = inputs(3), [1.0, 2.0, 3.0]
        ref = sum(w * x for w, x in zip(ws, xs)) / 6
        bufs = [torch.zeros(3500) for _ in range(3)]
        part.add_local(0, ws[0], xs[0])
        part.begin(1, ws[1], bufs[1])
        part.begin(2, ws[2], bufs[2])

        def deliver(k, upto):
            bufs[k][:upto] = xs[k][:upto]
            part.progress(k, upto)

        deliver(1, 2500)
        assert part.contributors is None and part.ready() == 0  # sender 2 has not sent a segment yet
        deliver(2, 999)
        assert part.contributors is None
        deliver(2, 1500)
        assert part.contributors == [0, 1, 2] and part.total_weight == 6.0
        assert part.produced == SEG and part.ready() == 4 * SEG  # one whole segment, before anything else
        torch.testing.assert_close(part.out[:SEG], ref[:SEG])
        waiter = asyncio.create_task(part.wait(4 * SEG))
        await asyncio.sleep(0)
        assert not waiter.done()
        deliver(2, 3500)
        assert part.produced == 2000  # whole segments only, and sender 1 holds the rest back
        await asyncio.wait_for(waiter, 1)
        deliver(1, 3500)
        assert part.produced == 3500 and part.done.is_set() and part.failed is None
        torch.testing.assert_close(part.out, ref)

    asyncio.run(main())


def test_a_sender_failing_before_the_commitment_is_excluded():
    async def main():
        part = make({0, 1, 2})
        xs = inputs(3)
        part.add_local(0, 1.0, xs[0])
        bad = xs[2].clone()
        bad[10] = math.nan
        part.begin(2, 1.0, bad)
        part.progress(2, 3500)
        assert part.contributors is None
        part.reject(1, "disconnected")  # sender 1 left before sending a segment
        assert part.contributors == [0] and part.rejected == {1: "disconnected", 2: TOO_LARGE}
        assert part.done.is_set() and part.failed is None
        assert torch.equal(part.out, xs[0])

    asyncio.run(main())


@pytest.mark.parametrize("how", ["left", "nan", "deadline"])
def test_a_contributor_failing_after_the_commitment_abandons_the_part(how):
    async def main():
        part = make({0, 1})
        xs = inputs(2)
        part.add_local(0, 1.0, xs[0])
        buf = xs[1].clone()
        if how == "nan":
            buf[3400] = math.inf
        part.begin(1, 1.0, buf)
        part.progress(1, 1200)
        assert part.contributors == [0, 1] and part.produced == SEG
        waiter = asyncio.create_task(part.wait(4 * 3500 - 1))
        if how == "left":
            part.reject(1, "disconnected")
        elif how == "nan":
            part.progress(1, 3500)
        else:
            part.expire()
        with pytest.raises(PartAbandoned, match="contributor 1"):
            await asyncio.wait_for(waiter, 1)
        assert part.done.is_set() and part.produced < 3500 and 1 in part.rejected
        with pytest.raises(PartAbandoned):
            await part.committed()  # a result stream not yet started gets the reason, not a payload

    asyncio.run(main())


def test_the_deadline_commits_to_the_complete_contributions():
    async def main():
        part = make({0, 1, 2})
        xs = inputs(3)
        part.add_local(0, 1.0, xs[0])
        part.begin(1, 3.0, xs[1])
        part.progress(1, 3500)
        part.begin(2, 1.0, torch.zeros(3500))
        part.progress(2, 500)  # sender 2 stalls within its first segment
        assert part.contributors is None
        part.expire()
        assert part.contributors == [0, 1] and part.rejected == {2: "timed out"} and part.failed is None
        torch.testing.assert_close(part.out, (xs[0] + 3 * xs[1]) / 4)
        assert not part.begin(2, 1.0, torch.zeros(3500))  # too late

    asyncio.run(main())


def test_float16_wire_keeps_exactly_what_members_receive():
    async def main():
        part = make({0, 1}, wire_dtype=torch.float16)
        xs = inputs(2)
        part.add_local(0, 1.0, xs[0])
        part.begin(1, 1.0, xs[1].half())
        part.progress(1, 3500)
        assert part.ready() == 2 * 3500 and part.failed is None
        assert torch.equal(part.out, part.wire.float())
        torch.testing.assert_close(part.out, (xs[0] + xs[1].half().float()) / 2, atol=2e-3, rtol=2e-3)

    asyncio.run(main())


def test_nobody_with_weight_leaves_nothing_to_commit():
    async def main():
        part = make({1})
        part.reject(1, "disconnected")
        assert part.failed == "no contribution with positive weight arrived for this part"
        with pytest.raises(PartAbandoned, match="no contribution"):
            await part.committed()

    asyncio.run(main())


def test_a_sender_that_never_starts_is_excluded_at_the_start_deadline():
    async def main():
        part = make({0, 1, 2})
        xs = inputs(3)
        part.add_local(0, 1.0, xs[0])
        buf = torch.zeros(3500)
        part.begin(1, 1.0, buf)
        part.expire_unstarted()  # sender 2 left after matchmaking; sender 1 has begun, so it stays
        assert part.contributors is None and part.rejected == {2: "did not start sending"}
        buf[:1000] = xs[1][:1000]
        part.progress(1, 1000)
        assert part.contributors == [0, 1] and part.produced == SEG

    asyncio.run(main())
