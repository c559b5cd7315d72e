"""Averaging strategies on a shaped network: ring, butterfly, bandwidth shares and dedloc's LP plan.

Every peer is a real process in its own network namespace, with its upload and download capped
by tbf (dedloc/testing/netem.py). For each configuration (analogues of the DeDLOC paper's four)
the peers first measure their links with probes (or take the true caps with --known-caps), then
average a vector of ALBERT-large's gradient size with each strategy in turn. Prints one JSON line
per configuration:

    config, peers, ring_s, butterfly_s, bandwidth_share_s, dedloc_s, predicted_s,
    speedup_vs_ring, measured_over_predicted, plan (strategy, shares), model predictions of the
    baselines, and the plan the LP makes from the true caps (ideal_*); tcp_s and
    measured_over_tcp: the dedloc plan's traffic sent with plain TCP, all flows at once as a
    streamed round overlaps them (bench/netem/tcp_floor.py), what the emulated links allow
    without our stack; tcp_two_phase_s: the same, phase 2 after phase 1

Round time = the slowest member's all-reduce time after matchmaking, median over --rounds.
Each round's result is checked: identical on every member and equal to the weighted mean.
Run as root:  python bench/netem/run.py [--configs ...] [--numel N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass

import torch

from dedloc.planning import lp
from dedloc.testing.netem import Link, Network, available, exit_on_signals
from dedloc.testing.peer_driver import DrivenPeer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tcp_floor  # noqa: E402 (a sibling script)
MBIT = 1e6 / 8


@dataclass(frozen=True)
class Spec:
    up: float
    """Mbit/s"""
    down: float
    client: bool = False
    aggregator_only: bool = False


CONFIGS: dict[str, list[Spec]] = {
    # every peer alike, fast links
    # (this machine's 2 cores carry ~60 MB/s of p2p traffic in all; "fast" stays below that)
    "homogeneous-fast": [Spec(50, 50)] * 6,
    # every peer alike, slow links (unpaced payloads got p2pd connections reset here: docs/wire.md)
    "homogeneous-slow": [Spec(10, 10)] * 6,
    # two well-connected servers, six home workstations (slow uplink)
    "servers+workstations": [Spec(200, 200)] * 2 + [Spec(20, 100)] * 6,
    # the same with two workstations behind NAT (client mode) and two CPU-only aggregators
    "hybrid+clients+aggregators": [Spec(200, 200)] * 2 + [Spec(20, 100)] * 2 + [Spec(20, 100, client=True)] * 2
    + [Spec(100, 100, aggregator_only=True)] * 2,
}
STRATEGIES = {"ring": dict(strategy="ring", planner="equal"),
              "butterfly": dict(strategy="partitioned", planner="equal"),
              "bandwidth_share": dict(strategy="partitioned", planner="bandwidth"),
              "dedloc": dict(strategy="partitioned", planner="lp")}


def plan_peers(specs: list[Spec], ids: list[str]) -> list[lp.PlanPeer]:
    return [lp.PlanPeer(pid, s.up * MBIT, s.down * MBIT, sends=not s.aggregator_only, receives=not s.aggregator_only,
                        can_aggregate=not s.client) for pid, s in zip(ids, specs)]


def run_config(name: str, specs: list[Spec], args, logdir: str) -> dict:
    logdir = os.path.join(logdir, name)
    os.makedirs(logdir, exist_ok=True)
    net = Network([Link(s.up, s.down) for s in specs])
    procs: list[DrivenPeer] = []
    try:
        procs = [DrivenPeer(net.exec_args(i), i, logdir) for i in range(len(specs))]
        averaging = dict(matchmaking_time=5.0, averaging_timeout=args.timeout, probe_interval=0,
                         probe_mb=args.probe_mb, replan_interval=3600)

        def start(i: int, initial: list[str]):
            s = specs[i]
            extra = dict(upload_mbps=s.up, download_mbps=s.down) if args.known_caps else {}
            return procs[i].call(op="start", timeout=120, peer=dict(
                run_id=f"netem{os.getpid()}", host_maddrs=[f"/ip4/{net.ip(i)}/tcp/0"], initial_peers=initial,
                client_mode=s.client, log_level=args.log_level),
                averaging=dict(averaging, aggregator_only=s.aggregator_only, **extra))

        first = start(0, [])
        infos = [first] + [None] * (len(specs) - 1)
        for i in range(1, len(specs)):  # sequential start keeps the 2-core machine responsive
            infos[i] = start(i, first["maddrs"])
        ids = [info["peer_id"] for info in infos]
        if not args.known_caps:
            for _ in range(2):  # the second pass picks targets from what the first one learned
                for p in procs:  # one at a time, so probes do not compete with each other
                    p.call(op="probe", timeout=600)
        caps = procs[0].call(op="caps")["peers"]
        measured = {pid: (caps[pid]["u"] / MBIT, caps[pid]["d"] / MBIT) for pid in ids if pid in caps}

        trainers = [i for i, s in enumerate(specs) if not s.aggregator_only]
        gen_weights = [float(1 + i % 3) if not s.aggregator_only else 0.0 for i, s in enumerate(specs)]
        reference = sum(gen_weights[i] * torch.randn(args.numel, generator=torch.Generator().manual_seed(1000 + i))
                        for i in trainers) / sum(gen_weights[i] for i in trainers)
        ref_sum = float(reference.double().sum())
        results: dict[str, list[float]] = {}
        per_member: dict[str, list] = {}
        plan_info = None
        step = 0
        for strategy, changes in STRATEGIES.items():
            if strategy not in args.strategies:
                continue
            members = trainers if strategy == "ring" else list(range(len(specs)))
            for p in procs:
                p.call(op="reconfigure", changes=changes)
            times = []
            for _ in range(args.rounds):
                for i in members:
                    procs[i].send(op="average", seed=1000 + i, numel=args.numel, step=step, weight=gen_weights[i],
                                  expected=len(members), timeout=args.timeout)
                answers = {i: procs[i].receive(args.timeout + 120) for i in members}
                step += 1
                fetched = [answers[i] for i in trainers]
                if any(a["head"] != fetched[0]["head"] or a["checksum"] != fetched[0]["checksum"] for a in fetched):
                    raise RuntimeError(f"{name}/{strategy}: members hold different results")
                if abs(fetched[0]["checksum"] - ref_sum) > 1e-3 * max(1.0, abs(ref_sum)) + 1e-3 * args.numel ** 0.5:
                    raise RuntimeError(f"{name}/{strategy}: result differs from the weighted mean "
                                       f"({fetched[0]['checksum']} vs {ref_sum})")
                times.append(max(a["allreduce_s"] for a in answers.values()))
                per_member[strategy] = [round(answers[i]["allreduce_s"], 1) if i in answers else None
                                        for i in range(len(specs))]
                if strategy == "dedloc":
                    shares = dict(zip(fetched[0]["peers"], fetched[0]["shares"]))
                    plan_info = shares
            results[strategy] = times
        # the plan behind the dedloc rounds, as its leader predicted it
        predicted, leader_plan = None, None
        for p in procs:
            plan = p.call(op="caps")["plan"]
            if plan and plan_info and dict(zip(plan["peers"], plan["shares"])) == plan_info:
                predicted, leader_plan = plan["predicted_s"], plan
        nbytes = args.numel * 4
        tcp = None
        if args.tcp_floor and plan_info:  # the same plan's traffic, with nothing but kernel TCP
            floor_args = ([net.exec_args(i) for i in range(len(specs))], [net.ip(i) for i in range(len(specs))],
                          [plan_info.get(pid, 0.0) for pid in ids], [not s.aggregator_only for s in specs],
                          [not s.aggregator_only for s in specs], nbytes)
            both = [tcp_floor.overlapped_seconds(*floor_args) for _ in range(args.rounds)]
            phases = [tcp_floor.two_phase_seconds(*floor_args) for _ in range(args.rounds)]
            tcp = {"s": statistics.median(both), "runs": [round(x, 2) for x in both],
                   "two_phase_s": statistics.median(sum(r) for r in phases),
                   "phases": [[round(x, 2) for x in r] for r in phases]}
        truth = plan_peers(specs, ids)
        ideal = lp.choose(truth, nbytes)
        med = {k: statistics.median(v) for k, v in results.items()}

        def sec(key: str) -> float | None:
            return round(med[key], 2) if key in med else None

        return {
            "config": name, "peers": len(specs), "numel": args.numel, "rounds": args.rounds,
            "ring_s": sec("ring"), "butterfly_s": sec("butterfly"),
            "bandwidth_share_s": sec("bandwidth_share"), "dedloc_s": sec("dedloc"),
            "predicted_s": None if predicted is None else round(predicted, 2),
            "speedup_vs_ring": round(med["ring"] / med["dedloc"], 2) if "ring" in med and "dedloc" in med else None,
            "measured_over_predicted": None if predicted is None or "dedloc" not in med
            else round(med["dedloc"] / predicted, 2),
            "tcp_s": round(tcp["s"], 2) if tcp else None,
            "measured_over_tcp": round(med["dedloc"] / tcp["s"], 2) if tcp and "dedloc" in med else None,
            "tcp_runs_s": tcp["runs"] if tcp else None,
            "tcp_two_phase_s": round(tcp["two_phase_s"], 2) if tcp else None,
            "tcp_phases_s": tcp["phases"] if tcp else None,
            "plan_strategy": leader_plan["strategy"] if leader_plan else None,
            "plan_shares": [round(plan_info.get(pid, 0.0), 3) for pid in ids] if plan_info else None,
            "ideal_strategy": ideal.strategy, "ideal_predicted_s": round(ideal.predicted_s, 2),
            "ideal_shares": [round(g, 3) for g in ideal.shares],
            "model_ring_s": round(lp.ring_time([truth[i] for i in trainers], nbytes), 2),
            "model_butterfly_s": round(lp.plan_with(truth, lp.equal_shares(truth), nbytes).predicted_s, 2),
            "model_bandwidth_share_s": round(lp.plan_with(truth, lp.bandwidth_shares(truth), nbytes).predicted_s, 2),
            "caps_mbit": [[s.up, s.down] for s in specs],
            "measured_mbit": [[round(x, 1) for x in measured.get(pid, (0, 0))] for pid in ids],
            "all_rounds_s": {k: [round(t, 2) for t in v] for k, v in results.items()},
            "last_round_member_s": per_member,
        }
    finally:
        for p in procs:
            p.close()
        net.close()  # kills anything left in the namespaces, then removes them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--numel", type=int, default=18_000_000, help="vector size (ALBERT-large: ~18M)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES),
                        help="strategies to run (a JSON key is null for one left out)")
    parser.add_argument("--timeout", type=float, default=400.0, help="averaging timeout per round, seconds")
    parser.add_argument("--probe-mb", type=float, default=2.0)
    parser.add_argument("--known-caps", action="store_true", help="give peers their true caps instead of probing")
    parser.add_argument("--logdir", default=None)
    parser.add_argument("--tcp-floor", action=argparse.BooleanOptionalAction, default=True,
                        help="also send the dedloc plan's traffic with plain TCP (tcp_s, tcp_two_phase_s, measured_over_tcp)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"],
                        help="peers' log level (DEBUG adds each round's transfer timeline)")
    args = parser.parse_args()
    exit_on_signals()  # a signal runs the finally blocks: namespaces are removed
    ok, why = available()
    if not ok:
        print(json.dumps({"skipped": why}))
        sys.exit(0)
    logdir = args.logdir or tempfile.mkdtemp(prefix="dedloc-netem-")
    os.makedirs(logdir, exist_ok=True)
    for name in args.configs:
        try:
            print(json.dumps(run_config(name, CONFIGS[name], args, logdir)), flush=True)
        except Exception as e:
            print(json.dumps({"config": name, "error": f"{type(e).__name__}: {e}", "logs": logdir}), flush=True)


if __name__ == "__main__":
    main()
