"""A malicious *invited* member, speaking the real protocol (docs/security.md, "What a member can
do"): each test is one attack that worked at b122246, with honest peers unaffected after."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch

from conftest import run_id
from dedloc.auth.invitation import RunOwner
from dedloc.config import BackboneConfig, OptimizerConfig
from dedloc.optim.optimizer import CollaborativeOptimizer
from dedloc.peer import Peer
from dedloc.records import Role
from dedloc.roles.backbone import Backbone
from dedloc.state import lineage
from test_membership import member
from test_optimizer import AVG, Trainer, flat, join_all, make_model, make_opt

EVIL = 0.777


class Usurper(threading.Thread):
    """An invited member that joins like anyone (its optimizer downloads the run's state), then
    rewrites its parameters (every weight ``EVIL``) and its step (``ahead`` steps past the run's),
    and keeps publishing that progress and serving that state, as its real optimizer does.
    ``role``: the role it claims in its records (e.g. a backbone's, whose checkpoint step counted)."""

    def __init__(self, peer: Peer, cfg: OptimizerConfig, ahead: int = 1000, role: Role | None = None):
        super().__init__(daemon=True)
        self.peer, self.cfg, self.ahead, self.role = peer, cfg, ahead, role
        self.publishing, self.stop = threading.Event(), threading.Event()
        self.step = -1
        self.error: BaseException | None = None

    def run(self):
        try:
            model = make_model()
            opt, _ = make_opt(model)
            copt = CollaborativeOptimizer(opt, self.peer, self.cfg, model=model)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(EVIL)
            copt.global_step = copt.applied_step = self.step = copt.global_step + self.ahead
            copt._fingerprint = copt._hash()
            copt._lineage = lineage.extend({}, copt._fingerprint)
            if self.role is not None:
                record = copt._record
                copt._record = lambda busy: dataclasses.replace(record(busy), role=self.role)
            copt.offer_state()
            copt._report(busy=False)
            self.publishing.set()
            while not self.stop.wait(0.3):
                copt._report(busy=False)  # serves its state to whoever asks (the "wanted" flag)
        except BaseException as e:  # surfaced by the test
            self.error = e
            self.publishing.set()


def evil_model() -> torch.Tensor:
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(EVIL)
    return flat(model)


@pytest.mark.timeout(300)
def test_a_member_publishing_step_plus_1000_with_its_own_weights_is_adopted_by_nobody(tmp_path, caplog, capfd):
    """At b122246 both honest trainers loaded such a state within a second and the backbone
    checkpointed it; so did a newcomer. Here one usurper publishes as a trainer, another claims a
    backbone's role without a backbone's invitation."""
    torch.set_num_threads(1)
    owner = RunOwner.init(str(tmp_path / "run"), run_id())
    backbone = Backbone(member(owner, tmp_path, "backbone", backbone=True),
                        BackboneConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=0.3), AVG)
    stop = threading.Event()
    pulling = threading.Thread(target=backbone.run, args=(stop,), daemon=True)
    pulling.start()
    joined = dict(initial_peers=tuple(backbone.maddrs))
    peers: list[Peer] = []
    usurpers: list[Usurper] = []
    attacking = threading.Event()
    steps, attack_at = 9, 3
    cfg = OptimizerConfig(target_batch_size=48)

    held: set[int] = set()

    def hold(opt):  # the honest trainers go on once both usurpers publish their far step
        if opt.global_step == attack_at:
            held.add(id(opt))
            attacking.wait(120)

    try:
        peers = [Peer(member(owner, tmp_path, f"honest{i}", **joined), AVG) for i in range(2)]
        honest = [Trainer(i, p, cfg, micro=6, delay=0.02, steps=steps, gate=hold) for i, p in enumerate(peers)]
        for t in honest:
            t.start()
        pause = threading.Event()
        while len(held) < 2 and not pause.wait(0.1):
            assert all(t.is_alive() for t in honest), "an honest trainer ended early"
        for name, role in (("usurper", None), ("fake-backbone", Role.BACKBONE)):
            peers.append(Peer(member(owner, tmp_path, name, **joined), AVG))
            usurpers.append(Usurper(peers[-1], cfg, role=role))
            usurpers[-1].start()
        for u in usurpers:
            assert u.publishing.wait(120) and u.error is None, f"the usurper failed: {u.error!r}"
        attacking.set()
        peers.append(Peer(member(owner, tmp_path, "newcomer", **joined), AVG))
        newcomer = Trainer(2, peers[-1], cfg, micro=6, delay=0.02, steps=steps)
        newcomer.start()
        join_all(honest + [newcomer], timeout=200)
    finally:
        attacking.set()
        for u in usurpers:
            u.stop.set()
            u.join(30)
        stop.set()
        pulling.join(30)
        for p in peers:
            p.close()
        backbone.close()
    evil = evil_model()
    for t in honest + [newcomer]:
        assert max(t.params) == steps, f"trainer {t.index} jumped to step {max(t.params)}"
        assert not any(torch.equal(v, evil) for v in t.params.values()), f"trainer {t.index} loaded the usurper's weights"
        assert torch.equal(t.params[steps], honest[0].params[steps])
    assert backbone.step <= steps and all(s <= steps for s in backbone.store.steps())
    names = {u.peer.peer_id for u in usurpers}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(usurpers[0].peer.peer_id in w and "attests" in w for w in warned), warned
    assert f"peer {usurpers[1].peer.peer_id} publishes a backbone's record" in capfd.readouterr().err
    assert names  # both attacks ran
