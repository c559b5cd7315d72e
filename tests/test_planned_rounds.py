"""The planner inside real rounds: declared or measured capabilities set the shares every member uses."""

import concurrent.futures as cf
import time

import pytest
import torch

from dedloc.config import AveragingConfig


def cfg(**kw):
    return AveragingConfig(matchmaking_time=3, averaging_timeout=30, probe_interval=0, **kw)


def wait_published(peers, timeout=20.0):
    ids = {p.peer_id for p in peers}
    deadline = time.monotonic() + timeout
    while set(peers[0].capabilities()["peers"]) < ids:
        assert time.monotonic() < deadline, "capability records never appeared in the DHT"
        time.sleep(0.1)


def average_all(peers, xs, ws, step):
    with cf.ThreadPoolExecutor(len(peers)) as pool:
        futs = [pool.submit(p.average, x, step=step, weight=w, expected_peers=len(peers))
                for p, x, w in zip(peers, xs, ws)]
        return [f.result() for f in futs]


def test_declared_links_give_a_parameter_server_that_every_member_follows(make_peers):
    """One peer declares a fast symmetric link, three declare slow home uplinks: the leader plans a
    parameter server, every member runs it, and the result is the exact weighted mean everywhere."""
    server = cfg(upload_mbps=8000, download_mbps=8000)
    home = cfg(upload_mbps=80, download_mbps=800)
    peers = make_peers(4, averaging=[home, server, home, home])
    wait_published(peers)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(200_003, generator=gen) for _ in peers]
    ws = [1.0, 2.0, 3.0, 4.0]
    ref = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
    stats = average_all(peers, xs, ws, 0)
    for x in xs:
        assert torch.equal(x, xs[0])
    torch.testing.assert_close(xs[0], ref, atol=1e-5, rtol=1e-5)
    order = stats[0].peers
    shares = dict(zip(order, stats[0].shares))
    assert shares[peers[1].peer_id] == pytest.approx(1.0)
    assert all(s.shares == stats[0].shares for s in stats)


def test_aggregator_only_peers_take_the_work_and_need_no_result(make_peers):
    """BytePS: two CPU helpers with bandwidth aggregate everything for three slow trainers; the
    helpers' own vectors are left alone, the trainers get the exact mean."""
    helper = cfg(upload_mbps=2000, download_mbps=2000, aggregator_only=True)
    trainer = cfg(upload_mbps=80, download_mbps=800)
    peers = make_peers(5, averaging=[trainer, trainer, helper, trainer, helper])
    wait_published(peers)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(100_000, generator=gen) for _ in peers]
    ws = [1.0, 2.0, 0.0, 3.0, 0.0]
    helper_before = [xs[2].clone(), xs[4].clone()]
    ref = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
    stats = average_all(peers, xs, ws, 0)
    for i in (0, 1, 3):
        assert torch.equal(xs[i], xs[0])
    torch.testing.assert_close(xs[0], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(xs[2], helper_before[0]) and torch.equal(xs[4], helper_before[1])
    shares = dict(zip(stats[0].peers, stats[0].shares))
    assert shares[peers[2].peer_id] == pytest.approx(0.5) and shares[peers[4].peer_id] == pytest.approx(0.5)
    with pytest.raises(Exception, match="contributes nothing"):
        peers[2].average(torch.zeros(10), step=1, weight=1.0)


def test_probes_measure_links_and_publish_them(make_peers):
    peers = make_peers(3, clients=(2,), averaging=cfg(probe_mb=2))
    result = peers[2].probe([peers[0].peer_id, peers[1].peer_id])  # a client probes out
    assert result["failed"] == {}
    assert set(result["pushed"]) == set(result["pulled"]) == {peers[0].peer_id, peers[1].peer_id}
    assert result["upload"] > 1e6 and result["download"] > 1e6  # loopback moves well over 1 MB/s
    deadline = time.monotonic() + 20
    while True:
        rec = peers[0].capabilities()["peers"].get(peers[2].peer_id)
        if rec and rec["u"] > 0:
            break
        assert time.monotonic() < deadline, "the probe's estimates were not published"
        time.sleep(0.1)
    assert rec["c"] is True and rec["d"] > 0 and set(rec["p"]) == {peers[0].peer_id, peers[1].peer_id}


def test_rounds_measure_upload_and_download_passively(make_peers):
    """With probes off and nothing declared, one averaging round gives every peer an upload and a
    download estimate of its own: the bytes its payloads carried over the time they were under way."""
    peers = make_peers(3, averaging=cfg())
    before = peers[0].capabilities()["peers"][peers[0].peer_id]
    assert before["u"] == 0 and before["d"] == 0
    xs = [torch.full((1_000_000,), float(i)) for i in range(3)]
    average_all(peers, xs, [1.0, 1.0, 1.0], 0)
    for x in xs:
        assert torch.equal(x, torch.full((1_000_000,), 1.0))
    for p in peers:
        rec = p.capabilities()["peers"][p.peer_id]
        assert rec["u"] > 1e6 and rec["d"] > 1e6  # loopback moves well over 1 MB/s
    # an estimate that moved is published within MIN_PUBLISH (5 s), not at the next periodic
    # publication (30 s after the one at start-up): the others plan with it in their next rounds
    deadline = time.monotonic() + 12
    while True:
        seen = peers[1].capabilities()["peers"].get(peers[0].peer_id)
        if seen and seen["u"] > 1e6 and seen["d"] > 1e6:
            break
        assert time.monotonic() < deadline, f"the new estimates were not published: {seen}"
        time.sleep(0.2)
