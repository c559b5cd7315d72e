"""Real peers in network namespaces behind tbf-capped links: probes measure the caps, and the
planner's round beats a ring on them while giving the exact weighted mean.

Skipped (with the reason) where network namespaces are unavailable; CI runs as root.
"""

import subprocess

import pytest
import torch

from dedloc.planning import lp
from dedloc.testing.netem import Link, Network, available
from dedloc.testing.peer_driver import DrivenPeer

ok, why = available()
pytestmark = [pytest.mark.skipif(not ok, reason=why), pytest.mark.xdist_group("network")]

CAPS = [Link(100, 100), Link(100, 100), Link(16, 80), Link(16, 80)]
NUMEL = 2_000_000


@pytest.mark.timeout(300)
def test_probes_measure_tbf_caps_and_the_plan_beats_ring(tmp_path):
    net = Network(CAPS)
    peers = []
    try:
        peers = [DrivenPeer(net.exec_args(i), i, str(tmp_path)) for i in range(len(CAPS))]
        averaging = dict(matchmaking_time=3, averaging_timeout=60, probe_interval=0, probe_mb=2, replan_interval=600)
        # 2 MiB: a fast stream must run >= 0.1 s for the concurrent-window download measurement
        # (with 1 MiB at 100 Mbit/s it took 0.08 s, and the fallback total/span read 48 Mbit/s)
        first = peers[0].call(op="start", peer=dict(run_id="netemtest", host_maddrs=[f"/ip4/{net.ip(0)}/tcp/0"]),
                              averaging=averaging)
        ids = [first["peer_id"]] + [p.call(op="start", averaging=averaging, peer=dict(
            run_id="netemtest", host_maddrs=[f"/ip4/{net.ip(p.index)}/tcp/0"], initial_peers=first["maddrs"]))["peer_id"]
            for p in peers[1:]]
        for _ in range(2):  # the second pass probes the best-connected peers found by the first
            for p in peers:
                p.call(op="probe")
        caps = peers[0].call(op="caps")["peers"]
        for pid, link in zip(ids, CAPS):
            up, down = caps[pid]["u"] * 8 / 1e6, caps[pid]["d"] * 8 / 1e6
            # payload rate: tbf counts headers too, so a little under the cap (a token-bucket burst
            # can lift a short window slightly above it)
            assert 0.7 * link.upload_mbit <= up <= 1.1 * link.upload_mbit, (pid, up, link)
            assert 0.7 * link.download_mbit <= down <= 1.1 * link.download_mbit, (pid, down, link)

        weights = [1.0, 2.0, 3.0, 4.0]
        ref = sum(w * torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 + i))
                  for i, w in enumerate(weights)) / sum(weights)
        times = {}
        for step, (strategy, planner) in enumerate([("ring", "equal"), ("partitioned", "lp")]):
            for p in peers:
                p.call(op="reconfigure", changes=dict(strategy=strategy, planner=planner))
            for p in peers:
                p.send(op="average", seed=1000 + p.index, numel=NUMEL, step=step, weight=weights[p.index], expected=4)
            answers = [p.receive(180) for p in peers]
            assert len({(tuple(a["head"]), a["checksum"]) for a in answers}) == 1, "members disagree"
            assert answers[0]["checksum"] == pytest.approx(float(ref.double().sum()), abs=1e-2)
            assert answers[0]["head"] == pytest.approx(ref[:4].tolist(), abs=1e-5)
            times[strategy] = max(a["allreduce_s"] for a in answers)
            shares = dict(zip(answers[0]["peers"], answers[0]["shares"]))
        # the plan moved the work to the well-connected peers
        assert shares[ids[0]] > 2 * shares[ids[2]] and shares[ids[1]] > 2 * shares[ids[3]], shares
        # and the model says that is faster than a ring on these links (timings go to bench/, not asserts)
        truth = [lp.PlanPeer(pid, l.upload_mbit * 125e3, l.download_mbit * 125e3) for pid, l in zip(ids, CAPS)]
        planned = lp.plan_with(truth, [shares[pid] for pid in ids], NUMEL * 4).predicted_s
        assert planned < lp.ring_time(truth, NUMEL * 4)
        print(f"ring {times['ring']:.2f} s, planned {times['partitioned']:.2f} s on {CAPS}")
    finally:
        for p in peers:
            p.close()
        net.close()
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(net.prefix) == 0


SLOW = [Link(8, 8)] * 4
MBIT = 1e6 / 8
SLOW_NUMEL = 5_000_000  # 20 MB: each peer queues ~15 s of data behind its 8 Mbit/s uplink in phase one


@pytest.mark.timeout(300)
def test_slow_links_pace_payloads_instead_of_losing_connections(tmp_path):
    """Unpaced, three concurrent 5 MB parts behind an 8 Mbit/s uplink queue ~15 s of data per
    connection, and the daemon's multiplexer resets connections whose keepalive waits over 10 s:
    parts fail over or rounds fail. Credit-paced payloads keep the queues short: the round is
    exact on every member, with no failover. The round runs on libp2p streams (the path relayed
    and unreachable pairs take), where the multiplexer is; the first test covers direct connections."""
    net = Network(SLOW)
    peers = []
    try:
        peers = [DrivenPeer(net.exec_args(i), i, str(tmp_path)) for i in range(len(SLOW))]
        averaging = dict(matchmaking_time=3, averaging_timeout=200, probe_interval=0, planner="equal",
                         replan_interval=600, probe_mb=3, transport="libp2p")
        first = peers[0].call(op="start", peer=dict(run_id="slowtest", host_maddrs=[f"/ip4/{net.ip(0)}/tcp/0"]),
                              averaging=averaging)
        for p in peers[1:]:
            p.call(op="start", averaging=averaging, peer=dict(
                run_id="slowtest", host_maddrs=[f"/ip4/{net.ip(p.index)}/tcp/0"], initial_peers=first["maddrs"]))
        weights = [1.0, 1.0, 2.0, 3.0]
        ref = sum(w * torch.randn(SLOW_NUMEL, generator=torch.Generator().manual_seed(2000 + i))
                  for i, w in enumerate(weights)) / sum(weights)
        for p in peers:
            p.send(op="average", seed=2000 + p.index, numel=SLOW_NUMEL, step=0, weight=weights[p.index], expected=4)
        answers = [p.receive(250) for p in peers]
        assert [a["failovers"] for a in answers] == [0] * 4, answers
        # the queue behind each link stayed below the multiplexer's ~10 s keepalive limit: every
        # payload was credited within a few seconds of being written (2.5-3.6 s here; unpaced,
        # 16.5-17.2 s). The bound leaves room for a loaded machine: CPU starvation delays credits.
        assert max(a["queue_s"] for a in answers) < 8.0, [a["queue_s"] for a in answers]
        assert all(a["group_size"] == 4 for a in answers)
        assert len({(tuple(a["head"]), a["checksum"]) for a in answers}) == 1, "members disagree"
        assert answers[0]["checksum"] == pytest.approx(float(ref.double().sum()), abs=1e-2)
        assert answers[0]["head"] == pytest.approx(ref[:4].tolist(), abs=1e-5)
        # probes are paced too: 3 x 3 MiB pushed at once would queue ~9 s unpaced
        probe = peers[0].call(op="probe")
        assert probe["failed"] == {} and len(probe["pushed"]) == len(probe["pulled"]) == 3, probe
        assert probe["queue_s"] < 8.0, probe  # 1.9-2.9 s here
        assert 0.5 * SLOW[0].upload_mbit * MBIT < probe["upload"] < 1.2 * SLOW[0].upload_mbit * MBIT, probe
        print(f"slow round {max(a['allreduce_s'] for a in answers):.1f} s, queueing delay "
              f"{max(a['queue_s'] for a in answers):.1f} s (probes {probe['queue_s']:.1f} s) on {SLOW}")
    finally:
        for p in peers:
            p.close()
        net.close()
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(net.prefix) == 0
