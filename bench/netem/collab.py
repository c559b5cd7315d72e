"""Training throughput under heterogeneity: the collaborative optimizer on a shaped network.

Scenarios (each trainer emulates a device of ``--sps`` samples/s and trains a synthetic MLP
whose gradient is about ``--hidden`` * 257 floats):
  high           four peers with fast links (200 Mbit/s both ways)
  mixed/<mode>   the same four, plus four part-time peers with home links (20 up, 100 down
                 Mbit/s) that join at step --join and leave at step --leave; averaged with
                 dedloc's planner (lp) and with a plain ring all-reduce (ring)
Prints one JSON line per scenario: samples_per_second (global batch samples per second of
wall time, from the first completed step to the last), step times, realised batches, and for
the mixed ones the ratio to the high-bandwidth set and, per part-time peer, the rounds it
contributed to. Full-time peers' parameters are checked identical.
Run as root:  python bench/netem/collab.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading

from dedloc.testing.netem import Link, Network, available, exit_on_signals

HERE = os.path.dirname(os.path.abspath(__file__))
FAST, HOME = Link(200, 200), Link(20, 100)


def scenario(name: str, links: list[Link], part_time: list[bool], mode: str, args, logdir: str) -> dict:
    net = Network(links)
    procs: list[subprocess.Popen] = []
    try:
        averaging = dict(matchmaking_time=3.0, averaging_timeout=120.0, probe_interval=60.0, probe_mb=2.0,
                         strategy="ring" if mode == "ring" else "partitioned", planner="lp")
        specs = []
        for i, link in enumerate(links):
            specs.append(dict(index=i, hidden=args.hidden, micro=args.micro, samples_per_second=args.sps,
                              steps=args.steps, time_limit=args.time_limit,
                              join_step=args.join if part_time[i] else 0,
                              start_with=0 if part_time[i] else part_time.count(False),
                              leave_step=args.leave if part_time[i] else None,
                              peer=dict(run_id=f"collab{os.getpid()}{name.replace('/', '')}",
                                        host_maddrs=[f"/ip4/{net.ip(i)}/tcp/0"]),
                              averaging=averaging,
                              optimizer=dict(target_batch_size=args.target, delay_updates=args.delay_updates)))
        logs = [open(os.path.join(logdir, f"{name.replace('/', '-')}-{i}.log"), "w") for i in range(len(links))]

        def launch(i: int, initial: list[str]) -> subprocess.Popen:
            specs[i]["peer"]["initial_peers"] = initial
            return subprocess.Popen(net.exec_args(i) + [sys.executable, os.path.join(HERE, "trainer.py"),
                                                        json.dumps(specs[i])],
                                    stdout=subprocess.PIPE, stderr=logs[i], text=True)

        procs.append(launch(0, []))
        first = json.loads(procs[0].stdout.readline())
        procs += [launch(i, first["maddrs"]) for i in range(1, len(links))]
        results: list = [None] * len(procs)

        def collect(i: int) -> None:
            for line in procs[i].stdout:
                obj = json.loads(line)
                if "index" in obj:
                    results[i] = obj

        readers = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(len(procs))]
        for r in readers:
            r.start()
        for r in readers:
            r.join(args.time_limit + 120)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"{name}: peers {missing} gave no result (logs in {logdir})")
        full = [r for r, pt in zip(results, part_time) if not pt]
        if len({r["param_sum"] for r in full}) != 1 or len({r["applied_step"] for r in full}) != 1:
            raise RuntimeError(f"{name}: full-time peers ended with different parameters or steps")
        part = [r for r, pt in zip(results, part_time) if pt]
        lead = full[0]
        times = dict((s, t) for s, t in lead["step_times"])
        batches = {h[0]: h[2] for h in lead["history"]}
        # with delayed updates the last update is applied at close(), after the last timed step
        first_step, last_step = 1, max(times)
        samples = sum(batches.get(s, 0.0) for s in range(first_step, last_step))
        span = times[last_step] - times[first_step]
        return {"scenario": name, "peers": len(links), "part_time": sum(part_time), "steps": last_step,
                "samples_per_second": round(samples / span, 1),
                "seconds_per_step": round(span / (last_step - first_step), 2),
                "batches": [round(batches[s]) for s in sorted(batches)],
                "averaging_s": [round(h[4], 2) for h in lead["history"]],
                "group_sizes": [h[3] for h in lead["history"]],
                # per part-time peer: rounds it contributed samples to, and how it got back in step
                "part_time_rounds": [sum(1 for h in r["history"] if h[1] > 0) for r in part],
                "part_time_resyncs": [r["resyncs"] for r in part],
                "part_time_catchups": [r["catchups"] for r in part]}
    finally:
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        net.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=8192, help="MLP width: the gradient has ~hidden*257 floats")
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--sps", type=float, default=100.0, help="each peer's emulated samples/s")
    parser.add_argument("--target", type=int, default=1024, help="global batch")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--join", type=int, default=2, help="step at which part-time peers join")
    parser.add_argument("--leave", type=int, default=10, help="step at which part-time peers leave")
    parser.add_argument("--delay-updates", action="store_true")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--scenarios", nargs="+", default=["high", "mixed/lp", "mixed/ring"])
    args = parser.parse_args()
    exit_on_signals()  # a signal runs the finally blocks: namespaces are removed
    ok, why = available()
    if not ok:
        print(json.dumps({"skipped": why}))
        return
    logdir = tempfile.mkdtemp(prefix="dedloc-netem-collab-")
    high = None
    for name in args.scenarios:
        if name == "high":
            links, part = [FAST] * 4, [False] * 4
        else:
            links, part = [FAST] * 4 + [HOME] * 4, [False] * 4 + [True] * 4
        try:
            out = scenario(name, links, part, name.split("/")[-1], args, logdir)
        except Exception as e:
            print(json.dumps({"scenario": name, "error": f"{type(e).__name__}: {e}", "logs": logdir}), flush=True)
            continue
        if name == "high":
            high = out["samples_per_second"]
        elif high:
            out["vs_high"] = round(out["samples_per_second"] / high, 3)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
