"""All-reduce benchmark: dedloc against torch.distributed gloo and hivemind's DecentralizedAverager.

Every backend runs in the same ``--peers`` worker processes, interleaved round by round (the order
rotates each repeat, a gloo barrier before each round), so all of them see the same machine load.
Each size gets one untimed warm-up round per backend. Times are the slowest worker's; the median
over ``--repeats``. Prints one JSON line per size, as soon as it is measured:
  dedloc_s        one dedloc round after matchmaking (the figure to compare with gloo)
  dedloc_total_s  one ``peer.average()`` call, matchmaking included (to compare with hivemind)
  gloo_s, hivemind_s (``averager.step()``: matchmaking included)
  vs_gloo = gloo_s / dedloc_s;  vs_hivemind = hivemind_s / dedloc_total_s
  *_cpu_s_per_GB  CPU seconds of all workers' process trees (runtimes and daemons included) per GB
                  of vector averaged, per backend
Every round is bounded (``--round-timeout``); a round that fails or times out is counted in
``failed`` and left out of the medians; a worker that stops answering ends the run with what finished.

``--transport tcp|libp2p`` and ``--encryption on|off`` choose dedloc's data path. With ``--compare
auth|verify|encryption|transport``, two dedloc collaborations run instead (the base and the variant,
interleaved the same way): an open run against an invite-only one, plain rounds against verified
ones, TLS against plaintext direct connections, libp2p streams against direct connections. The line
then gives ``a_*`` (base), ``b_*`` (variant) and ``b_vs_a_total``, ``b_vs_a_cpu``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
import traceback

import torch

COMPARISONS = {
    "auth": ("open", "invite-only", {}, {"invite_only": True}),
    "verify": ("plain", "verified", {}, {"verify": True}),
    "encryption": ("tls", "plaintext", {}, {"encryption": False}),
    "transport": ("libp2p", "direct", {"transport": "libp2p"}, {}),
}


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KM" else s) * mult)


def _cpu_seconds() -> float:
    """CPU time of this process and all its descendants (runtimes, daemons, hivemind's processes)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# ---- one worker ------------------------------------------------------------------------------------------
def _dedloc_configs(rank: int, peers: int, rid: str, scratch: str, invite_only: bool) -> "object":
    from dedloc import PeerConfig

    if not invite_only:
        return PeerConfig(run_id=rid, log_level="WARNING")
    from dedloc.auth.invitation import RunOwner
    from dedloc.auth.identity import create_identity

    run_dir = os.path.join(scratch, "run")
    owner = RunOwner.load(run_dir) if rank else RunOwner.init(run_dir, rid)
    path = os.path.join(scratch, f"peer{rank}.key")
    return PeerConfig(run_id=rid, log_level="WARNING", owner=owner.public, identity_path=path,
                      invite=owner.invite(create_identity(path), 3600))


def _worker(rank: int, args: dict, port: int, boot: "mp.Queue", out: "mp.Queue") -> None:
    try:
        _work(rank, args, port, boot, out)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        raise


def _work(rank: int, args: dict, port: int, boot: "mp.Queue", out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    peers, sizes, repeats, limit = args["peers"], args["sizes"], args["repeats"], args["round_timeout"]
    backends: list[str] = args["backends"]

    # hivemind first: its DHT and averagers are fork-started processes (before any thread exists here);
    # a spawned worker's default start method is spawn, which cannot pickle them
    averagers = {}
    if "hivemind" in backends:
        mp.set_start_method("fork", force=True)
        import hivemind

        dht = hivemind.DHT(initial_peers=None if rank == 0 else boot.get(timeout=120), start=True)
        if rank == 0:
            for _ in range(peers - 1):
                boot.put([str(a) for a in dht.get_visible_maddrs()])
        for n in sizes:
            averagers[n] = hivemind.averaging.DecentralizedAverager(
                [torch.zeros(n)], dht, prefix=f"bench{n}", start=True, target_group_size=peers,
                min_matchmaking_time=1.0, request_timeout=10, allreduce_timeout=limit)

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=peers)

    from dedloc import AveragingConfig
    from dedloc.peer import Peer

    dedlocs = {}
    scratch = args["scratch"]
    for name, variant in args["dedloc"].items():
        variant = dict(variant)
        invite_only = variant.pop("invite_only", False)
        cfg = AveragingConfig(matchmaking_time=2.0, averaging_timeout=limit, compression=args["compression"],
                              probe_interval=0, **variant)
        rid, where = f"bench{port}{name.replace('-', '')}", os.path.join(scratch, name)
        maddrs = [None]
        if rank == 0:  # it makes the run (and, invite-only, its owner) before the others read it
            dedlocs[name] = Peer(_dedloc_configs(rank, peers, rid, where, invite_only), cfg)
            maddrs = [list(dedlocs[name].maddrs)]
        dist.broadcast_object_list(maddrs, src=0)
        if rank:
            import dataclasses

            peer_cfg = _dedloc_configs(rank, peers, rid, where, invite_only)
            dedlocs[name] = Peer(dataclasses.replace(peer_cfg, initial_peers=tuple(maddrs[0])), cfg)
        dist.barrier()

    step = 0

    def run(backend: str, x: torch.Tensor) -> tuple[bool, float | None]:
        """One round; (succeeded, dedloc's all-reduce seconds after matchmaking)."""
        nonlocal step
        if backend == "gloo":
            dist.all_reduce(x)
            return True, None
        if backend == "hivemind":
            avg = averagers[x.numel()]
            with avg.get_tensors() as tensors:
                tensors[0].copy_(x)
            return avg.step(timeout=limit) is not None, None
        step += 1
        stats = dedlocs[backend].average(x, step=step, weight=1.0, expected_peers=peers, timeout=limit)
        return True, stats.allreduce_s

    gen = torch.Generator().manual_seed(rank)
    for n in sizes:
        x = torch.randn(n, generator=gen)
        for r in range(repeats + 1):  # round 0: warm-up, untimed
            order = backends[r % len(backends):] + backends[:r % len(backends)]
            for b in order:
                dist.barrier()
                c0, t0 = _cpu_seconds(), time.perf_counter()
                try:
                    ok, inner = run(b, x.clone())
                except Exception as e:
                    ok, inner = False, None
                    print(f"worker {rank}: {b} round at {n} failed: {type(e).__name__}: {e}", flush=True)
                dt, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
                if r:
                    out.put(("round", rank, n, r, b, ok, dt, inner, cpu))
    dist.barrier()
    out.put(("done", rank))
    for p in dedlocs.values():
        p.close()
    for a in averagers.values():
        a.shutdown()
    dist.destroy_process_group()


# ---- the driver --------------------------------------------------------------------------------------------
def _summarise(rounds: list[tuple], n: int, backends: list[str], peers: int) -> dict[str, dict]:
    """Per backend at size n: median slowest-worker time, median inner time, CPU s per GB, failures."""
    out = {}
    gb = n * 4 / 1e9
    for b in backends:
        per_round: dict[int, list[tuple]] = {}
        for _, rank, size, r, name, ok, dt, inner, cpu in rounds:
            if size == n and name == b:
                per_round.setdefault(r, []).append((ok, dt, inner, cpu))
        good = [v for v in per_round.values() if len(v) == peers and all(ok for ok, *_ in v)]
        out[b] = {
            "s": statistics.median(max(dt for _, dt, _, _ in v) for v in good) if good else None,
            "inner_s": statistics.median(max(i or 0.0 for _, _, i, _ in v) for v in good) if good else None,
            "cpu_per_GB": statistics.median(sum(c for *_, c in v) for v in good) / gb if good else None,
            "failed": len(per_round) - len(good),
        }
    return out


def _round(x: float | None, k: int = 4) -> float | None:
    return None if x is None else round(x, k)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compression", default="none", choices=["none", "float16"])
    ap.add_argument("--transport", default="tcp", choices=["tcp", "libp2p"],
                    help="tcp: direct connections (libp2p where one fails); libp2p: every stream through the daemon")
    ap.add_argument("--encryption", default="on", choices=["on", "off"], help="TLS on direct connections")
    ap.add_argument("--planner", default="lp", help="how dedloc's leaders set shares (AveragingConfig.planner)")
    ap.add_argument("--skip-hivemind", action="store_true")
    ap.add_argument("--compare", choices=sorted(COMPARISONS), help="instead: two dedloc variants (module doc)")
    ap.add_argument("--round-timeout", type=float, default=300.0, help="bound on every round, any backend")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    base = {"transport": "libp2p" if args.transport == "libp2p" else "auto", "encryption": args.encryption == "on",
            "planner": args.planner}
    if args.compare:
        a_name, b_name, a_changes, b_changes = COMPARISONS[args.compare]
        dedloc = {a_name: {**base, **a_changes}, b_name: {**base, **b_changes}}
        backends = [a_name, b_name]
    else:
        dedloc = {"dedloc": base}
        backends = ["dedloc", "gloo"] + ([] if args.skip_hivemind else ["hivemind"])
    scratch = tempfile.mkdtemp(prefix="dedloc-bench-")
    for name in dedloc:
        os.makedirs(os.path.join(scratch, name))
    work = {"peers": args.peers, "sizes": sizes, "repeats": args.repeats, "round_timeout": args.round_timeout,
            "backends": backends, "dedloc": dedloc, "compression": args.compression, "scratch": scratch}
    ctx = mp.get_context("spawn")
    boot, results = ctx.Queue(), ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, work, port, boot, results)) for r in range(args.peers)]
    for p in procs:
        p.start()
    rounds: list[tuple] = []
    printed: set[int] = set()
    done = 0
    expected = {n: args.repeats * len(backends) * args.peers for n in sizes}
    slowest = args.round_timeout * len(backends) + 600  # the longest a whole repeat may take, warm-up included
    try:
        while done < args.peers:
            try:
                msg = results.get(timeout=slowest)
            except queue.Empty:
                print(json.dumps({"error": f"no worker answered for {slowest:.0f} s; ending with what finished"}))
                break
            if msg[0] == "error":
                print(json.dumps({"error": f"worker {msg[1]} failed", "traceback": msg[2][-2000:]}))
                break
            if msg[0] == "done":
                done += 1
                continue
            rounds.append(msg)
            for n in sizes:
                if n not in printed and sum(1 for m in rounds if m[2] == n) == expected[n]:
                    printed.add(n)
                    _print(n, args, base, backends, _summarise(rounds, n, backends, args.peers))
    finally:
        for n in sizes:  # a run that ended early: whatever finished
            if n not in printed and any(m[2] == n for m in rounds):
                _print(n, args, base, backends, _summarise(rounds, n, backends, args.peers), partial=True)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


def _print(n: int, args, base: dict, backends: list[str], s: dict[str, dict], partial: bool = False) -> None:
    row: dict = {"numel": n, "peers": args.peers, "compression": args.compression, "transport": args.transport,
                 "encryption": args.encryption, "planner": args.planner}
    if args.compare:
        a, b = backends
        row.update({"compare": args.compare, "a": a, "b": b, "a_s": _round(s[a]["inner_s"]),
                    "a_total_s": _round(s[a]["s"]), "b_s": _round(s[b]["inner_s"]), "b_total_s": _round(s[b]["s"]),
                    "b_vs_a_total": _ratio(s[b]["s"], s[a]["s"]),
                    "a_cpu_s_per_GB": _round(s[a]["cpu_per_GB"], 2), "b_cpu_s_per_GB": _round(s[b]["cpu_per_GB"], 2),
                    "b_vs_a_cpu": _ratio(s[b]["cpu_per_GB"], s[a]["cpu_per_GB"])})
    else:
        d, g, h = s["dedloc"], s["gloo"], s.get("hivemind")
        row.update({"dedloc_s": _round(d["inner_s"]), "dedloc_total_s": _round(d["s"]), "gloo_s": _round(g["s"]),
                    "hivemind_s": _round(h["s"]) if h else None,
                    "vs_gloo": _ratio(g["s"], d["inner_s"]), "vs_hivemind": _ratio(h["s"], d["s"]) if h else None,
                    "dedloc_MBps": round(n * 4 / d["inner_s"] / 1e6, 1) if d["inner_s"] else None,
                    "gloo_MBps": round(n * 4 / g["s"] / 1e6, 1) if g["s"] else None,
                    **{f"{b}_cpu_s_per_GB": _round(s[b]["cpu_per_GB"], 2) for b in backends}})
    failed = {b: s[b]["failed"] for b in backends if s[b]["failed"]}
    if failed:
        row["failed"] = failed
    if partial:
        row["partial"] = True
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
