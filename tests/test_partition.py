"""A partition: a running collaboration, deployed as the README says (one backbone, every trainer
bootstrapping from it), split into two halves for most of a minute and healed. The side the
history keeps (docs/optimizer.md, "Partitions") is the one with more trainers; the other side's
steps are discarded, never adopted: no peer of the larger side ever holds a state of the smaller
side's, the backbone never checkpoints one, and after the heal every peer holds one history."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dedloc.state import snapshot
from dedloc.state.checkpoint import CheckpointStore
from dedloc.testing import netem
from dedloc.testing.procs import cli_command, sessions_alive

from conftest import run_id, wait_for

ok, why = netem.available()
pytestmark = [pytest.mark.skipif(not ok, reason=why), pytest.mark.xdist_group("network"), pytest.mark.netns]
TRAINER = os.path.join(os.path.dirname(__file__), "..", "bench", "chaos_trainer.py")
SPLIT_S = 45.0


def _events(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
    except FileNotFoundError:
        pass
    return out


def _applied(path: str) -> dict[int, torch.Tensor]:
    """A trainer's newest parameters at each applied step."""
    return {e["applied"]: torch.tensor(e["params"]) for e in _events(path) if e["e"] == "applied"}


@pytest.mark.alone
@pytest.mark.timeout(420)
def test_a_partition_keeps_the_larger_sides_history_and_heals_into_one(tmp_path):
    rid = run_id()
    # namespaces of the trainers (the backbone is in namespace 0); the smaller side is the faster, so
    # it is ahead when the halves meet: the history kept is the one more trainers hold, not the longer
    larger, smaller = [1, 2, 3], [4, 5]
    procs: list[subprocess.Popen] = []
    net = netem.Network([netem.Link()] * 6)
    logs = []
    try:
        log = open(tmp_path / "backbone.log", "w")
        logs.append(log)
        backbone = subprocess.Popen(net.exec_args(0) + cli_command(
            "backbone", "--run-id", rid, "--identity-path", str(tmp_path / "backbone.key"), "--checkpoint-dir",
            str(tmp_path / "ckpt"), "--host-maddrs", f"/ip4/{net.ip(0)}/tcp/31337", "--checkpoint-interval", "5"),
            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        procs.append(backbone)
        maddrs = None
        for line in backbone.stdout:
            if "--initial-peers" in line:
                maddrs = line.split("--initial-peers", 1)[1].split()
                break
        assert maddrs, "the backbone did not start"
        events = {i: str(tmp_path / f"trainer{i}.jsonl") for i in larger + smaller}
        for i in larger + smaller:
            spec = {"index": i, "incarnation": 0, "run_id": rid, "client": False, "initial_peers": maddrs,
                    "identity": str(tmp_path / f"trainer{i}.key"), "events": events[i], "target": 64, "micro": 8,
                    "mb_seconds": 0.15 if i in larger else 0.05, "delay_updates": False, "log_level": "INFO"}
            log = open(tmp_path / f"trainer{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(net.exec_args(i) + [sys.executable, TRAINER, json.dumps(spec)],
                                          stdout=log, stderr=log, start_new_session=True))
        wait_for("every trainer to take 3 steps", lambda: all(max(_applied(events[i]), default=0) >= 3
                                                              for i in events), 180, every=0.5)
        net.split(smaller)
        split_at = max(max(_applied(events[i])) for i in events)
        wait_for("the larger side to go on", lambda: max(_applied(events[larger[0]])) >= split_at + 3, 60, every=0.5)
        time.sleep(max(0.0, SPLIT_S - 10))  # the scenario: most of a minute apart
        net.heal()
        healed_at = max(max(_applied(events[i])) for i in events)
        wait_for("one history on every trainer after the heal", lambda: _one_history(events, healed_at + 3), 180, every=0.5)
    finally:
        for p in procs[1:] + procs[:1]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if p is not procs[0] else signal.SIGINT)
        for p in procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
        net.close()
        for log in logs:
            log.close()
    sessions = {p.pid for p in procs} | {e["runtime_pid"] for path in events.values() for e in _events(path)
                                         if e["e"] == "start"}
    assert not sessions_alive(sessions)

    # the larger side's history: never two parameter sets at one step, on any of its trainers, ever
    history: dict[int, torch.Tensor] = {}
    for i in larger:
        for e in _events(events[i]):
            if e["e"] != "applied":
                continue
            params = torch.tensor(e["params"])
            kept = history.setdefault(e["applied"], params)
            assert torch.equal(kept, params), f"trainer {i} held another state of step {e['applied']} ({e['via']})"
    # the smaller side took steps of its own while apart, and gave them up for the larger side's
    forked = [s for i in smaller for s, p in _applied_all(events[i]) if s in history and not torch.equal(p, history[s])]
    assert forked, "the smaller side took no step while apart: the partition tested nothing"
    for i in smaller:
        final, params = _applied_all(events[i])[-1]
        assert final in history and torch.equal(params, history[final]), f"trainer {i} did not rejoin the history"
    # the backbone (on the larger side) checkpointed only that history
    store = CheckpointStore(tmp_path / "ckpt")
    for s in store.steps():
        state = snapshot.decode(store.path(s).read_bytes())
        flat = torch.cat([v.reshape(-1) for v in state["model"].values()])
        assert s in history and torch.equal(flat, history[s]), f"the checkpoint of step {s} is not the history's"


def _applied_all(path: str) -> list[tuple[int, torch.Tensor]]:
    return [(e["applied"], torch.tensor(e["params"])) for e in _events(path) if e["e"] == "applied"]


def _one_history(events: dict[int, str], at_least: int) -> bool:
    """Every trainer holds the same parameters at a common step >= ``at_least``."""
    applied = [_applied(path) for path in events.values()]
    common = set.intersection(*(set(a) for a in applied))
    return any(s >= at_least and all(torch.equal(a[s], applied[0][s]) for a in applied[1:]) for s in common)
