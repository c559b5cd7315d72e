"""`dedloc demo --averaging`: a local collaboration averages vectors and shows what happened.

Peers: one reachable trainer per ``--peers`` (the first is the initial peer), one of them in
client mode, and one aggregator-only peer (weight 0). Each round every trainer contributes a
random vector with a random sample weight; the demo checks the result against the reference
weighted mean and that all peers hold identical values.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from dedloc.config import AveragingConfig, PeerConfig
from dedloc.peer import start_peers


@dataclass
class AveragingDemoConfig:
    peers: int = 4
    numel: int = 1 << 20
    rounds: int = 3
    run_id: str = "demo-averaging"


def run(cfg: AveragingDemoConfig, console: Console | None = None) -> dict:
    console = console or Console()
    averaging = AveragingConfig(matchmaking_time=3.0, averaging_timeout=60.0)
    n = max(2, cfg.peers)
    configs = [PeerConfig(run_id=cfg.run_id, client_mode=(i == n - 1 and n > 2)) for i in range(n)]
    configs.append(PeerConfig(run_id=cfg.run_id))  # aggregator-only
    console.print(f"starting {n} trainers (1 in client mode) and 1 aggregator-only peer ...")
    t0 = time.time()
    peers = start_peers(configs, averaging)
    roles = ["client" if p.config.client_mode else "trainer" for p in peers[:-1]] + ["aggregator"]
    console.print(f"all {len(peers)} peers up in {time.time() - t0:.1f} s")
    table = Table(title=f"averaging {cfg.numel:,} float32 per peer")
    for col in ("step", "peers", "time s", "max |err| vs reference", "identical on all"):
        table.add_column(col, justify="right")
    results = []
    try:
        gen = torch.Generator().manual_seed(0)
        with cf.ThreadPoolExecutor(len(peers)) as pool:
            for step in range(cfg.rounds):
                xs = [torch.randn(cfg.numel, generator=gen) for _ in peers]
                ws = [float(torch.randint(1, 100, (1,), generator=gen)) for _ in peers[:-1]] + [0.0]
                ref = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
                t = time.perf_counter()
                futs = [pool.submit(p.average, x, step=step, weight=w, expected_peers=len(peers))
                        for p, x, w in zip(peers, xs, ws)]
                stats = [f.result() for f in futs]
                dt = time.perf_counter() - t
                err = max(float((x - ref).abs().max()) for x in xs)
                same = all(torch.equal(xs[0], x) for x in xs)
                results.append({"step": step, "seconds": dt, "max_err": err, "identical": same,
                                "group_size": stats[0].group_size})
                table.add_row(str(step), str(stats[0].group_size), f"{dt:.2f}", f"{err:.2e}", "yes" if same else "NO")
    finally:
        for p in peers:
            p.close()
    console.print(table)
    console.print("roles: " + ", ".join(f"{p.peer_id[-6:]}={r}" for p, r in zip(peers, roles)))
    return {"rounds": results, "peers": len(peers)}
