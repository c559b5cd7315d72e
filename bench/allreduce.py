"""All-reduce benchmark: dedloc vs torch.distributed gloo vs hivemind's DecentralizedAverager.

Prints one JSON line per size. All three run in this script, one after another, on loopback,
with ``--peers`` processes each. Times are the slowest peer's, the median over ``--repeats``.
  dedloc_s        our all-reduce alone (after matchmaking), the figure to compare with gloo
  dedloc_total_s  matchmaking included, the figure to compare with hivemind's step()
  vs_gloo         gloo_s / dedloc_s;  vs_hivemind  hivemind_s / dedloc_total_s

With ``--auth``: dedloc only, in an open run and in an invite-only one (every stream's hello
checked, every DHT request and record signed and verified), one after the other:
  invite_vs_open_total  total round time, invite-only / open
  invite_vs_open_cpu    CPU seconds of the peers' runtime processes and daemons, invite-only / open

With ``--verify``: dedloc only, plain rounds and verified ones (AveragingConfig.verify: each
part recomputed by its backup from second copies of the contributions), one after the other:
  verified_vs_plain_total, verified_vs_plain_cpu
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import statistics
import time

import torch


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KM" else s) * mult)


# ---- gloo -------------------------------------------------------------------------------------------
def _gloo_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    for n in sizes:
        x = torch.randn(n)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        res[n] = times
    out.put((rank, res))
    dist.destroy_process_group()


def bench_gloo(peers: int, sizes: list[int], repeats: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_gloo_worker, args=(r, peers, port, sizes, repeats, q)) for r in range(peers)]
    for p in procs:
        p.start()
    results = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    return {n: statistics.median(max(r[n][i] for _, r in results) for i in range(repeats)) for n in sizes}


# ---- hivemind ---------------------------------------------------------------------------------------
def _hivemind_worker(rank: int, initial, sizes: list[int], repeats: int, peers: int, out, ready) -> None:
    import hivemind

    torch.set_num_threads(1)
    dht = hivemind.DHT(initial_peers=initial, start=True)
    if rank == 0:
        ready.put([str(a) for a in dht.get_visible_maddrs()])
    res = {}
    for n in sizes:
        avg = hivemind.averaging.DecentralizedAverager([torch.randn(n)], dht, prefix=f"bench{n}", start=True,
                                                       target_group_size=peers, min_matchmaking_time=1.0,
                                                       request_timeout=10, allreduce_timeout=600)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            avg.step(timeout=900)
            times.append(time.perf_counter() - t)
        res[n] = times
        avg.shutdown()
    out.put((rank, res))
    dht.shutdown()


def bench_hivemind(peers: int, sizes: list[int], repeats: int) -> dict[int, float]:
    ctx = mp.get_context("fork")  # hivemind's averager is a fork-started process
    q, ready = ctx.Queue(), ctx.Queue()
    first = ctx.Process(target=_hivemind_worker, args=(0, None, sizes, repeats, peers, q, ready))
    first.start()
    initial = ready.get(timeout=120)
    procs = [first] + [ctx.Process(target=_hivemind_worker, args=(r, initial, sizes, repeats, peers, q, ready))
                       for r in range(1, peers)]
    for p in procs[1:]:
        p.start()
    results = [q.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(60)
    return {n: statistics.median(max(r[n][i] for _, r in results) for i in range(repeats)) for n in sizes}


# ---- dedloc -----------------------------------------------------------------------------------------
def _configs(peers: int, invite_only: bool, scratch: str) -> list:
    from dedloc import PeerConfig
    from dedloc.auth.invitation import RunOwner
    from dedloc.net.identity import create_identity

    rid = f"bench{os.getpid()}{'i' if invite_only else 'o'}"
    if not invite_only:
        return [PeerConfig(run_id=rid, log_level="WARNING") for _ in range(peers)]
    owner = RunOwner.init(os.path.join(scratch, "run"), rid)
    out = []
    for i in range(peers):
        path = os.path.join(scratch, f"peer{i}.key")
        out.append(PeerConfig(run_id=rid, log_level="WARNING", owner=owner.public, identity_path=path,
                              invite=owner.invite(create_identity(path), 3600)))
    return out


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time of these processes and their children (the p2p daemons)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc] + proc.children(recursive=True):
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def bench_dedloc(peers: int, sizes: list[int], repeats: int, compression: str,
                 invite_only: bool = False, verify: bool = False) -> dict[int, tuple[float, float, float]]:
    """Per size: (median all-reduce s, median total s, CPU s per round of all peers' processes)."""
    import tempfile

    from dedloc import AveragingConfig
    from dedloc.peer import start_peers

    cfg = AveragingConfig(matchmaking_time=2.0, averaging_timeout=900, compression=compression, probe_interval=0,
                          verify=verify)
    scratch = tempfile.mkdtemp(prefix="dedloc-bench-")
    group = start_peers(_configs(peers, invite_only, scratch), cfg)
    pids = [p.runtime.pid for p in group]
    out, step = {}, 0
    try:
        with cf.ThreadPoolExecutor(peers) as pool:
            for n in [1024] + sizes:  # the first round opens connections
                xs = [torch.randn(n) for _ in group]
                runs = []
                cpu = _cpu_seconds(pids)
                for _ in range(repeats if n in sizes else 1):
                    t = time.perf_counter()
                    stats = list(pool.map(lambda a: a[0].average(a[1], step=step, weight=1.0, expected_peers=peers),
                                          zip(group, xs)))
                    total = time.perf_counter() - t
                    runs.append((max(s["allreduce_s"] for s in stats), total))
                    step += 1
                if n in sizes:
                    out[n] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                              (_cpu_seconds(pids) - cpu) / len(runs))
    finally:
        for p in group:
            p.close()
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compression", default="none", choices=["none", "float16"])
    ap.add_argument("--skip-hivemind", action="store_true")
    ap.add_argument("--auth", action="store_true", help="instead: open vs invite-only dedloc rounds")
    ap.add_argument("--verify", action="store_true", help="instead: plain vs verified dedloc rounds")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.auth or args.verify:
        a, b = ("open", "invite") if args.auth else ("plain", "verified")
        first = bench_dedloc(args.peers, sizes, args.repeats, args.compression)
        second = bench_dedloc(args.peers, sizes, args.repeats, args.compression, invite_only=args.auth,
                              verify=args.verify)
        for n in sizes:
            (x, xt, xc), (y, yt, yc) = first[n], second[n]
            print(json.dumps({"numel": n, "peers": args.peers, f"{a}_allreduce_s": round(x, 4),
                              f"{a}_total_s": round(xt, 4), f"{b}_allreduce_s": round(y, 4),
                              f"{b}_total_s": round(yt, 4), f"{b}_vs_{a}_total": round(yt / xt, 3),
                              f"{a}_cpu_s": round(xc, 3), f"{b}_cpu_s": round(yc, 3),
                              f"{b}_vs_{a}_cpu": round(yc / xc, 3) if xc else None}), flush=True)
        return
    ours = bench_dedloc(args.peers, sizes, args.repeats, args.compression)
    gloo = bench_gloo(args.peers, sizes, args.repeats)
    hm = {} if args.skip_hivemind else bench_hivemind(args.peers, sizes, args.repeats)
    for n in sizes:
        d, dt, _ = ours[n]
        row = {"numel": n, "peers": args.peers, "compression": args.compression, "dedloc_s": round(d, 4),
               "dedloc_total_s": round(dt, 4), "gloo_s": round(gloo[n], 4), "hivemind_s": round(hm[n], 4) if hm else None,
               "vs_gloo": round(gloo[n] / d, 3), "vs_hivemind": round(hm[n] / dt, 3) if hm else None,
               "dedloc_MBps": round(n * 4 / d / 1e6, 1), "gloo_MBps": round(n * 4 / gloo[n] / 1e6, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
