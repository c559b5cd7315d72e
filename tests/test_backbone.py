"""Backbone peers: atomic checkpoints, and a whole collaboration stopped and resumed from one."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from dedloc.config import BackboneConfig, OptimizerConfig, PeerConfig
from dedloc.peer import Peer
from dedloc.roles.backbone import Backbone
from dedloc.state import snapshot
from dedloc.state.checkpoint import CheckpointStore

from conftest import run_id
from test_optimizer import AVG, Trainer, join_all


def test_checkpoints_keep_the_newest_and_skip_torn_files(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    for step in range(1, 6):
        store.write(step, snapshot.encode({"step": step, "w": torch.full((4,), float(step))}))
    assert store.steps() == [5, 4, 3]
    good = store.path(5).read_bytes()
    store.path(6).write_bytes(good[: len(good) // 2])  # a torn file under a final name
    (tmp_path / ".state-x.tmp").write_bytes(b"partial")
    step, blob = CheckpointStore(tmp_path, keep=3).latest()
    assert step == 5 and torch.equal(snapshot.decode(blob)["w"], torch.full((4,), 5.0))
    assert "skipping unreadable checkpoint" in caplog.text
    assert not (tmp_path / ".state-x.tmp").exists()


WRITER = """
import sys, torch
from dedloc.state import snapshot
from dedloc.state.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1], keep=2)
big = torch.randn(4 << 20)
step = 0
while True:
    step += 1
    store.write(step, snapshot.encode({"step": step, "w": big}))
    print(step, flush=True)
"""


def test_a_killed_writer_leaves_only_whole_checkpoints(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # let it write a few 16 MB checkpoints, then kill it mid-write
            assert proc.stdout.readline(), "the writer died"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    names = os.listdir(tmp_path)
    store = CheckpointStore(tmp_path, keep=2)
    assert store.steps(), names
    for step in store.steps():
        assert snapshot.peek_step(store.path(step).read_bytes()) == step
    assert store.latest()[0] == store.steps()[0]


@pytest.mark.timeout(240)
def test_collaboration_stops_and_resumes_from_a_backbone_checkpoint(tmp_path):
    torch.set_num_threads(1)
    rid = run_id()
    cfg = OptimizerConfig(target_batch_size=64)
    bcfg = BackboneConfig(checkpoint_dir=str(tmp_path), checkpoint_interval=0.2, keep_checkpoints=2)
    backbone = Backbone(PeerConfig(run_id=rid), bcfg, AVG)
    pulling = backbone.in_background()
    first = []
    try:
        first = [Peer(PeerConfig(run_id=rid, initial_peers=tuple(backbone.maddrs)), AVG) for _ in range(2)]
        trainers = [Trainer(i, p, cfg, micro=5 + 3 * i, delay=0.03, steps=10) for i, p in enumerate(first)]
        for t in trainers:
            t.start()
        join_all(trainers, timeout=120)
    finally:
        pulling.stop()
        for p in first:
            p.close()
        backbone.close()
    saved = CheckpointStore(tmp_path).latest()
    assert saved is not None and saved[0] >= 1, "the backbone wrote no checkpoint during training"
    step = saved[0]

    # everything stopped; a new backbone resumes from the directory, and new trainers join it
    backbone = Backbone(PeerConfig(run_id=rid), bcfg, AVG)
    second = []
    try:
        assert backbone.step == step
        second = [Peer(PeerConfig(run_id=rid, initial_peers=tuple(backbone.maddrs), client_mode=(i == 1)), AVG)
                  for i in range(2)]
        trainers2 = [Trainer(10 + i, p, cfg, micro=6, delay=0.01, steps=step + 2) for i, p in enumerate(second)]
        for t in trainers2:
            t.start()
        join_all(trainers2, timeout=120)
    finally:
        for p in second:
            p.close()
        backbone.close()
    # each joins at the checkpoint's step, or the next if the other took that one first; one that joined at
    # the checkpoint's step while the other was taking it alone (its download still under way) misses it and
    # downloads the next: a second resync, and no step taken twice
    for t in trainers2:
        assert min(t.params) in (step, step + 1), sorted(t.params)
        assert t.opt.resyncs == 1 or (t.opt.resyncs == 2 and all(r.step != step for r in t.opt.history)), \
            (t.opt.resyncs, sorted(t.params))
        assert max(t.params) == step + 2
    resumed = [t for t in trainers2 if min(t.params) == step]
    assert resumed, "no trainer started from the checkpoint's step"
    for t in resumed:
        assert torch.equal(t.params[step], trainers[0].params[step]), "resumed parameters differ from the saved"
    assert torch.equal(trainers2[0].params[step + 2], trainers2[1].params[step + 2])
