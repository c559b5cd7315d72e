"""Peers behind NAT, in network namespaces: reachability found by dial-back, hole punching, the
run's relay where punching fails, and NAT'd peers kept from leading, and from aggregating unless
they have a direct path to every member.

One topology (dedloc.testing.nat) serves every check, to keep the suite short: on the public
segment a relaying peer (the run's relay, as a backbone is) and three public trainers, which
are also the observers libp2p needs before it trusts a NAT'd peer's public address (4); four
default-config trainers, each behind its own home router: two ordinary routers, and two that
give every flow a random public port (``--random-fully``), which hole punching cannot pass.
Skipped (with the reason) where namespaces or iptables are unavailable.
"""

import subprocess
import time

import pytest

from dedloc.testing.nat import Nat, NatNetwork, available, start_run
from dedloc.testing.peer_driver import vector

ok, why = available()
pytestmark = [pytest.mark.skipif(not ok, reason=why), pytest.mark.xdist_group("network")]
NUMEL = 300_000
AVERAGING = dict(matchmaking_time=3, averaging_timeout=60, probe_interval=0, planner="equal")
NATS = [Nat(), Nat(), Nat(random_ports=True), Nat(random_ports=True)]


def _round(members, step):
    """All ``members`` average; every one ends with the exact weighted mean. Returns the shares."""
    weights = [1.0 + i for i in range(len(members))]
    ref = sum(w * vector(100 + p.index, NUMEL) for p, w in zip(members, weights)) / sum(weights)
    for p, w in zip(members, weights):
        p.send(op="average", seed=100 + p.index, numel=NUMEL, step=step, weight=w, expected=len(members))
    answers = [p.receive(120) for p in members]
    assert len({(tuple(a["head"]), a["checksum"]) for a in answers}) == 1, "members disagree"
    assert answers[0]["head"] == pytest.approx(ref[:4].tolist(), abs=1e-5)
    assert answers[0]["checksum"] == pytest.approx(float(ref.double().sum()), abs=1e-2)
    assert answers[0]["group_size"] == len(members)
    return dict(zip(answers[0]["peers"], answers[0]["shares"]))


@pytest.mark.timeout(300)
def test_nat_peers_found_private_punch_or_relay_and_never_aggregate(tmp_path):
    net = NatNetwork(public=4, nats=NATS)
    peers = []
    try:
        peers, infos = start_run(net, str(tmp_path), "nattest", AVERAGING)
        ids = [i["peer_id"] for i in infos]
        assert [i["reachable"] for i in infos] == [True] * 4 + [False] * len(NATS), [i["reachability"] for i in infos]

        # a NAT'd newcomer gets the state from a NAT'd peer, its only donor; then the two hold a
        # punched direct connection behind ordinary routers, and only the relayed one behind
        # --random-fully routers (the first stream goes wherever the daemon's first dial lands)
        for donor, newcomer, direct in ((4, 5, True), (6, 7, False)):
            peers[donor].call(op="offer", step=7, seed=donor, numel=NUMEL)
            got = peers[newcomer].call(op="download", donors=[ids[donor]], min_step=7, within=60, seed=donor,
                                       numel=NUMEL)
            assert got == {"step": 7, "donor": ids[donor], "identical": True}
            path = peers[newcomer].call(op="connections")[ids[donor]]
            assert path["direct"] == direct, path
            if not direct:
                assert all("/p2p-circuit" in a for a in path["addrs"]), path

        # a round of two public trainers and the four NAT'd ones: the exact weighted mean on every
        # member, led and aggregated by public peers only: no NAT'd member has a direct path to all
        shares = _round([peers[1], peers[2]] + peers[4:], step=1)
        assert all(shares[ids[i]] == 0 for i in range(4, 4 + len(NATS))), shares
        assert shares[ids[1]] > 0 and shares[ids[2]] > 0, shares

        # the two peers behind ordinary routers have punched paths to each other and direct ones to
        # the public trainers: once their records say so, a leader plans them as aggregators too
        members = [peers[1], peers[2], peers[4], peers[5]]
        for nat in (4, 5):
            others = {ids[i] for i in (1, 2, 4, 5)} - {ids[nat]}
            deadline = time.monotonic() + 60
            while not all(others <= set(p.call(op="caps")["peers"].get(ids[nat], {}).get("x", [])) for p in members[:2]):
                assert time.monotonic() < deadline, f"peer {nat} published no direct path to all of {others}"
                time.sleep(1)  # a private peer republishes its direct paths within 5 s of a change
        shares = _round(members, step=2)
        assert all(shares[ids[i]] > 0 for i in (1, 2, 4, 5)), shares
    finally:
        for p in peers:
            p.close()
        net.close()
        assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(net.prefix) == 0
