"""What plain TCP achieves for a plan's traffic on the shaped network: the floor for our stack.

The LP predicts a round from link capacities (docs/planning.md). On a real (or emulated) network
even plain TCP does not reach them: TCP/IP headers and ACKs take a share of each link, flows
share tbf queues unevenly, and the slowest flow sets the end. This sends the plan's traffic with
nothing but kernel TCP, one process per namespace: every sender sends part ``j``
(``shares[j] * nbytes``) to aggregator ``j`` (phase 1), and every aggregator sends its part to
every receiver (phase 2). Two ways:

- ``overlapped_seconds``: all flows of both phases at once, as a streamed round overlaps them
  (it cannot do better: its results also wait for their contributions);
- ``two_phase_seconds``: phase 2 starts when phase 1 has ended everywhere.

No daemon, encryption, Python framing or reduction: ``dedloc_s / tcp_s`` is what our stack
costs over the links' own limit.

Used by bench/netem/run.py (``--tcp-floor``). Run inside a namespace as
``python tcp_floor.py --serve IP`` (driven over stdin/stdout with JSON lines).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

PORT = 9901
BUF = 1 << 20


def _serve(ip: str) -> None:
    """One peer: accept connections and drain them; on each command, send, then report when the
    phase's sends are read to the end and the expected receives are complete."""
    zeros = memoryview(bytearray(BUF))
    lock = threading.Condition()
    received = [0]  # completed incoming flows

    def drain(conn: socket.socket) -> None:
        buf = bytearray(BUF)
        with conn:
            while conn.recv_into(buf):
                pass
            conn.sendall(b"k")  # tells the sender its last byte arrived
        with lock:
            received[0] += 1
            lock.notify_all()

    srv = socket.create_server((ip, PORT), backlog=64)

    def accept() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)

    def send(dest: str, nbytes: int) -> None:
        with socket.create_connection((dest, PORT), timeout=60) as s:
            left = nbytes
            while left:
                n = s.send(zeros[:min(left, BUF)])
                left -= n
            s.shutdown(socket.SHUT_WR)
            s.recv(1)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            return
        target = received[0] + cmd["expect"]
        threads = [threading.Thread(target=send, args=(d, n)) for d, n in cmd["send"] if n > 0]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with lock:
            lock.wait_for(lambda: received[0] >= target, timeout=600)
        print(json.dumps({"done": received[0] >= target}), flush=True)


def _commands(ips: Sequence[str], shares: Sequence[float], sends: Sequence[bool], receives: Sequence[bool],
              nbytes: int) -> tuple[list[dict], list[dict]]:
    """Each peer's command for phase 1 and for phase 2: the flows it sends, the flows it expects."""
    n = len(ips)
    total = sum(shares)
    part = [int(nbytes * g / total) for g in shares]
    phase1 = [{"send": [(ips[j], part[j]) for j in range(n) if j != i and sends[i]],
               "expect": sum(1 for k in range(n) if k != i and sends[k] and part[i] > 0)} for i in range(n)]
    phase2 = [{"send": [(ips[k], part[i]) for k in range(n) if k != i and receives[k]],
               "expect": sum(1 for j in range(n) if j != i and receives[i] and part[j] > 0)} for i in range(n)]
    return phase1, phase2


def _run(exec_args: Sequence[Sequence[str]], ips: Sequence[str], steps: Sequence[Sequence[dict]]) -> list[float]:
    """Start one TCP peer per namespace and run ``steps`` one after the other (each step: one
    command per peer, all at once); returns each step's seconds."""
    procs = [subprocess.Popen(list(args) + [sys.executable, __file__, "--serve", ip], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for args, ip in zip(exec_args, ips)]
    try:
        for p in procs:
            if not json.loads(p.stdout.readline()).get("ready"):
                raise RuntimeError("a TCP floor peer did not start")
        times = []
        for cmds in steps:
            t0 = time.monotonic()
            for p, cmd in zip(procs, cmds):
                p.stdin.write(json.dumps(cmd) + "\n")
                p.stdin.flush()
            for p in procs:
                if not json.loads(p.stdout.readline()).get("done"):
                    raise RuntimeError("a TCP floor step did not complete")
            times.append(time.monotonic() - t0)
        return times
    finally:
        for p in procs:
            try:
                p.stdin.write(json.dumps({"quit": True}) + "\n")
                p.stdin.close()
                p.wait(timeout=10)
            except Exception:
                p.kill()


def two_phase_seconds(exec_args: Sequence[Sequence[str]], ips: Sequence[str], shares: Sequence[float],
                      sends: Sequence[bool], receives: Sequence[bool], nbytes: int) -> tuple[float, float]:
    """Run the plan's two phases with plain TCP, one after the other; returns (phase 1 s, phase 2 s)."""
    phase1, phase2 = _commands(ips, shares, sends, receives, nbytes)
    t1, t2 = _run(exec_args, ips, [phase1, phase2])
    return t1, t2


def overlapped_seconds(exec_args: Sequence[Sequence[str]], ips: Sequence[str], shares: Sequence[float],
                       sends: Sequence[bool], receives: Sequence[bool], nbytes: int) -> float:
    """Run all flows of the plan's two phases at once with plain TCP; returns the seconds."""
    phase1, phase2 = _commands(ips, shares, sends, receives, nbytes)
    both = [{"send": a["send"] + b["send"], "expect": a["expect"] + b["expect"]} for a, b in zip(phase1, phase2)]
    return _run(exec_args, ips, [both])[0]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(sys.argv[2])
    else:
        sys.exit(__doc__)
