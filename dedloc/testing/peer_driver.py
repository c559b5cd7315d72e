"""One peer driven over stdin/stdout with JSON lines, for tests and benchmarks in network namespaces.

Commands: start, probe, average, caps, connections, maddrs, offer, download, reconfigure, close.
Each answers one JSON line ({"ok": ...} or {"error": "..."}). Used by tests/test_netem.py,
tests/test_nat.py and bench/netem/; not a user-facing tool.
"""

import json
import os
import subprocess
import sys
import threading
import time
import traceback

import torch

from dedloc.config import AveragingConfig, PeerConfig
from dedloc.peer import Peer
from dedloc.peer_api import PeerAPI


def vector(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def main() -> None:
    peer = None
    out = sys.stdout
    sys.stdout = sys.stderr  # only answers go to the real stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd.pop("op")
            if op == "start":
                peer = Peer(PeerConfig(**cmd["peer"]), AveragingConfig(**cmd["averaging"]))
                answer = {"peer_id": peer.peer_id, "maddrs": peer.maddrs, "reachable": peer.reachable,
                          "reachability": peer.reachability}
            elif op == "probe":
                answer = peer.probe(cmd.get("peers"), timeout=300)
            elif op == "caps":
                answer = peer.capabilities()
            elif op == "connections":
                answer = peer.connections()
            elif op == "maddrs":
                answer = peer.runtime.call(PeerAPI.info)["maddrs"]
            elif op == "offer":
                peer.offer_state(cmd["step"], vector(cmd["seed"], cmd["numel"]).numpy().tobytes())
                answer = {}
            elif op == "download":
                step, blob, donor = peer.download_state(cmd["donors"], cmd["min_step"], cmd["within"])
                answer = {"step": step, "donor": donor,
                          "identical": blob == vector(cmd["seed"], cmd["numel"]).numpy().tobytes()}
            elif op == "reconfigure":
                peer.reconfigure(**cmd["changes"])
                answer = {}
            elif op == "average":
                x = vector(cmd["seed"], cmd["numel"])
                t0 = time.perf_counter()
                stats = peer.average(x, step=cmd["step"], weight=cmd["weight"], expected_peers=cmd["expected"],
                                     timeout=cmd.get("timeout"), gather_time=cmd.get("gather_time"))
                answer = {"seconds": time.perf_counter() - t0, "allreduce_s": stats.allreduce_s,
                          "shares": list(stats.shares), "peers": list(stats.peers), "group_size": stats.group_size,
                          "failovers": stats.failovers, "queue_s": stats.queue_s, "checksum": float(x.double().sum()),
                          "head": x[:4].tolist()}
            elif op == "close":
                if peer is not None:
                    peer.close()
                out.write(json.dumps({"ok": {}}) + "\n")
                out.flush()
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            out.write(json.dumps({"ok": answer}) + "\n")
        except Exception as e:
            traceback.print_exc()
            out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()


class DrivenPeer:
    """The other end: starts ``python -m dedloc.testing.peer_driver`` (inside a namespace when
    ``prefix`` is ``Network.exec_args(i)``) and exchanges one JSON line per command with it."""

    def __init__(self, prefix: list[str], index: int, logdir: str):
        self.index = index
        self.log = open(os.path.join(logdir, f"peer{index}.log"), "w")
        self.proc = subprocess.Popen(prefix + [sys.executable, "-m", "dedloc.testing.peer_driver"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float = 120.0):
        """The answer's value; RuntimeError naming the peer on an error answer or no answer in time."""
        box: list = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"peer {self.index} gave no answer within {timeout:.0f} s (see {self.log.name})")
        answer = json.loads(box[0])
        if "error" in answer:
            raise RuntimeError(f"peer {self.index}: {answer['error']} (see {self.log.name})")
        return answer["ok"]

    def call(self, timeout: float = 120.0, **cmd):
        self.send(**cmd)
        return self.receive(timeout)

    def close(self, timeout: float = 20.0) -> None:
        try:
            self.send(op="close")
            self.proc.wait(timeout)
        except Exception:
            pass
        self.log.close()


if __name__ == "__main__":
    main()
