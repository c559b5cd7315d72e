"""The optimizer's peer seam (dedloc/optim/port.py): one scenario against the real peer and the
in-process fake, and the optimizer's shell on the fake (no network, a second or less each)."""

import threading

import pytest
import torch

from dedloc.config import OptimizerConfig
from dedloc.optim import CollaborativeOptimizer, StepOutcome
from dedloc.optim.step_rules import Mode
from dedloc.testing.fake_peer import FakeRun

from conftest import run_id
from test_optimizer import Trainer, join_all, make_model, make_opt, replay, start, together


@pytest.fixture
def fake_run():
    run = FakeRun()
    yield run
    run.close()


def _exact(trainers, steps):
    """Identical parameters after every step the trainers share, equal to a single process trained
    on exactly the samples they logged."""
    for s in range(steps + 1):
        have = [t.params[s] for t in trainers if s in t.params]
        assert len(have) >= 1, f"no trainer holds step {s}"
        for other in have[1:]:
            assert torch.equal(have[0], other), f"peers differ after step {s}"
    _, params = replay([t.log for t in trainers], steps, clip=0.0)
    final = trainers[0].params[steps]
    assert torch.allclose(final, params, atol=1e-5, rtol=1e-5), (final - params).abs().max()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["fake", "real"])
def test_peer_port_conformance_two_trainers_take_exact_large_batch_steps(kind, fake_run):
    """The same two-trainer run, over real peers (daemons, DHT, rounds) and over the fake: both give
    identical parameters equal to a single-process replay."""
    torch.set_num_threads(1)
    steps, cfg = 3, OptimizerConfig(target_batch_size=32)
    if kind == "fake":
        peers = [fake_run.peer(), fake_run.peer()]
    else:
        peers = start(2, run_id())
    try:
        gate = together(2)
        trainers = [Trainer(i, p, cfg, micro=m, delay=0.005, steps=steps, gate=gate)
                    for i, (p, m) in enumerate(zip(peers, (5, 8)))]
        for t in trainers:
            t.start()
        join_all(trainers)
    finally:
        if kind == "real":
            for p in peers:
                p.close()
    _exact(trainers, steps)
    assert all(t.opt.mode is Mode.ACCUMULATING for t in trainers)


def test_a_round_failing_for_every_member_keeps_their_state_without_a_network(fake_run):
    """Synchronous mode: the round of step 1 fails for all; each member drops its gradients, finds
    it already holds the collaboration's state (nobody took step 1), downloads nothing, and step 1
    is taken by the next round."""
    torch.set_num_threads(1)
    fake_run.fail(1)
    cfg = OptimizerConfig(target_batch_size=32)
    gate = together(2)
    trainers = [Trainer(i, fake_run.peer(), cfg, micro=m, steps=3, gate=gate) for i, m in enumerate((5, 8))]
    for t in trainers:
        t.start()
    join_all(trainers)
    for t in trainers:
        assert t.opt.resyncs == 0, "it downloaded a state although it held the collaboration's"
        assert [r.step for r in t.opt.history] == [0, 1, 2]
    _exact(trainers, 3)


def test_a_newcomer_downloads_the_state_from_a_member_and_trains_with_it(fake_run):
    """A newcomer arriving while the run is at step 2 or later resyncs (downloads the state from the
    trainer, at once or after the first round it missed), then contributes to the steps it shares
    with it: identical parameters."""
    torch.set_num_threads(1)
    cfg = OptimizerConfig(target_batch_size=32)
    reached = threading.Event()
    first = Trainer(0, fake_run.peer(), cfg, micro=8, delay=0.02, steps=8,
                    on_step=lambda s: reached.set() if s >= 2 else None)
    first.start()
    assert reached.wait(60), "the first trainer did not reach step 2"
    late = Trainer(1, fake_run.peer(), cfg, micro=8, steps=8)
    late.start()
    join_all((first, late))
    assert late.opt.resyncs >= 1 and max(late.params) == 8
    assert any(r.local_samples > 0 and r.group_size == 2 for r in late.opt.history), "it never trained with the other"
    for s in set(first.params) & set(late.params):
        assert torch.equal(first.params[s], late.params[s]), f"peers differ after step {s}"


def test_delayed_updates_catch_up_when_a_round_closed_without_the_peer(fake_run):
    """Delayed updates: a member whose round of step 0 closed without it (the other member took the
    step alone) catches up: it downloads the state of step 1 in the background and keeps the
    gradients it computed meanwhile, instead of dropping them in a resync."""
    torch.set_num_threads(1)
    cfg = OptimizerConfig(target_batch_size=16, delay_updates=True)
    x = torch.randn(16, 8)
    models = [make_model(), make_model()]
    opts = [make_opt(m)[0] for m in models]
    late = CollaborativeOptimizer(opts[0], fake_run.peer(), cfg, model=models[0])
    helper = CollaborativeOptimizer(opts[1], fake_run.peer(), cfg, model=models[1])
    models[1](x).pow(2).mean().backward()
    assert helper.step(16) == StepOutcome.STEPPED
    helper.offer_state()  # its round of step 0 (alone, after the gather window) lands: it serves step 1
    helper.report()  # and publishes that it holds it
    assert helper.applied_step == 1
    models[0](x).pow(2).mean().backward()
    assert late.step(16) == StepOutcome.STEPPED  # its round of step 0 is under way (it will miss it)
    assert late.mode is Mode.IN_FLIGHT
    models[0](x).pow(2).mean().backward()
    late.step(16)  # the missed round is over: it catches up on step 1; these 16 samples go to step 1's round
    assert late.catchups == 1 and late.resyncs == 0
    late.offer_state()  # lands the round of step 1 on top of the downloaded state of step 1
    assert late.applied_step == 2 and late.resyncs == 0
    assert [(r.step, r.local_samples) for r in late.history] == [(1, 16)], "its gradients were dropped"
