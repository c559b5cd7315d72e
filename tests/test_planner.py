"""The averaging LP on canonical inputs: it recovers the known strategies, and its model is consistent."""

import random

import pytest

from dedloc.errors import ConfigError
from dedloc.planning.lp import (PlanPeer, bandwidth_shares, byteps_shares, choose, equal_shares, plan_with, predict,
                                ring_time, server_shares, solve)

MB = 1e6
VECTOR = 72e6  # ALBERT-large's gradient in float32


def aux(name, up, down):
    return PlanPeer(name, up * MB, down * MB, sends=False, receives=False)


def test_homogeneous_peers_get_equal_shares():
    peers = [PlanPeer(f"p{i}", 100 * MB, 100 * MB) for i in range(8)]
    for plan in (solve(peers, VECTOR), choose(peers, VECTOR)):
        assert plan.strategy == "butterfly"
        assert all(abs(g - 1 / 8) < 1e-6 for g in plan.shares)
    # butterfly moves (1 - 1/n) of the vector each way per phase at 100 MB/s
    assert choose(peers, VECTOR).predicted_s == pytest.approx(2 * (7 / 8) * 72 / 100, rel=1e-6)


def test_noisy_homogeneous_measurements_still_give_a_butterfly():
    rng = random.Random(0)
    peers = [PlanPeer(f"p{i}", rng.uniform(95, 105) * MB, rng.uniform(95, 105) * MB) for i in range(8)]
    assert choose(peers, VECTOR).strategy == "butterfly"


def test_one_server_with_slow_home_links_gives_a_parameter_server():
    peers = [PlanPeer("server", 1000 * MB, 1000 * MB)] + [PlanPeer(f"w{i}", 10 * MB, 100 * MB) for i in range(7)]
    plan = choose(peers, VECTOR)
    assert plan.strategy == "parameter-server"
    assert plan.share_of("server") == 1.0
    # each worker uploads its whole gradient; the result streams back meanwhile, on its faster downlink
    assert plan.predicted_s == pytest.approx(72 / 10, rel=1e-6)


def test_cpu_aggregators_with_bandwidth_and_gpu_workers_give_byteps():
    peers = [aux(f"a{i}", 200, 200) for i in range(4)] + [PlanPeer(f"w{i}", 10 * MB, 100 * MB) for i in range(8)]
    plan = choose(peers, VECTOR)
    assert plan.strategy == "byteps"
    assert all(plan.share_of(f"a{i}") == pytest.approx(0.25) for i in range(4))
    assert all(plan.share_of(f"w{i}") == 0 for i in range(8))


def mixed():
    return ([PlanPeer(f"s{i}", 60 * MB, 60 * MB) for i in range(2)]
            + [PlanPeer(f"w{i}", 40 * MB, 100 * MB) for i in range(4)]
            + [aux(f"a{i}", 40, 40) for i in range(2)]
            + [PlanPeer("nat", 30 * MB, 50 * MB, can_aggregate=False)])


def test_mixed_peers_give_a_hybrid_that_beats_every_pure_strategy():
    peers = mixed()
    plan = choose(peers, VECTOR)
    assert plan.strategy == "hybrid"
    for name, shares in [("butterfly", equal_shares(peers)), ("parameter server", server_shares(peers)),
                         ("byteps", byteps_shares(peers)), ("bandwidth-proportional", bandwidth_shares(peers))]:
        assert plan.predicted_s < plan_with(peers, shares, VECTOR).predicted_s, name
    assert plan.predicted_s < ring_time(peers, VECTOR)
    # servers, workstations and aggregators all take a share
    assert all(plan.share_of(p) > 0 for p in ("s0", "w0", "a0"))


def test_client_mode_peers_never_aggregate_even_with_the_best_links():
    peers = [PlanPeer("nat", 10_000 * MB, 10_000 * MB, can_aggregate=False)] + \
            [PlanPeer(f"p{i}", 10 * MB, 10 * MB) for i in range(3)]
    for plan in (solve(peers, VECTOR), choose(peers, VECTOR)):
        assert plan.share_of("nat") == 0.0
        assert sum(plan.shares) == pytest.approx(1.0)


def test_lp_optimum_is_never_worse_than_any_baseline_and_matches_its_prediction():
    rng = random.Random(1)
    for _ in range(20):
        n = rng.randint(2, 12)
        peers = [PlanPeer(f"p{i:02d}", rng.uniform(1, 200) * MB, rng.uniform(1, 200) * MB,
                          sends=rng.random() < 0.8, can_aggregate=rng.random() < 0.8) for i in range(n)]
        peers[0] = PlanPeer("p00", 50 * MB, 50 * MB)  # at least one sender that can aggregate
        best = solve(peers, VECTOR, min_share=0.0)
        assert best.predicted_s == pytest.approx(best.extra["lp_objective_s"], rel=1e-5)
        for shares in (equal_shares(peers), bandwidth_shares(peers), server_shares(peers)):
            assert best.predicted_s <= plan_with(peers, shares, VECTOR).predicted_s * (1 + 1e-6)


def test_pairwise_limits_move_shares_away_from_a_slow_path():
    peers = [PlanPeer(f"p{i}", 100 * MB, 100 * MB) for i in range(4)]
    free = solve(peers, VECTOR)
    # every path into p3 is slow: it should aggregate less
    pairs = {(i, 3): 10 * MB for i in range(3)}
    limited = solve(peers, VECTOR, pairs)
    assert limited.share_of("p3") < free.share_of("p3") / 2
    assert predict(peers, limited.shares, VECTOR, pairs).round_s == pytest.approx(limited.predicted_s)


def test_impossible_inputs_are_refused_by_name():
    with pytest.raises(ConfigError, match="client mode"):
        solve([PlanPeer("a", 1, 1, can_aggregate=False)], VECTOR)
    with pytest.raises(ConfigError, match="bandwidth"):
        solve([PlanPeer("a", -1, 1)], VECTOR)
    with pytest.raises(ConfigError, match="no peers"):
        solve([], VECTOR)
