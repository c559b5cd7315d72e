"""Islands: a run deployed as the README says (one bootstrap address, the backbone's) must keep one
history when that backbone restarts behind the run (docs/optimizer.md, "Islands")."""

import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch

from dedloc.config import BackboneConfig, OptimizerConfig, PeerConfig
from dedloc.errors import BootstrapError
from dedloc.peer import Peer
from dedloc.records import Role
from dedloc.roles.backbone import Backbone
from dedloc.state import snapshot
from dedloc.state.checkpoint import CheckpointStore
from dedloc.state.run_memory import RunMemory
from dedloc.testing.procs import session_pids, sessions_alive, spawn_cli

from conftest import run_id, wait_for
from test_optimizer import AVG, Trainer, join_all


def test_run_memory_keeps_the_newest_step_and_the_members_addresses(tmp_path, caplog):
    memory = RunMemory().saw("5:aa").saw("3:bb").saw("garbage")
    assert memory.newest == "5:aa" and memory.newest_step == 5
    connections = {"A": ["/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit"], "X": ["/ip4/9.9.9.9/tcp/9"]}
    memory = memory.with_peers(connections, members={"A", "B"})
    assert memory.peers == ("/ip4/1.2.3.4/tcp/1/p2p/A",)  # X is no member; a relayed address is no way back
    memory = memory.with_peers({"B": ["/ip4/5.6.7.8/tcp/2"]}, members={"B"})
    assert memory.peers == ("/ip4/5.6.7.8/tcp/2/p2p/B", "/ip4/1.2.3.4/tcp/1/p2p/A")  # A is kept while away
    assert memory.with_peers({}, members={"A"}) is memory
    path = tmp_path / "run.json"
    memory.save(path)
    assert RunMemory.load(path) == memory
    path.write_text('{"newest": "not a fingerprint", "peers": []}')
    assert RunMemory.load(path) == RunMemory() and "ignoring the run memory" in caplog.text
    assert RunMemory.load(tmp_path / "absent.json") == RunMemory()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Backbone:
    """``dedloc backbone`` as a deployment runs it: a fixed address, a checkpoint directory, an
    identity, and no initial peers; restarted with the very same command line."""

    def __init__(self, tmp_path, rid: str, *extra: str):
        self.argv = ["backbone", "--run-id", rid, "--identity-path", str(tmp_path / "backbone.key"),
                     "--checkpoint-dir", str(tmp_path / "ckpt"), "--host-maddrs",
                     f"/ip4/127.0.0.1/tcp/{_free_port()}", *extra]
        self.log = open(tmp_path / "backbone.log", "a")
        self.sessions: set[int] = set()
        self.proc: subprocess.Popen | None = None
        self.maddrs: list[str] = []

    def start(self, deadline_s: float = 60) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:  # a killed one's daemon may hold the port a moment longer
            self.proc = spawn_cli(*self.argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
            self.sessions.add(self.proc.pid)
            for line in self.proc.stdout:
                if "--initial-peers" in line:
                    self.maddrs = line.split("--initial-peers", 1)[1].split()
                    self.sessions.update(s for s in _runtime_sessions(self.proc.pid))
                    return
            self.proc.wait()
        raise AssertionError("the backbone did not start (see backbone.log)")

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        deadline = time.monotonic() + 15
        while sessions_alive(self.sessions) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.log.close()


def _runtime_sessions(pid: int) -> list[int]:
    from dedloc.testing.procs import children
    return children(pid)


def _freeze(peer: Peer, sig: int) -> None:
    """Stop (or continue) a whole in-process peer's network side: its runtime and its daemon."""
    for pid in session_pids(peer.runtime.pid):
        os.kill(pid, sig)


@pytest.mark.alone
@pytest.mark.timeout(300)
def test_a_newcomer_joining_through_a_backbone_restarted_behind_the_run_takes_none_of_its_steps_again(tmp_path):
    """The 10-minute deployment soak of issue 37: the backbone came back from its checkpoint of step
    117 while the run was at 118; a trainer restarted then bootstrapped through it, joined step 117
    and took steps 118-125 alone while the others took them together."""
    torch.set_num_threads(1)
    rid = run_id()
    backbone = _Backbone(tmp_path, rid, "--checkpoint-interval", "2", "--progress-ttl", "10")
    peers: list[Peer] = []
    trainers: list[Trainer] = []
    frozen: list[Peer] = []
    cfg = OptimizerConfig(target_batch_size=48, state_timeout=120)
    try:
        backbone.start()
        store = CheckpointStore(tmp_path / "ckpt")
        peers = [Peer(PeerConfig(run_id=rid, initial_peers=tuple(backbone.maddrs), progress_ttl=10), AVG)
                 for _ in range(2)]
        trainers = [Trainer(i, p, cfg, micro=6, delay=0.04, steps=10_000) for i, p in enumerate(peers)]
        for t in trainers:
            t.start()
        # the backbone has a checkpoint, and remembers a newer step than it (it pulls every 2 s)
        # (a checkpoint past step 0: the backbone has seen the trainers since it started)
        wait_for("the run two steps past the backbone's checkpoint", lambda: store.steps() and store.steps()[0] >= 1
                  and min(max(t.params, default=0) for t in trainers) >= store.steps()[0] + 2, 90)
        checkpoint = store.steps()[0]
        frozen = list(peers)  # the run's peers are out of reach while the backbone restarts
        for p in frozen:
            _freeze(p, signal.SIGSTOP)
        backbone.kill9()
        backbone.start()
        newcomer = Peer(PeerConfig(run_id=rid, initial_peers=tuple(backbone.maddrs), progress_ttl=10), AVG)
        peers.append(newcomer)
        late = Trainer(2, newcomer, cfg, micro=6, delay=0.04, steps=10_000)
        trainers.append(late)
        late.start()
        # an island would take a step now: one peer, its history begun at the backbone's checkpoint
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(s > checkpoint + 1 for s in late.params):
            time.sleep(0.1)
        for p in frozen:
            _freeze(p, signal.SIGCONT)
        frozen = []
        newest = max(max(t.params) for t in trainers[:2])
        last = newest + 6
        for t in trainers:
            t.steps = last
        join_all(trainers, timeout=180)
    finally:
        for p in frozen:
            _freeze(p, signal.SIGCONT)
        for t in trainers:
            t.steps = 0
        for p in peers:
            p.close()
        backbone.close()
    joined = min(late.params)
    assert joined > checkpoint, f"the newcomer joined the backbone's stale checkpoint of step {checkpoint}"
    # every step it holds, it holds as the run took it (the last one aside: a peer still a step behind
    # when the others stop at it may take it after they left; docs/optimizer.md, "Known gaps")
    for step, params in late.params.items():
        for t in trainers[:2]:
            if step in t.params and step < last:
                assert torch.equal(params, t.params[step]), f"step {step}: the newcomer's history is another ({sorted(late.params)}, {[sorted(t.params) for t in trainers[:2]]})"
    assert late.opt.resyncs >= 1 and max(late.params) == last
    saved = [s for s in store.steps() if s in trainers[0].params]
    for s in saved:  # the backbone checkpointed only the run's history
        state = snapshot.decode(store.path(s).read_bytes())
        flat = torch.cat([v.reshape(-1) for v in state["model"].values()])
        assert torch.equal(flat, trainers[0].params[s]), f"the checkpoint of step {s} is not the run's"
    log = (tmp_path / "backbone.log").read_text()
    assert re.search(r"reconnected to \d+ of the run's 2 remembered peers", log), log[-3000:]
    assert re.search(r"restarted with the checkpoint of step \d+ while the run was live at step \d+ or later: looking for the run", log), log[-3000:]


@pytest.mark.timeout(180)
def test_a_peer_started_while_its_only_bootstrap_reboots_joins_once_it_is_back(tmp_path, caplog):
    rid = run_id()
    backbone = _Backbone(tmp_path, rid)
    joined: list[Peer] = []
    errors: list[BaseException] = []
    try:
        backbone.start()
        backbone.kill9()

        def join():
            try:
                joined.append(Peer(PeerConfig(run_id=rid, initial_peers=tuple(backbone.maddrs), join_timeout=120)))
            except BaseException as e:  # surfaced below
                errors.append(e)

        with pytest.raises(BootstrapError, match="could not join"):
            Peer(PeerConfig(run_id=rid, initial_peers=tuple(backbone.maddrs), join_timeout=0))
        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        wait_for("the joiner to say it waits", lambda: "none of the initial peers answers" in caplog.text, 60)
        assert joiner.is_alive() and not joined
        backbone.start()
        joiner.join(120)
        assert not errors and joined, errors
        assert any(r.role == Role.BACKBONE for r in joined[0].collaboration().peers)
    finally:
        for p in joined:
            p.close()
        backbone.close()


@pytest.mark.timeout(240)
def test_a_peer_one_step_behind_a_backbones_checkpoint_downloads_it_after_the_others_left(tmp_path):
    """In the newcomer test's first version, the trainers took step 9 and left; the newcomer, still
    at step 9 and alone, took it again: the run already had, and the backbone held its result."""
    torch.set_num_threads(1)
    rid = run_id()
    backbone = Backbone(PeerConfig(run_id=rid), BackboneConfig(checkpoint_dir=str(tmp_path), checkpoint_interval=0.3),
                        AVG)
    release = threading.Event()
    pulling = backbone.in_background()
    peers: list[Peer] = []
    held_at = 3

    def hold(opt):  # B stops before its first micro-batch of step 3, until A has left
        if opt.global_step == held_at:
            release.wait(120)

    try:
        peers = [Peer(PeerConfig(run_id=rid, initial_peers=tuple(backbone.maddrs)), AVG) for _ in range(2)]
        cfg = OptimizerConfig(target_batch_size=48)
        a = Trainer(0, peers[0], cfg, micro=6, delay=0.02, steps=held_at + 1)
        b = Trainer(1, peers[1], cfg, micro=6, delay=0.02, steps=held_at + 3, gate=hold)
        a.start()
        b.start()
        join_all([a], timeout=120)  # A took step 3 alone and left; its hand-on waited for the backbone
        wait_for("the backbone to hold step 4", lambda: backbone.step >= held_at + 1, 30)
        # past the deadline of A's round, its closed record closes step 3 no more (A left: nobody who
        # holds the update publishes it; averaging.md rule 11): only the backbone's step says it was taken
        wait_for("the deadline of A's round of step 3", lambda: time.time() > (peers[1].round_deadline(held_at) or 0), 90,
                 every=0.5)
        release.set()
        join_all([b], timeout=120)
    finally:
        release.set()
        pulling.stop()
        for p in peers:
            p.close()
        backbone.close()
    assert torch.equal(b.params[held_at + 1], a.params[held_at + 1]), "B took step 3 again, alone"
    assert b.opt.resyncs >= 1  # the step it was behind
