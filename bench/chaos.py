"""Chaos soak: a collaboration under sustained churn, checked for lost steps, stalls, forks and leaks.

    python bench/chaos.py --minutes 30 [--delay-updates] [--seed 0] [--trainers 5]

(``DEDLOC_DEBUG=dedloc.averaging.matchmaking`` in the environment logs that layer at DEBUG in every peer.)

Runs a backbone (checkpoints), an aggregator-only peer and ``--trainers`` trainers (trainer 0 in
client mode) of bench/chaos_trainer.py on loopback, training a tiny MLP with target batch
``--target``. By default they are deployed as the README tells users (``--setup readme``): the
backbone is the first peer, with a fixed address, its checkpoint directory and identity and no
other option (so it checkpoints every 60 s), restarted with that same command line; every other
peer's only initial peer is the backbone. ``--setup two-bootstraps`` is the older, kinder set-up:
everyone also bootstraps from the aggregator, and the backbone checkpoints every 20 s and is
restarted with the aggregator as its initial peer. On a schedule drawn from ``--seed``:
- every ~``--fault-every`` s, a random running trainer is killed with kill -9 (restarted with the same
  identity 3-10 s later), stopped with SIGSTOP for 20-40 s (the training process alone, or the whole
  peer: its runtime and daemon too), or restarted cleanly (SIGTERM, then the same identity again);
  sometimes a never-seen peer joins with a fresh identity. At least two trainers keep running;
- every ~``--backbone-every`` s, the backbone is killed with kill -9 and restarted from its
  checkpoint directory on the same address 2-5 s later; meanwhile one running trainer is killed and
  restarted while the backbone is down (it waits to join), and right after the backbone is back a
  never-seen peer joins through it (or, once ``--max-new`` have, a trainer restarts).

``--partition``: every peer runs in a network namespace of its own, all on one bridge
(dedloc/testing/netem.py), and every ~``--partition-every`` s the trainers are split into two
halves for ``--split-s`` s, then healed: a random minority of the running trainers (fewer than
half when cut off) reach only each other; the backbone and the aggregator stay with the rest. The
run keeps the side with more live trainers at the heal (docs/optimizer.md, "Partitions"), which
can be the cut-off one when the others were frozen or killed meanwhile: the analysis finds which
side's history was kept by who downloaded whose states after the heal (``Split.decide``). The
other side's events while apart (``island``: until each of its trainers first applies a state of
the kept history after the heal) leave the disagreement checks and the replay, and
``island_adopted`` counts kept-history states equal to one of them (must be 0); ``partitions``
lists each split's island side (``cut_off_kept`` when it was the rest) and its steps.

Prints one JSON line: ``steps``, ``lost_steps`` (steps after which live peers' parameters
differed, plus trainers that raised instead of recovering), ``skipped_steps`` (lost by every
member and skipped by all), ``longest_stall_s``, ``max_param_diff``, ``replay_max_diff`` (a
single-process replay of the logged samples, with the same optimizer, against every step's
parameters; ``replay_float64_diff``: the same replay in float64 against the peers; ``replay_rounding``:
the float32 replay against the float64 one, how far rounding alone carries two exact computations
apart in this run; ``replay_within_rounding``: the peers are no farther from the float64 replay than
twice that), ``rss_growth`` (largest relative growth of a long-lived process's RSS level after the run's
and its own warm-up; ``rss_peak_growth``: of its highest sample; every sample goes to ``rss.jsonl``),
``orphans`` (processes and socket files left), ``applied_backwards`` (a trainer process whose applied
step went down: it adopted another history) and ``failures_injected`` by kind.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import torch

from dedloc.testing import netem
from dedloc.testing.procs import children, cli_command, session_pids, sessions_alive, stale_sockets

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import chaos_trainer as model_code  # noqa: E402  (the trainers' model, data and optimizer, for the replay)


ISLAND_SETTLE_S = 60.0
"""Seconds after a heal during which the smaller side's applied states still count as its own (``island``)."""
LEVEL_WINDOW = 180.0
"""Seconds of RSS samples whose median is a process's level (``rss_growth``)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_growth(series: dict[int, list[tuple[float, int]]], names: dict[int, str], start: float, end: float,
               warm: float) -> tuple[float, str | None, float, str | None]:
    """Over the long-lived processes (sampled for at least half the run), after the run's warm-up and
    each process's own (one restarted late was sampled while it still loaded torch and its first
    state: "183 -> 307 MiB"): the largest growth of the RSS *level*, the median of the last
    ``LEVEL_WINDOW`` of samples over the median of the first (a leak: it stays), and the largest
    *peak*, the highest sample over the first level (a state download's buffers: they come and go).
    Each with the process it names."""
    growth, grew, peak, peaked = 0.0, None, 0.0, None
    for pid, samples in series.items():
        settled = max(warm, samples[0][0] + (warm - start))
        after = [(t, kb) for t, kb in samples if t >= settled]
        if len(after) < 2 or samples[-1][0] - samples[0][0] < 0.5 * (end - start):
            continue
        window = min(LEVEL_WINDOW, (after[-1][0] - after[0][0]) / 3)
        first = statistics.median(kb for t, kb in after if t <= after[0][0] + window)
        last = statistics.median(kb for t, kb in after if t >= after[-1][0] - window)
        if last / first - 1 >= growth:
            growth, grew = last / first - 1, f"{names[pid]} pid {pid}: {first / 1024:.0f} -> {last / 1024:.0f} MiB"
        top = max(kb for _, kb in after)
        if top / first - 1 >= peak:
            peak, peaked = top / first - 1, f"{names[pid]} pid {pid}: {first / 1024:.0f} -> {top / 1024:.0f} MiB"
    return growth, grew, peak, peaked


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    started: float
    runtime_pid: int | None = None
    stopped_until: float | None = None
    stopped_whole: bool = False
    terminating_since: float | None = None


@dataclass
class Trainer:
    index: int
    client: bool
    identity: str
    events: str
    incarnation: int = 0
    proc: Proc | None = None
    restart_at: float | None = None
    sessions: set[int] = field(default_factory=set)


@dataclass
class Split:
    """One partition (``--partition``): the trainers moved to the smaller side, and when."""
    trainers: list[int]
    """The island side: the trainers cut off, or the rest when the cut-off side's history was kept."""
    at: float
    healed_at: float | None = None
    cut_off_kept: bool = False
    rejoined: dict[int, float] = field(default_factory=dict)
    """Trainer -> when it first applied a state of the kept history after the heal (``settle``)."""

    def island(self, trainer: int, t: float) -> bool:
        """Whether an event of ``trainer`` at ``t`` is the smaller side's while apart: before the
        trainer rejoined the kept history (until ``settle`` ran: ``ISLAND_SETTLE_S`` after the heal)."""
        if trainer not in self.trainers or t < self.at:
            return False
        if trainer in self.rejoined:
            return t < self.rejoined[trainer]
        return self.healed_at is None or t <= self.healed_at + ISLAND_SETTLE_S

    def decide(self, applied: list[dict], everyone: list[int]) -> None:
        """Which side's history the run kept: after the heal (within ``ISLAND_SETTLE_S``), the side
        whose trainers downloaded states the other side's rounds made was the island. If that was
        the rest, they become this split's island side (``cut_off_kept``)."""
        if self.healed_at is None:
            return
        until = self.healed_at + ISLAND_SETTLE_S
        cut, rest = set(self.trainers), set(everyone) - set(self.trainers)

        def made(side: set[int]) -> set[tuple[int, bytes]]:  # states a side's rounds made while apart or settling
            return {(e["applied"], _bytes(e["params"])) for e in applied
                    if e["trainer"] in side and e.get("via") == "round" and self.at <= e["t"] <= until}

        def took(side: set[int], made_by: set[tuple[int, bytes]]) -> int:
            return sum(1 for e in applied if e["trainer"] in side and e.get("via") == "state"
                       and self.healed_at <= e["t"] <= until and (e["applied"], _bytes(e["params"])) in made_by)

        # a state both sides' rounds made (the two met in one round after the heal) shows neither
        by_cut, by_rest = made(cut), made(rest)
        if took(rest, by_cut - by_rest) > took(cut, by_rest - by_cut):
            self.trainers, self.cut_off_kept = sorted(rest), True

    def settle(self, applied: list[dict], kept: dict[int, bytes]) -> None:
        """Find when each of its trainers rejoined: its first applied state after the heal that is the
        kept history's (``kept``: step -> parameters' bytes)."""
        for e in applied:
            if e["trainer"] in self.trainers and e["trainer"] not in self.rejoined and self.healed_at is not None \
                    and e["t"] >= self.healed_at and kept.get(e["applied"]) == _bytes(e["params"]):
                self.rejoined[e["trainer"]] = e["t"]
        for i in self.trainers:
            self.rejoined.setdefault(i, math.inf)


def _bytes(params: list[float]) -> bytes:
    return torch.tensor(params).numpy().tobytes()


def _majority(applied: list[dict]) -> dict[int, bytes]:
    """Step -> the parameters most applied events of it hold (as bytes)."""
    counts: dict[int, dict[bytes, int]] = {}
    for e in applied:
        by = counts.setdefault(e["applied"], {})
        b = _bytes(e["params"])
        by[b] = by.get(b, 0) + 1
    return {k: max(c, key=c.get) for k, c in counts.items()}


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: str):
        self.args, self.dir = args, workdir
        self.rng = random.Random(args.seed)
        self.run_id = "chaos" + uuid.uuid4().hex[:8]
        self.port = free_port()
        self.injected: dict[str, int] = {}
        self.crashed: list[str] = []
        self.sessions: set[int] = set()
        self.rss: dict[int, list[tuple[float, int]]] = {}
        self.rss_names: dict[int, str] = {}
        self.rss_log = open(os.path.join(workdir, "rss.jsonl"), "a")
        """Every RSS sample: ``{t, pid, proc, kb}`` (``proc``: the peer, and which of its processes)."""
        self.trainers: list[Trainer] = []
        self.backbone: Proc | None = None
        self.aggregator: Proc | None = None
        self.backbone_restart_at: float | None = None
        self.join_when_back = False
        """A newcomer joins right after the backbone is back."""
        self.aggregator_maddrs: list[str] = []
        self.sockets_before = set(glob.glob("/tmp/hivemind-*"))
        self.t0 = time.time()
        self.splits: list[Split] = []
        self.net: netem.Network | None = None
        if args.partition:  # slot 0: the backbone, 1: the aggregator, 2 + i: trainer i
            self.net = netem.Network([netem.Link()] * (2 + args.trainers + args.max_new))
            self.port = 31337

    def _slot(self, name: str) -> list[str]:
        """The command prefix that runs ``name`` in its namespace (none without ``--partition``)."""
        if self.net is None:
            return []
        slot = 0 if name == "backbone" else 1 if name == "aggregator" else 2 + int(name[len("trainer"):])
        return self.net.exec_args(slot)

    @property
    def host(self) -> str:
        return "127.0.0.1" if self.net is None else self.net.ip(0)

    # ---- processes ------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], pipe: bool = False) -> Proc:
        log = open(os.path.join(self.dir, f"{name}.log"), "a")
        popen = subprocess.Popen(self._slot(name) + argv, stdout=subprocess.PIPE if pipe else log, stderr=log,
                                 stdin=subprocess.DEVNULL, text=True,
                                 start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.sessions.add(popen.pid)
        return Proc(name, popen, time.time())

    def _role(self, role: str, extra: list[str]) -> tuple[Proc, list[str]]:
        proc = self._spawn(role, cli_command(role, "--run-id", self.run_id,
                                              "--identity-path", os.path.join(self.dir, f"{role}.key"), *extra),
                           pipe=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.popen.stdout.readline()
            if not line:
                raise RuntimeError(f"the {role} exited at start (see {self.dir}/{role}.log)")
            if "--initial-peers" in line:
                kids = children(proc.popen.pid)
                proc.runtime_pid = kids[0] if kids else None
                if proc.runtime_pid:
                    self.sessions.add(proc.runtime_pid)
                return proc, line.split("--initial-peers", 1)[1].split()
        raise RuntimeError(f"the {role} did not start within 90 s")

    def start_backbone(self) -> None:
        """The backbone, as deployed: the same command line at every (re)start."""
        extra = ["--host-maddrs", f"/ip4/{self.host}/tcp/{self.port}", "--checkpoint-dir", os.path.join(self.dir, "ckpt")]
        if self.args.setup == "two-bootstraps":
            extra += ["--checkpoint-interval", "20"]
            if self.aggregator is not None:
                extra += ["--initial-peers", *self.aggregator_maddrs]
        self.backbone, self.backbone_maddrs = self._role("backbone", extra)

    def bootstraps(self) -> list[str]:
        """A peer's initial peers: the backbone's address, as the README says (and the aggregator's,
        with ``--setup two-bootstraps``)."""
        return self.backbone_maddrs + (self.aggregator_maddrs if self.args.setup == "two-bootstraps" else [])

    def start_trainer(self, t: Trainer) -> None:
        spec = {"index": t.index, "incarnation": t.incarnation, "run_id": self.run_id, "client": t.client,
                "initial_peers": self.bootstraps(), "identity": t.identity,
                "events": t.events, "target": self.args.target, "micro": self.args.micro,
                "mb_seconds": self.args.mb_seconds * (1 + 0.5 * (t.index % 3)),
                "delay_updates": self.args.delay_updates, "log_level": self.args.log_level}
        t.proc = self._spawn(f"trainer{t.index}", [sys.executable, os.path.join(HERE, "chaos_trainer.py"),
                                                   json.dumps(spec)])
        t.restart_at = None

    def new_trainer(self, client: bool = False) -> Trainer:
        i = len(self.trainers)
        t = Trainer(i, client, os.path.join(self.dir, f"trainer{i}.key"), os.path.join(self.dir, f"trainer{i}.jsonl"))
        self.trainers.append(t)
        self.start_trainer(t)
        return t

    def running(self) -> list[Trainer]:
        return [t for t in self.trainers if t.proc is not None and t.proc.popen.poll() is None
                and t.proc.stopped_until is None and t.proc.terminating_since is None]

    def count(self, kind: str, what: str = "") -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1
        self.note(f"{kind} {what}".strip())

    def note(self, event: str) -> None:
        """One line in ``chaos.log``, in the peers' log format (so ``log_digest`` shows the faults too)."""
        with open(os.path.join(self.dir, "chaos.log"), "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} INFO [chaos] {event}\n")

    def runtime_pid(self, t: Trainer) -> int | None:
        if t.proc.runtime_pid is None:
            try:
                with open(t.events) as f:
                    for line in f:
                        ev = json.loads(line)
                        if ev["e"] == "start" and ev["inc"] == t.incarnation:
                            t.proc.runtime_pid = ev["runtime_pid"]
            except (OSError, ValueError):
                pass
        return t.proc.runtime_pid

    def _signal_peer(self, t: Trainer, sig: int, whole: bool) -> None:
        pids = [t.proc.popen.pid]
        if whole and (rt := self.runtime_pid(t)) is not None:
            pids += session_pids(rt)  # the runtime and its p2p daemon
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # ---- the schedule -----------------------------------------------------------------------------------
    def fault(self, now: float) -> None:
        running = self.running()
        kinds = ["kill9", "stop_trainer", "stop_peer", "restart", "join_new"]
        kind = self.rng.choices(kinds, weights=[25, 20, 20, 25, 10])[0]
        if kind == "join_new":
            if len(self.trainers) < self.args.trainers + self.args.max_new:
                self.new_trainer()
                self.count(kind, f"trainer{len(self.trainers) - 1}")
                return
            kind = "restart"
        if len(running) <= 2:
            return  # keep at least two trainers running
        t = self.rng.choice(running)
        self.count(kind, f"trainer{t.index}.{t.incarnation}")
        if kind == "kill9":
            t.proc.popen.kill()
            t.restart_at = now + self.rng.uniform(3, 10)
        elif kind in ("stop_trainer", "stop_peer"):
            whole = kind == "stop_peer"
            self._signal_peer(t, signal.SIGSTOP, whole)
            t.proc.stopped_until, t.proc.stopped_whole = now + self.rng.uniform(20, 40), whole
        else:
            t.proc.popen.terminate()
            t.proc.terminating_since = now

    def tick(self, now: float) -> None:
        for t in self.trainers:
            p = t.proc
            if p is None:
                continue
            if p.stopped_until is not None and now >= p.stopped_until:
                self._signal_peer(t, signal.SIGCONT, p.stopped_whole)
                p.stopped_until = None
                self.note(f"continued trainer{t.index}.{t.incarnation}")
            rc = p.popen.poll()
            if p.terminating_since is not None:
                if rc is None and now - p.terminating_since > 30:
                    p.popen.kill()  # a clean stop that did not finish: counted, then treated as a kill
                    self.count("restart_forced", f"trainer{t.index}.{t.incarnation}")
                elif rc is not None:
                    p.terminating_since = None
                    t.restart_at = now + self.rng.uniform(1, 3)
            elif rc is not None and t.restart_at is None:
                if rc != -signal.SIGKILL:
                    self.crashed.append(f"trainer{t.index}.{t.incarnation} exited with {rc}")
                t.restart_at = now + 5
            if t.restart_at is not None and now >= t.restart_at and rc is not None:
                t.incarnation += 1
                self.start_trainer(t)
                self.note(f"restarted trainer{t.index} as trainer{t.index}.{t.incarnation}")
        if self.backbone_restart_at is not None and now >= self.backbone_restart_at:
            self.backbone.popen.wait()
            try:
                self.start_backbone()
                self.backbone_restart_at = None
                self.note("restarted the backbone")
            except RuntimeError as e:  # e.g. its old daemon still holds the port: try again shortly
                self.crashed.append(f"backbone restart failed: {e}")
                self.backbone_restart_at = now + 5
        if self.join_when_back and self.backbone_restart_at is None:
            self.join_when_back = False
            if len(self.trainers) < self.args.trainers + self.args.max_new:
                self.new_trainer()
                self.count("join_after_backbone", f"trainer{len(self.trainers) - 1}")
            elif len(running := self.running()) > 2:
                t = self.rng.choice(running)
                t.proc.popen.terminate()
                t.proc.terminating_since = now
                self.count("restart_after_backbone", f"trainer{t.index}.{t.incarnation}")

    def kill_backbone(self, now: float) -> None:
        """kill -9 the backbone, restart it 2-5 s later; meanwhile a trainer is killed and restarted
        (it waits for the backbone to join), and a newcomer joins once the backbone is back."""
        self.backbone.popen.kill()
        self.count("backbone_kill9", "backbone")
        self.backbone_restart_at = now + self.rng.uniform(2, 5)
        self.join_when_back = True
        if len(running := self.running()) > 2:
            t = self.rng.choice(running)
            t.proc.popen.kill()
            t.restart_at = now + self.rng.uniform(0.5, self.backbone_restart_at - now)
            self.count("kill9_while_backbone_down", f"trainer{t.index}.{t.incarnation}")

    def split(self, now: float) -> bool:
        """Move a random minority of the running trainers (fewer than half) to a side of their own;
        False if too few run."""
        running = self.running()
        k = (len(running) - 1) // 2
        if k < 1:
            return False
        side = sorted(t.index for t in self.rng.sample(running, k))
        self.net.split([2 + i for i in side])
        self.splits.append(Split(side, now))
        self.count("partition", " ".join(f"trainer{i}" for i in side))
        return True

    def heal(self) -> None:
        self.net.heal()
        self.splits[-1].healed_at = time.time()  # (not the pass's start: a fault before it in the pass can block)
        self.note("healed the partition")

    def sample_rss(self) -> None:
        procs = [self.aggregator, self.backbone] + [t.proc for t in self.trainers if t.proc is not None]
        for p in procs:
            if p is None or p.popen.poll() is not None or p.stopped_until is not None:
                continue
            pids = [p.popen.pid]
            rt = p.runtime_pid
            if p.name.startswith("trainer"):
                t = self.trainers[int(p.name[7:])]
                rt = self.runtime_pid(t)
            if rt is not None:
                pids += session_pids(rt)
            for pid in pids:
                kb = rss_kb(pid)
                if kb:
                    kind = "" if pid == p.popen.pid else " runtime" if pid == rt else " daemon"
                    self.rss.setdefault(pid, []).append((time.time(), kb))
                    self.rss_names[pid] = p.name + kind
                    self.rss_log.write(json.dumps({"t": round(time.time() - self.t0, 1), "pid": pid,
                                                   "proc": p.name + kind, "kb": kb}) + "\n")
        self.rss_log.flush()

    def run(self) -> dict:
        args = self.args
        self.start_backbone()
        self.aggregator, self.aggregator_maddrs = self._role("aggregator", ["--initial-peers", *self.backbone_maddrs,
                                                                            "--probe-interval", "0"])
        for i in range(args.trainers):
            self.new_trainer(client=(i == 0))
        start = time.time()
        end = start + 60 * args.minutes
        warm = start + min(60.0, 0.2 * 60 * args.minutes)
        next_fault = warm + self.rng.uniform(0.6, 1.4) * args.fault_every
        next_backbone = start + self.rng.uniform(0.8, 1.2) * args.backbone_every
        next_rss = start
        next_split = warm + self.rng.uniform(0.8, 1.2) * args.partition_every if args.partition else math.inf
        heal_at = math.inf
        self.interrupted = False
        try:
            while time.time() < end:
                now = time.time()
                if now >= next_fault:
                    self.fault(now)
                    next_fault = now + self.rng.uniform(0.6, 1.4) * args.fault_every
                if now >= next_backbone and self.backbone_restart_at is None:
                    self.kill_backbone(now)
                    next_backbone = now + self.rng.uniform(0.8, 1.2) * args.backbone_every
                if now >= next_split:
                    heal_at = now + args.split_s if self.split(now) else math.inf
                    next_split = now + args.split_s + self.rng.uniform(0.8, 1.2) * args.partition_every
                if now >= heal_at:
                    self.heal()
                    heal_at = math.inf
                if now >= next_rss:
                    self.sample_rss()
                    next_rss = now + 10
                self.tick(now)
                time.sleep(0.2)
        except KeyboardInterrupt:  # stopped early (Ctrl+C, SIGTERM): still check and report what ran
            self.interrupted, end = True, time.time()
        finally:
            self.shutdown()
        return self.analyse(start, end, warm)

    def shutdown(self) -> None:
        procs = [t.proc for t in self.trainers if t.proc is not None] + [self.aggregator, self.backbone]
        for t in self.trainers:
            if t.proc is not None and t.proc.stopped_until is not None:
                self._signal_peer(t, signal.SIGCONT, True)
        for p in procs:
            if p is not None and p.popen.poll() is None:
                p.popen.terminate()
        deadline = time.monotonic() + 40
        for p in procs:
            if p is None:
                continue
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
                self.count("shutdown_forced", p.name)
        # runtimes run in sessions of their own: the trainers' events name them
        for t in self.trainers:
            try:
                with open(t.events) as f:
                    for line in f:
                        ev = json.loads(line)
                        if ev["e"] == "start":
                            self.sessions.add(ev["runtime_pid"])
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 15  # killed runtimes take a moment to finish exiting
        while sessions_alive(self.sessions) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.net is not None:
            self.net.close()

    # ---- the checks -------------------------------------------------------------------------------------
    def analyse(self, start: float, end: float, warm: float) -> dict:
        self.rss_log.close()
        events = []
        for t in self.trainers:
            if not os.path.exists(t.events):
                continue  # started just before the end and stopped before its first event
            with open(t.events) as f:
                for line in f:
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue  # a line cut by kill -9
                    ev["trainer"] = t.index
                    events.append(ev)
        events.sort(key=lambda e: e["t"])
        if self.splits:  # the kept history: what the trainers not apart (nor settling) applied
            applied = [e for e in events if e["e"] == "applied"]
            for sp in self.splits:
                sp.decide(applied, [t.index for t in self.trainers])
            kept = _majority([e for e in applied if not any(sp.island(e["trainer"], e["t"]) for sp in self.splits)])
            for sp in self.splits:
                sp.settle(applied, kept)
        islands = [e for e in events if e["e"] in ("applied", "round", "contrib")
                   and any(sp.island(e["trainer"], e["t"]) for sp in self.splits)]
        island_ids = {id(e) for e in islands}
        events = [e for e in events if id(e) not in island_ids]
        peer_of = {(e["trainer"], e["inc"]): e["peer_id"] for e in events if e["e"] == "start"}
        params: dict[int, list[tuple[str, list[float]]]] = {}
        first_at: dict[int, float] = {}
        for e in events:
            if e["e"] == "applied":
                params.setdefault(e["applied"], []).append((f"{e['trainer']}.{e['inc']}", e["params"]))
                first_at.setdefault(e["applied"], e["t"])
        backwards, last_applied = [], {}
        for e in events:
            if e["e"] == "applied":
                who = f"{e['trainer']}.{e['inc']}"
                if e["applied"] < last_applied.get(who, -1):
                    backwards.append(f"trainer{who}: {last_applied[who]} -> {e['applied']}")
                last_applied[who] = e["applied"]
        steps = max(params, default=0)
        disagreed, max_diff = [], 0.0
        majority = _majority([e for e in events if e["e"] == "applied"])
        canonical: dict[int, torch.Tensor] = {}
        for k, vs in sorted(params.items()):
            tensors = [torch.tensor(v) for _, v in vs]
            canonical[k] = next(x for x in tensors if x.numpy().tobytes() == majority[k])
            diff = max(float((x - y).abs().max()) for x in tensors for y in tensors)
            max_diff = max(max_diff, diff)
            if diff > 0:
                disagreed.append(k)
        # who took each disagreed step which way (the first three): what a failure in CI, which keeps no
        # logs, needs to tell a fork (two rounds of one step) from a bad download
        names = {pid: f"trainer{t}.{inc}" for (t, inc), pid in peer_of.items()}
        versions = {}
        for k in disagreed[:3]:
            groups = {}
            for e in events:
                if e["e"] == "applied" and e["applied"] == k:
                    key = hashlib.sha256(_bytes(e["params"])).hexdigest()[:8]
                    groups.setdefault(key, []).append(f"trainer{e['trainer']}.{e['inc']} {e['via']} "
                                                      f"at {e['t'] - start:.1f} s")
            rounds_of = [f"trainer{e['trainer']}.{e['inc']} with "
                         f"{sorted(names.get(c, c[:12]) for c in e['contributors'])} at {e['t'] - start:.1f} s"
                         for e in events if e["e"] == "round" and e["step"] == k - 1]
            versions[k] = {"applied": groups, "rounds": rounds_of[:12]}
        steps_at = [(k, first_at[k]) for k in sorted(first_at) if k > 0]
        windows = [(a, b, k) for (k, a), (_, b) in zip(steps_at, steps_at[1:])] + \
            ([(steps_at[-1][1], end, steps_at[-1][0])] if steps_at else [(start, end, 0)])
        stall_from, stall_to, stall_step = max(windows, key=lambda w: w[1] - w[0])
        crashes = [f"trainer{e['trainer']}.{e['inc']}: {e['error']}" for e in events if e["e"] == "crash"
                   and "KeyboardInterrupt" not in e["error"]]
        replay, replayed = self.replay(events, peer_of, canonical, steps)
        # the same replay in float64: how far fp32 rounding alone carries two exact computations apart
        # over this run's dynamics (the delayed soaks' replay differences grew run by run, to 2.5e-4)
        exact, exactly = self.replay(events, peer_of, canonical, steps, torch.float64)
        rounding = max((float((replayed[k].double() - exactly[k]).abs().max()) for k in replayed if k in exactly),
                       default=0.0)
        replay.update(replay_float64_diff=exact["replay_max_diff"], replay_rounding=rounding,
                      replay_within_rounding=exact["replay_max_diff"] <= 2 * rounding + 1e-6)
        island_params = {(e["applied"], _bytes(e["params"])) for e in islands if e["e"] == "applied"}
        adopted = sorted({e["applied"] for e in events if e["e"] == "applied"
                          and (e["applied"], b := _bytes(e["params"])) in island_params and b != majority[e["applied"]]})
        partitions = [{"side": [f"trainer{i}" for i in sp.trainers], "cut_off_kept": sp.cut_off_kept, "from_s": round(sp.at - start, 1),
                       "to_s": None if sp.healed_at is None else round(sp.healed_at - start, 1),
                       "island_steps": sorted({e["applied"] for e in islands if e["e"] == "applied"
                                               and e.get("via") != "join"  # a restart's first parameters
                                               and e["trainer"] in sp.trainers and sp.island(e["trainer"], e["t"])})[:50]}
                      for sp in self.splits]
        rounds = [e for e in events if e["e"] == "round" and not e["skipped"]]
        growth, grew, peak, peaked = rss_growth(self.rss, self.rss_names, start, end, warm)
        # socket files left by a daemon that died unclean (live ones belong to others: a test run alongside)
        sockets = stale_sockets(set(glob.glob("/tmp/hivemind-*")) - self.sockets_before)
        return {"minutes": round((end - start) / 60, 2), "interrupted": self.interrupted, "setup": self.args.setup,
                "delay_updates": self.args.delay_updates, "seed": self.args.seed,
                "trainers": len(self.trainers), "target": self.args.target, "steps": steps,
                "lost_steps": len(disagreed) + len(crashes) + len(self.crashed), "disagreed_steps": disagreed[:50],
                "final_step_agrees": steps not in disagreed, "applied_backwards": backwards[:20],
                "disagreement": versions, "first_disagreed_s": round(first_at[disagreed[0]] - start, 1) if disagreed else None,
                "crashes": (crashes + self.crashed)[:20],
                "skipped_steps": sorted({e["step"] for e in events if e["e"] == "round" and e["skipped"]}),
                "longest_stall_s": round(stall_to - stall_from, 1),
                "longest_stall": {"after_step": stall_step, "from_s": round(stall_from - start, 1),
                                  "to_s": round(stall_to - start, 1)},
                "first_step_s": round(steps_at[0][1] - start, 1) if steps_at else None,
                "max_param_diff": max_diff, **replay,
                "batch_min": min((e["batch"] for e in rounds), default=0),
                "batch_max": max((e["batch"] for e in rounds), default=0),
                "rss_growth": round(growth, 3), "rss_growth_of": grew,
                "rss_peak_growth": round(peak, 3), "rss_peak_of": peaked, "orphans": {"processes": sessions_alive(self.sessions),
                                                             "sockets": sockets},
                "failures_injected": dict(sorted(self.injected.items())), "workdir": self.dir, "started_at": start,
                **({"partitions": partitions, "island_adopted": adopted} if self.args.partition else {})}

    def replay(self, events: list[dict], peer_of: dict, canonical: dict[int, torch.Tensor], steps: int,
               dtype: torch.dtype = torch.float32) -> tuple[dict, dict[int, torch.Tensor]]:
        """Replay every step in one process from the logged contributions, in ``dtype``; compare with
        the peers'. Returns the comparison and the replayed parameters of every step."""
        x, y = (t.to(dtype) for t in model_code.data())
        model = model_code.make_model().to(dtype)
        opt, sched = model_code.make_opt(model)
        scratch = model_code.make_model().to(dtype)
        params = list(model.parameters())
        versions = {0: torch.nn.utils.parameters_to_vector(params).detach().clone()}
        rounds: dict[int, dict] = {}
        for e in events:
            if e["e"] == "round" and e["step"] not in rounds:
                rounds[e["step"]] = e
        contribs: dict[tuple[str, int], list[dict]] = {}
        for e in events:
            if e["e"] == "contrib":
                contribs.setdefault((peer_of.get((e["trainer"], e["inc"]), "?"), e["step"]), []).append(e)
        worst, replayed, mismatched = 0.0, 0, []
        for s in range(steps):
            r = rounds.get(s)
            if r is None:
                return {"replay_steps": replayed, "replay_max_diff": worst, "replay_gap_at": s,
                        "batch_mismatch_steps": mismatched}, versions
            if not r["skipped"]:
                grad = [torch.zeros_like(p) for p in params]
                total = 0
                for peer in r["contributors"]:
                    before = [c for c in contribs.get((peer, s), []) if c["t"] <= r["t"]]
                    if not before:
                        continue
                    for ids, applied in before[-1]["mbs"]:
                        torch.nn.utils.vector_to_parameters(versions[applied], scratch.parameters())
                        scratch.zero_grad()
                        idx = torch.tensor(ids)
                        torch.nn.functional.mse_loss(scratch(x[idx]), y[idx]).backward()
                        for g, p in zip(grad, scratch.parameters()):
                            g.add_(p.grad, alpha=len(ids))
                        total += len(ids)
                if total != round(r["batch"]):
                    mismatched.append(s)
                for p, g in zip(params, grad):
                    p.grad = g / max(total, 1)
                opt.step()
                sched.step()
            versions[s + 1] = torch.nn.utils.parameters_to_vector(params).detach().clone()
            if s + 1 in canonical:
                worst = max(worst, float((versions[s + 1].double() - canonical[s + 1].double()).abs().max()))
            replayed += 1
        return {"replay_steps": replayed, "replay_max_diff": worst, "replay_gap_at": None,
                "batch_mismatch_steps": mismatched}, versions


def log_digest(workdir: str, start: float, from_s: float, to_s: float, limit: int = 60) -> str:
    """The log lines (``HH:MM:SS LEVEL ...``: the peers' and the soak's own faults, ``chaos.log``) from 5 s
    before ``from_s`` to a second after ``to_s`` (seconds after ``start``): what a failed soak was doing
    during its longest stall. At most ``limit`` lines, faults, warnings and errors first, each prefixed
    with its log's name (the routine "averaged with" lines last)."""
    lo, hi = (time.strftime("%H:%M:%S", time.localtime(start + s)) for s in (from_s - 5, to_s + 1))
    lines = []
    for path in sorted(glob.glob(os.path.join(workdir, "*.log"))):
        name = os.path.basename(path)[:-4]
        with open(path, errors="replace") as f:
            for line in f:
                stamp = line[:8]
                if len(stamp) == 8 and stamp[2] == stamp[5] == ":" and \
                        (lo <= stamp <= hi if lo <= hi else (stamp >= lo or stamp <= hi)):  # past midnight
                    lines.append((stamp, name, line.rstrip()[:300]))
    lines.sort()
    def rank(x: tuple) -> int:  # faults, warnings and errors; then events; the rounds that went as usual last
        return 0 if x[1] == "chaos" or " WARN" in x[2] or " ERROR " in x[2] else 2 if " averaged with " in x[2] else 1
    shown = sorted(sorted(lines, key=rank)[:limit])
    return "\n".join(f"{name}: {line}" for _, name, line in shown) + \
        (f"\n... and {len(lines) - len(shown)} more lines" if len(lines) > len(shown) else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainers", type=int, default=5, help="trainers at the start (the first in client mode)")
    parser.add_argument("--max-new", type=int, default=3, help="how many never-seen peers may join")
    parser.add_argument("--delay-updates", action="store_true")
    parser.add_argument("--setup", choices=("readme", "two-bootstraps"), default="readme",
                        help="how the peers are deployed (see above)")
    parser.add_argument("--target", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--mb-seconds", type=float, default=0.15, help="the fastest trainer's time per micro-batch")
    parser.add_argument("--fault-every", type=float, default=15.0)
    parser.add_argument("--backbone-every", type=float, default=300.0)
    parser.add_argument("--partition", action="store_true",
                        help="each peer in a network namespace; the trainers split in two now and then (see above)")
    parser.add_argument("--partition-every", type=float, default=240.0, help="seconds between partitions")
    parser.add_argument("--split-s", type=float, default=60.0, help="how long each partition lasts")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--workdir", default=None, help="logs and checkpoints (default: a new temporary folder)")
    args = parser.parse_args()
    if args.partition and not (ok := netem.available())[0]:
        parser.error(f"--partition: {ok[1]}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="dedloc-chaos-")
    os.makedirs(workdir, exist_ok=True)
    soak = Soak(args, workdir)

    def stop(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(json.dumps(soak.run()), flush=True)


if __name__ == "__main__":
    main()
