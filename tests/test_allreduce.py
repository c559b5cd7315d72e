"""Multi-peer averaging on loopback: exactness, identical results, client mode, strategies."""

import concurrent.futures as cf

import pytest
import torch

from dedloc.config import AveragingConfig


def average_all(peers, xs, ws, step, expected=None):
    with cf.ThreadPoolExecutor(len(peers)) as pool:
        futs = [pool.submit(p.average, x, step=step, weight=w, expected_peers=expected or len(peers))
                for p, x, w in zip(peers, xs, ws)]
        return [f.result() for f in futs]


def check_exact_and_identical(xs, ref, atol=1e-5):
    for x in xs:
        assert torch.equal(x, xs[0]), "members disagree"
    torch.testing.assert_close(xs[0], ref, atol=atol, rtol=1e-5)


def test_weighted_mean_with_client_and_aggregator_only(make_peers):
    """3 reachable peers (one aggregator-only, weight 0) and 1 client: exact, identical, over steps."""
    peers = make_peers(4, clients=(3,))
    gen = torch.Generator().manual_seed(1)
    for step, numel in enumerate([1, 1000, 300_001]):
        xs = [torch.randn(numel, generator=gen) for _ in peers]
        ws = [3.0, 0.0, 5.0, 7.0]
        ref = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
        stats = average_all(peers, xs, ws, step)
        check_exact_and_identical(xs, ref)
        assert {s.group_size for s in stats} == {4}
        assert all(s.total_weight == pytest.approx(15.0) for s in stats)
        assert stats[0].excluded == {} and stats[0].failovers == 0
    # the client never aggregates: the group agreed share 0 for it (no part for it to serve)
    assert peers[3].maddrs == []


def test_ring_strategy_and_verified_float16_wire(make_peers):
    peers = make_peers(3, clients=(2,), averaging=AveragingConfig(matchmaking_time=3, averaging_timeout=20,
                                                                   strategy="ring"))
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(100_003, generator=gen) for _ in peers]
    ws = [1.0, 2.0, 3.0]
    ref = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
    average_all(peers, xs, ws, 0)
    check_exact_and_identical(xs, ref)

    # a verified round on the float16 wire: every part recomputed by its backup and checked by the others
    peers = make_peers(3, averaging=AveragingConfig(matchmaking_time=3, averaging_timeout=20, compression="float16",
                                                    verify=True))
    xs = [torch.randn(50_000, generator=gen) for _ in peers]
    ref = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
    stats = average_all(peers, xs, ws, 0)
    check_exact_and_identical(xs, ref, atol=2e-2)
    assert [s.verified for s in stats] == [2, 2, 2] and all(s.failovers == 0 for s in stats)


def test_hierarchical_groups_give_every_peer_the_same_mean(make_peers):
    """max_group_size=2 with 5 peers: subgroups reduce, representatives reduce, members fetch."""
    peers = make_peers(5, clients=(4,), averaging=AveragingConfig(matchmaking_time=3, averaging_timeout=30,
                                                                   max_group_size=2))
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(10_000, generator=gen) for _ in peers]
    ws = [1.0, 2.0, 3.0, 4.0, 5.0]
    ref = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
    stats = average_all(peers, xs, ws, 0)
    check_exact_and_identical(xs, ref)
    assert {s.group_size for s in stats} == {5}


def test_late_peer_is_told_it_missed_the_round_and_joins_the_next(make_peers):
    from dedloc.errors import MissedRoundError

    peers = make_peers(3)
    xs = [torch.full((10,), float(i)) for i in range(3)]
    average_all(peers[:2], xs[:2], [1.0, 1.0], step=5, expected=2)
    assert torch.equal(xs[0], torch.full((10,), 0.5))
    late = xs[2].clone()
    with pytest.raises(MissedRoundError, match="step 5"):
        peers[2].average(late, step=5, weight=1.0, expected_peers=3)
    assert torch.equal(late, xs[2]), "a missed round must leave the tensor untouched"
    members = peers[2].closed_round(5)
    assert len(members) == 1 and peers[2].peer_id not in next(iter(members.values()))
    xs = [torch.full((10,), float(i)) for i in range(3)]
    stats = average_all(peers, xs, [1.0, 1.0, 1.0], step=6)
    assert stats[2].group_size == 3 and torch.equal(xs[2], torch.full((10,), 1.0))


def test_progress_records_form_one_view(make_peers):
    peers = make_peers(3, clients=(2,))
    for i, p in enumerate(peers):
        p.publish_progress(step=4, samples=10 * (i + 1), samples_per_second=5.0)
    view = peers[0].collaboration()
    assert {r.peer_id for r in view.peers} == {p.peer_id for p in peers}
    assert view.global_step == 4 and view.samples == 60
    assert view.by_role() == {"trainer": 2, "client": 1}
    assert 0 < view.eta(100) < float("inf")


def test_concurrent_rounds_on_equal_sizes_keep_their_own_tensors(make_peers):
    """Two rounds in flight at once on one peer, with vectors of one size: each gets its own step's
    mean (they once shared one shared-memory buffer, so the second input overwrote the first)."""
    peers = make_peers(2)
    xs = [[torch.full((1000,), 1.0), torch.full((1000,), 10.0)], [torch.full((1000,), 3.0), torch.full((1000,), 30.0)]]
    calls = [p.average_async(xs[i][step], step=step, weight=1.0, expected_peers=2)
             for step in (0, 1) for i, p in enumerate(peers)]
    for _, finish in calls:
        finish()
    for i in range(2):
        assert torch.equal(xs[i][0], torch.full((1000,), 2.0)) and torch.equal(xs[i][1], torch.full((1000,), 20.0))
