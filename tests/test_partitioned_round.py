"""The partitioned round's protocol, run in one process over socket pairs (net/transport.LocalPairs, no daemons).

What is checked here is an ordering rule of the backup protocol (docs/averaging.md): an
aggregator sends its result to every member at once, but nobody except the backup can complete
it before the backup has confirmed that it holds a copy.
"""

import asyncio
from typing import Callable

import pytest
import torch

from dedloc.averaging.bounds import TOO_LARGE
from dedloc.averaging.allreduce import PartitionedRound
from dedloc.averaging.round_aggregator import AggregatorRole
from dedloc.averaging.round_amend import AmendRole
from dedloc.averaging.round_member import MemberRole
from dedloc.averaging.group import Group, Member
from dedloc.averaging.wire import UNKNOWN_ROUND, Kind, read_header, write_contributors, write_error, write_frame
from dedloc.errors import AveragingError
from dedloc.net.transport import LocalPairs

RID = bytes(range(16))
PROTO = "dedloc.test.allreduce"


class RefusingMember(MemberRole):
    async def confirm(self, writer, j):
        await write_frame(writer, Kind.ERROR, self.c.group.round_id, j)


class RefusingBackup(PartitionedRound):
    """A backup that reads its aggregator's result, then answers ERROR instead of ACK."""

    member_role = RefusingMember


async def run_rounds(group: Group, xs: list[torch.Tensor], kinds: list[type], timeout: float = 20.0,
                     out_of_reach: Callable[[PartitionedRound, str], bool] = lambda rnd, peer: False):
    """Run one round per member, connected by in-process socket pairs (net/transport.LocalPairs);
    returns (outputs or errors, rounds). A stream that ``out_of_reach(round, peer)`` names fails to
    open, as a paused peer's hello does."""
    pairs = LocalPairs()
    rounds: list[PartitionedRound] = []

    def serve(i: int):
        async def handler(info, reader, writer) -> bool:
            return await rounds[i].handle(info.peer_id.to_base58(), await read_header(reader), reader, writer)
        return handler

    def opener(i: int, me):
        async def open_stream(peer: str):
            if out_of_reach(rounds[i], peer):
                raise ConnectionError(f"peer {peer} did not answer the hello")
            return await me.open(peer, PROTO)
        return open_stream

    for i, kind in enumerate(kinds):
        me = pairs.transport(group.members[i].peer_id)
        await me.serve(PROTO, serve(i))
        rounds.append(kind(group, i, xs[i], group.members[i].weight, opener(i, me), timeout))
    try:
        outs = await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)
        await pairs.close(timeout)
    finally:
        for r in rounds:
            r.close()
    return outs, rounds


def labels(rnd: PartitionedRound) -> set[str]:
    return {label for label, _ in rnd.stats.payloads}


def test_nobody_completes_a_result_its_backup_did_not_confirm():
    """Member 1 backs up part 0 and refuses to confirm it. Member 2 got most of part 0 from
    aggregator 0 alongside member 1, but never its end: it fails over to member 1, which serves
    the copy it holds. Every member ends with the same, exact mean."""
    numel = 300_001  # parts of ~400 KB: many credit units, so the withheld end is a small part of each
    group = Group(RID, 0, tuple(Member(f"p{i}", float(i + 1), 1.0) for i in range(3)))
    assert group.backup(0) == 1
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(numel, generator=gen) for _ in range(3)]
    ref = sum((i + 1) * x for i, x in enumerate(xs)) / 6

    outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound, RefusingBackup, PartitionedRound]))

    for out in outs:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], ref, atol=1e-5, rtol=1e-5)
    assert "r0<0" in labels(rounds[1]) and "r0<0" not in labels(rounds[2])  # nobody but the backup got it...
    assert {"f0>1", "r0<1"} <= labels(rounds[2]) and rounds[2].stats.failovers == 1  # ...the rest failed over
    assert rounds[0].stats.failovers == rounds[1].stats.failovers == 0


def test_results_go_to_every_member_at_once():
    """With a confirming backup, no member's result waits for another member's: the results
    an aggregator sends overlap in time (before, the backup's copy went first, alone)."""
    numel = 3_000_001
    group = Group(RID, 0, tuple(Member(f"p{i}", 1.0, 1.0) for i in range(4)))
    xs = [torch.full((numel,), float(i)) for i in range(4)]

    outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound] * 4))

    for out in outs:
        assert torch.equal(out, torch.full((numel,), 1.5))
    for j, rnd in enumerate(rounds):
        sent = {label: t for label, t in rnd.stats.payloads if label.startswith(f"r{j}>")}
        assert len(sent) == 3
        assert max(t.start for t in sent.values()) < min(t.end for t in sent.values()), sent


def test_a_contribution_failing_after_its_part_streamed_fails_the_part_over():
    """Member 3's contribution to part 0 turns NaN in its last segment, after aggregator 0 has
    fixed the contributors and begun streaming the result. Aggregator 0 abandons the part and
    cuts its result streams; everyone (aggregator 0 too) takes part 0 from its backup, which
    re-reduces it without member 3. The other parts included member 3, so they are amended:
    re-reduced with the contributors part 0 has, and the whole vector is one set's mean."""
    numel = 3_000_001  # parts of 750k floats: three 1 MiB segments each
    group = Group(RID, 0, tuple(Member(f"p{i}", 1.0, 1.0) for i in range(4)))
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(numel, generator=gen) for _ in range(4)]
    s, e = group.part_bounds(numel)[0]
    xs[3][e - 1] = float("nan")

    outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound] * 4))

    for out in outs:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, outs[0])
    agreed = rounds[0].stats.contributors
    assert agreed in ((1, 2), (0, 1, 2)), agreed  # aggregator 0's re-sent copy is optional
    assert all(r.stats.contributors == agreed for r in rounds)
    torch.testing.assert_close(outs[0], sum(xs[k] for k in agreed) / len(agreed), atol=1e-5, rtol=1e-5)
    assert all(r.amend.amended == [1, 2, 3] for r in rounds)
    assert all(r.stats.failovers == 1 for r in rounds)
    assert "f0>1" in labels(rounds[0]) and "f0>1" in labels(rounds[2]) and "r0<1" in labels(rounds[3])
    assert rounds[0].stats.excluded == {"p3": TOO_LARGE}


class SkipsPart2(MemberRole):
    """A member that sends its contributions to every part but part 2 (as if its path to that
    aggregator broke, or it died between its sends)."""

    async def contribute(self, j, to=None):
        if j != 2:
            await super().contribute(j, to)


class PartialSender(PartitionedRound):
    member_role = SkipsPart2


class AmendWithoutResending(AmendRole):
    """Asks for the amendment, but never re-sends its own contribution (as if it died then)."""

    async def _amend(self, j, agreed):
        c = self.c
        if c.me in self.fixers(j):
            return await super()._amend(j, agreed)
        reader, writer = await c.open_stream(c.name(self.fixers(j)[0]))
        await write_contributors(writer, c.group.round_id, j, agreed, len(c.group.members))
        writer.close()
        raise AveragingError("left")


class LeavesDuringAmendment(PartialSender):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.amend = AmendWithoutResending(self.core)


def without_member_3(kind: type, seed: int) -> list[PartitionedRound]:
    """Members 0-2 honest (weights 1-3), member 3 of ``kind``: checks that every member ends with the
    same bits, the mean over members 0-2 only, and that every round names that set; returns the rounds."""
    numel = 400_003
    group = Group(RID, 0, tuple(Member(f"p{i}", float(i + 1), 1.0) for i in range(4)))
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=gen) for _ in range(4)]
    outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound] * 3 + [kind], timeout=8.0))
    for out in outs:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], (xs[0] + 2 * xs[1] + 3 * xs[2]) / 6, atol=1e-5, rtol=1e-5)
    assert all(r.stats.contributors == (0, 1, 2) for r in rounds)
    return rounds


def test_parts_that_averaged_different_contributors_are_amended_to_one_set(caplog):
    """Member 3 reaches aggregators 0, 1 and 3 but never aggregator 2, which leaves it out of
    part 2. The other parts included it, so every member takes them re-reduced with the
    contributors part 2 has: the whole vector is the mean over members 0-2, identical
    everywhere, and every member's log names member 3 and the part it is missing from."""
    with caplog.at_level("WARNING", logger="dedloc.averaging"):
        rounds = without_member_3(PartialSender, 7)
    assert all(r.amend.amended == [0, 1, 3] for r in rounds)
    assert all(r.stats.part_weights == {0: 6.0, 1: 6.0, 2: 6.0, 3: 6.0} for r in rounds)
    assert caplog.text.count("p3 reached 3 of 4 parts (missing from part(s) [2])") == 4, caplog.text


class SkipsPart0(MemberRole):
    async def contribute(self, j, to=None):
        if j != 0:
            await super().contribute(j, to)


class ForgetsTheRound(AmendRole):
    """Answers every amendment request as a restarted process does: it does not know the round."""

    async def serve(self, k, header, reader, writer):
        await write_error(writer, self.c.group.round_id, UNKNOWN_ROUND)
        return True


class RestartedAfterItsSends(PartitionedRound):
    """A member that died between its sends (it never reached aggregator 0) and came back under the
    same identity before the amendments: it backs up part 2, and knows nothing of the round."""

    member_role = SkipsPart0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.amend = ForgetsTheRound(self.core)


def test_an_amendment_whose_fixer_restarted_is_asked_of_the_next_fixer(caplog):
    """Part 0 lacks member 3, so parts 1-3 are amended. Part 2's fixer is its backup, member 3, which
    restarted and answers that it does not know the round: every member asks part 2's aggregator
    instead (as when the backup cannot be reached), and members 0-2 end with the same exact mean over
    themselves. Before, each of them failed the round on that answer."""
    numel = 400_003
    group = Group(RID, 0, tuple(Member(f"p{i}", float(i + 1), 1.0) for i in range(4)))
    assert group.backup(2) == 3
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(numel, generator=gen) for _ in range(4)]
    with caplog.at_level("WARNING", logger="dedloc.averaging"):
        outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound] * 3 + [RestartedAfterItsSends],
                                              timeout=8.0))
    for out in outs[:3]:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], (xs[0] + 2 * xs[1] + 3 * xs[2]) / 6, atol=1e-5, rtol=1e-5)
    assert all(r.stats.contributors == (0, 1, 2) and r.amend.amended == [1, 2, 3] for r in rounds[:3])
    assert caplog.text.count("p3 does not know the round (it restarted), so it cannot re-reduce part 2; "
                             "asking p2") == 3, caplog.text  # members 0-2 (aggregator 2 asks the backup first too)


class Rejoined(PartitionedRound):
    """A member whose first join for the step answered too late: the leader kept it in the group with
    its old weight, and it runs the round with the gradients it accumulated since (half as many)."""

    def __init__(self, group, me, local, weight, *args, **kwargs):
        super().__init__(group, me, local, weight / 2, *args, **kwargs)


def test_a_member_bringing_another_weight_than_agreed_is_left_out_of_every_part(caplog):
    """Found by the soak: the other aggregators refused such a member's contributions for their
    weight, but its own part took its own contribution, with the new weight. Now its own part
    leaves it out too: one contributor set without an amendment, and the member is told why."""
    with caplog.at_level("WARNING", logger="dedloc.averaging"):
        rounds = without_member_3(Rejoined, 9)
    assert all(r.amend.amended == [] for r in rounds)
    assert "this peer is in the group with weight 4.0 (an earlier join for this step) but now brings 2.0" in caplog.text


def test_an_amendment_whose_contributor_leaves_fails_the_round_for_every_member():
    """As above, but member 2 (an agreed contributor) asks for the amendments and then never
    re-sends its contribution: the amended parts cannot be made, and every member's round fails
    with an error naming the missing contribution, instead of some taking a mixed vector."""
    numel = 400_003
    group = Group(RID, 0, tuple(Member(f"p{i}", 1.0, 1.0) for i in range(4)))
    xs = [torch.full((numel,), float(i)) for i in range(4)]

    outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound] * 2 + [LeavesDuringAmendment, PartialSender],
                                          timeout=8.0))

    for i, out in enumerate(outs):
        assert isinstance(out, AveragingError), (i, out)
    assert any("the contribution of p2 did not arrive" in str(out) for out in outs), outs


class Cheater(AggregatorRole):
    """An aggregator that adds 1000 to the first quarter of its part, in the copies it sends to
    ``victims`` (every member, or all but its backup)."""

    spare_backup = False

    async def _stream(self, reader, writer, to, hold=None):
        c, part = self.c, self.part
        if self.spare_backup and c.group.backup(c.me) == to:
            return await super()._stream(reader, writer, to, hold)
        await part.done.wait()
        wrong = part.wire.clone()
        wrong[: wrong.numel() // 4] += 1000
        await write_contributors(writer, c.group.round_id, c.me, tuple(part.contributors), len(c.group.members))
        await write_frame(writer, Kind.RESULT, c.group.round_id, c.me, part.total_weight, wrong, c.chunk_bytes,
                          reader, hold)


class CheatingRound(PartitionedRound):
    aggregator_role = Cheater


class TwoFacedCheater(Cheater):
    spare_backup = True


class TwoFacedRound(PartitionedRound):
    aggregator_role = TwoFacedCheater


def verified_round(numel: int, seed: int, n: int = 4):
    """A verified group of n members weighted 1..n, their random vectors, and the exact weighted mean."""
    group = Group(RID, 0, tuple(Member(f"p{i}", float(i + 1), 1.0) for i in range(n)), verify=True)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    return group, xs, sum((i + 1) * x for i, x in enumerate(xs)) / (n * (n + 1) / 2)


def test_a_verified_round_gives_the_same_result_and_checks_every_part():
    """Verification changes nothing in an honest round: bit-identical to the unverified round; each
    backup recomputed its part and every other member checked its copy against the backup's."""
    group, xs, _ = verified_round(1_000_003, 7)
    plain = Group(RID, 0, group.members)
    expected, _ = asyncio.run(run_rounds(plain, [x.clone() for x in xs], [PartitionedRound] * 4))

    outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound] * 4))

    for out in outs:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, expected[0])
    assert all(r.stats.failovers == 0 and r.stats.verified == 3 for r in rounds)  # 1 recomputed + 2 checked
    for j, r in enumerate(rounds):
        b = (j + 1) % 4  # the backup of part j
        assert f"v{j}>{b}" in labels(r)  # j's own contribution copied to its backup


@pytest.mark.parametrize("cheat", [CheatingRound, TwoFacedRound], ids=["same-lie-to-all", "honest-to-backup-only"])
def test_an_aggregator_that_changes_its_part_is_caught(cheat, caplog):
    """Aggregator 0 adds 1000 to a quarter of its part: in every copy (its backup refuses it, and
    everyone takes the backup's recomputation), or in every copy but its backup's (every other member
    finds its copy differs from the backup's digest). Either way the honest members end with the exact
    mean, identical, and aggregator 0 is named."""
    group, xs, ref = verified_round(400_001, 11)

    with caplog.at_level("WARNING", logger="dedloc.averaging"):
        outs, rounds = asyncio.run(run_rounds(group, xs, [cheat, PartitionedRound, PartitionedRound,
                                                          PartitionedRound]))

    for out in outs[1:]:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, outs[1])
    torch.testing.assert_close(outs[1], ref, atol=1e-5, rtol=1e-5)
    assert "aggregator p0 failed for part 0" in caplog.text, caplog.text
    assert rounds[2].stats.failovers == rounds[3].stats.failovers == 1
    if cheat is CheatingRound:
        assert "not verified: its values differ from the recomputation" in caplog.text
        assert isinstance(outs[0], torch.Tensor) and torch.equal(outs[0], outs[1])  # it took the backup's copy too
    else:
        assert "differs from the copy its backup verified" in caplog.text


class Mute(AggregatorRole):
    """An aggregator whose result streams all break (it is cut off from everyone after reducing)."""

    async def _stream(self, reader, writer, to, hold=None):
        raise ConnectionError("cut off")


class MuteRound(PartitionedRound):
    aggregator_role = Mute


def test_in_a_verified_round_the_backup_serves_its_recomputation_at_once(caplog):
    """Aggregator 0 reduces its part but cannot deliver it. Its backup already recomputed the part
    from the copies (aggregator 0's own contribution included), so every member takes that, without
    the failover's re-sent contributions: the exact mean over all four."""
    group, xs, ref = verified_round(200_003, 13)

    with caplog.at_level("INFO", logger="dedloc.averaging"):
        outs, rounds = asyncio.run(run_rounds(group, xs, [MuteRound] + [PartitionedRound] * 3))

    for out in outs:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[1], ref, atol=1e-5, rtol=1e-5)
    assert "serving our recomputation of part 0" in caplog.text and "re-reduced part 0" not in caplog.text
    assert [r.stats.failovers for r in rounds] == [0, 1, 1, 1]


class PausedPull(MemberRole):
    """Backs up part 0 and is paused (SIGSTOP) while it reads part 0: its pull neither reads nor
    confirms before the result deadline."""

    async def exchange(self, j):
        if j != 0:
            return await super().exchange(j)
        c, read_result = self.c, self.c.read_result

        async def paused(reader, writer, part, who):
            if part == 0:
                await asyncio.sleep(c.result_deadline - asyncio.get_running_loop().time() + 1)
            return await read_result(reader, writer, part, who)

        c.read_result = paused  # this member's pulls only (its own core)
        try:
            await super().exchange(j)
        finally:
            del c.read_result


class PausedBackup(PartitionedRound):
    member_role = PausedPull


def test_a_paused_backup_leaves_the_part_to_its_aggregator_not_to_a_second_reduction(caplog):
    """Member 1 backs up part 0 and is paused while it pulls it, past the result deadline: aggregator
    0 never gets its confirmation, so it withholds the end of every other copy. Members 2 and 3 fail
    over, cannot reach member 1, and ask aggregator 0, which serves its finished part (before, it
    refused: the soak's 141 s stall). Member 1's own pull failed: it fetches part 0 again from the
    aggregator instead of re-reducing it alone. Every member ends with the same exact mean."""
    numel = 3_000_001  # parts of 3 MB: more than a window of credits, so the paused pull holds part 0 back
    group = Group(RID, 0, tuple(Member(f"p{i}", float(i + 1), 1.0) for i in range(4)))
    assert group.backup(0) == 1
    gen = torch.Generator().manual_seed(17)
    xs = [torch.randn(numel, generator=gen) for _ in range(4)]
    ref = sum((i + 1) * x for i, x in enumerate(xs)) / 10

    def paused(rnd, peer):  # member 1 answers nobody once the others give up on their copies
        return peer == "p1" and asyncio.get_running_loop().time() >= rnd.core.result_deadline

    with caplog.at_level("INFO", logger="dedloc.averaging"):
        outs, rounds = asyncio.run(run_rounds(group, xs, [PartitionedRound, PausedBackup] + [PartitionedRound] * 2,
                                              timeout=8.0, out_of_reach=paused))

    for out in outs:
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], ref, atol=1e-5, rtol=1e-5)
    for k in (2, 3):
        assert f"served our part 0 to p{k} after the result deadline (its backup was out of reach)" in caplog.text
        assert "f0>0" in labels(rounds[k]) and rounds[k].stats.failovers == 1
    assert "served our part 0 to p1 after the result deadline (a late pull)" in caplog.text
    assert "serving aggregator p0's result for part 0, fetched again" in caplog.text
    assert "re-reduced part 0" not in caplog.text
