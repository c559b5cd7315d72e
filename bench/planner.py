"""Solve time of the averaging LP for collaborations of 8, 64 and 256 peers (JSON line per size).

Peers get random upload/download (1-200 MB/s), 20% in client mode, 10% aggregator-only, and,
with --pairs, a measured rate for each peer to 3 others. Reports the median and worst solve
time over --repeats random instances, for the bare LP and for ``choose`` (which may re-solve
once without slivers).
"""

import argparse
import json
import random
import statistics
import time

from dedloc.planning import lp

MB = 1e6


def instance(n: int, rng: random.Random, pairs: bool):
    peers = []
    for i in range(n):
        aux = rng.random() < 0.1
        peers.append(lp.PlanPeer(f"p{i:04d}", rng.uniform(1, 200) * MB, rng.uniform(1, 200) * MB, sends=not aux,
                                 receives=not aux, can_aggregate=i == 0 or rng.random() > 0.2))
    links = {(i, j): rng.uniform(1, 100) * MB for i in range(n) for j in rng.sample(range(n), 3) if i != j} \
        if pairs else None
    return peers, links


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="8,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    for n in map(int, args.sizes.split(",")):
        solve_t, choose_t = [], []
        for _ in range(args.repeats):
            peers, pairs = instance(n, rng, args.pairs)
            t0 = time.perf_counter()
            lp.solve(peers, 72e6, pairs)
            t1 = time.perf_counter()
            plan = lp.choose(peers, 72e6, pairs)
            t2 = time.perf_counter()
            solve_t.append(t1 - t0)
            choose_t.append(t2 - t1)
        print(json.dumps({"peers": n, "pairs": args.pairs, "solve_median_s": round(statistics.median(solve_t), 4),
                          "solve_max_s": round(max(solve_t), 4), "choose_median_s": round(statistics.median(choose_t), 4),
                          "choose_max_s": round(max(choose_t), 4), "last_strategy": plan.strategy}), flush=True)


if __name__ == "__main__":
    main()
