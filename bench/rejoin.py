"""How fast a newcomer reads every live peer's progress through a backbone just restarted (kill -9).

    python bench/rejoin.py [--peers 4] [--trials 3]

A backbone (``dedloc backbone``, deployed as the README says: fixed address, no initial peers) and
``--peers`` peers publishing progress every second; the backbone is killed with kill -9 and started
again with the same command line, and at once a newcomer whose only initial peer is the backbone
reads the run's progress every 0.1 s until it sees every peer. Measured with the backbone's run
memory (``run.json``: it reconnects to the peers it knew) and, as the baseline, with that file
removed before the restart (the peers come back on their own: their DHT stores reach the backbone
again). Prints one JSON line: per mode, seconds from the newcomer's start to a full view, and from
the backbone's kill.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import uuid

from dedloc.config import PeerConfig
from dedloc.peer import Peer
from dedloc.records import Role
from dedloc.testing.procs import sessions_alive, spawn_cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backbone:
    def __init__(self, workdir: str, run_id: str):
        self.argv = ["backbone", "--run-id", run_id, "--identity-path", os.path.join(workdir, "backbone.key"),
                     "--checkpoint-dir", os.path.join(workdir, "ckpt"), "--host-maddrs",
                     f"/ip4/127.0.0.1/tcp/{free_port()}"]
        self.log = open(os.path.join(workdir, "backbone.log"), "a")
        self.sessions: set[int] = set()
        self.proc: subprocess.Popen | None = None
        self.maddrs: list[str] = []

    def start(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the killed one's daemon may hold the port a moment
            self.proc = spawn_cli(*self.argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
            self.sessions.add(self.proc.pid)
            for line in self.proc.stdout:
                if "--initial-peers" in line:
                    self.maddrs = line.split("--initial-peers", 1)[1].split()
                    return
            self.proc.wait()
        raise RuntimeError("the backbone did not start")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()


def trial(workdir: str, n: int, memory: bool) -> dict:
    run_id = "rejoin" + uuid.uuid4().hex[:8]
    backbone = Backbone(workdir, run_id)
    peers: list[Peer] = []
    stop = threading.Event()
    threads = []
    newcomer = None
    try:
        backbone.start()
        peers = [Peer(PeerConfig(run_id=run_id, initial_peers=tuple(backbone.maddrs))) for _ in range(n)]

        def publish(p: Peer) -> None:
            while not stop.is_set():
                try:
                    p.publish_progress(1, 0, 1.0, role=Role.TRAINER)
                except Exception:
                    pass
                stop.wait(1.0)

        threads = [threading.Thread(target=publish, args=(p,), daemon=True) for p in peers]
        for t in threads:
            t.start()
        # the backbone remembers its peers (every 10 s, or a new one); a version without a run memory doesn't
        deadline = time.monotonic() + (60 if importlib.util.find_spec("dedloc.state.run_memory") else 0)
        path = os.path.join(workdir, "ckpt", "run.json")
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    if len(json.load(f)["peers"]) >= n:
                        break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        killed = time.monotonic()
        backbone.proc.kill()
        backbone.proc.wait()
        if not memory and os.path.exists(path):
            os.remove(path)
        backbone.start()
        started = time.monotonic()
        newcomer = Peer(PeerConfig(run_id=run_id, initial_peers=tuple(backbone.maddrs)))
        joined = time.monotonic()
        want = {p.peer_id for p in peers}
        seen = 0
        while time.monotonic() < joined + 120:
            seen = len(want & {r.peer_id for r in newcomer.collaboration().peers})
            if seen == n:
                break
            time.sleep(0.1)
        done = time.monotonic()
        return {"full_view": seen == n, "from_newcomer_s": round(done - joined, 2),
                "from_kill_s": round(done - killed, 2), "restart_s": round(started - killed, 2)}
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for p in peers + ([newcomer] if newcomer is not None else []):
            p.close()
        backbone.close()
        deadline = time.monotonic() + 15
        while sessions_alive(backbone.sessions) and time.monotonic() < deadline:
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    out = {"peers": args.peers}
    for mode, memory in (("run_memory", True), ("baseline_no_memory", False)):
        runs = []
        for _ in range(args.trials):
            workdir = tempfile.mkdtemp(prefix="dedloc-rejoin-")
            try:
                runs.append(trial(workdir, args.peers, memory))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        out[mode] = {"runs": runs, "median_from_newcomer_s": statistics.median(r["from_newcomer_s"] for r in runs),
                     "all_full": all(r["full_view"] for r in runs)}
    out["ratio_baseline_over_memory"] = round(out["baseline_no_memory"]["median_from_newcomer_s"] /
                                              max(out["run_memory"]["median_from_newcomer_s"], 0.01), 2)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
