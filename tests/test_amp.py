"""Mixed precision: each peer's loss scale follows its own overflows; an overflow on one peer leaves
its samples out of the step and skips nothing; no member can make a step be skipped."""

import threading

import pytest
import torch

from dedloc.config import OptimizerConfig
from dedloc.optim import CollaborativeOptimizer, StepOutcome

from conftest import run_id
from test_optimizer import data, flat, make_model, start

OVERFLOW_STEP = 2


def train(peer, index, steps, poison, out, device="cpu", flags=False):
    try:
        x, y = (t.to(device) for t in data())
        model = make_model().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=3)
        dtype = torch.float16 if device == "cuda" else torch.bfloat16
        copt = CollaborativeOptimizer(opt, peer, OptimizerConfig(target_batch_size=32), scaler=scaler, model=model)
        if flags:  # a member that sets the vector's last entry (the overflow flag at b122246) on every step
            export = copt.acc.export

            def flagged():
                vector, finite = export()
                vector[-1] = 1.0
                return vector, finite
            copt.acc.export = flagged
        params, scales, outcomes = {0: flat(model)}, {0: scaler.get_scale()}, {}
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(index)).to(device)
        pos = 0
        while copt.global_step < steps:
            ids = order[pos:pos + 8]
            pos += 8
            with torch.autocast(device, dtype=dtype):
                loss = torch.nn.functional.mse_loss(model(x[ids]).float(), y[ids])
            if poison and copt.global_step == OVERFLOW_STEP:
                loss = loss * float("inf")  # this peer's gradients overflow during this step
            scaler.scale(loss).backward()
            outcome = copt.step(len(ids))
            if outcome in (StepOutcome.STEPPED, StepOutcome.SKIPPED):
                outcomes[copt.history[-1].step] = outcome
                params[copt.applied_step] = flat(model).cpu()
                scales[copt.applied_step] = scaler.get_scale()
        copt.close()
        out[index] = (params, scales, outcomes)
    except BaseException as e:
        out[index] = e


def run_pair(device, poison=False, flags=False, steps=6):
    torch.set_num_threads(1)
    peers = start(2, run_id())
    out = {}
    try:
        threads = [threading.Thread(target=train, args=(p, i, steps, poison and i == 1, out, device, flags and i == 1))
                   for i, p in enumerate(peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
            assert not t.is_alive()
    finally:
        for p in peers:
            p.close()
    for v in out.values():
        assert not isinstance(v, BaseException), repr(v)
    return out[0], out[1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="fp16 with GradScaler on CUDA needs a GPU"))])
def test_an_overflow_on_one_peer_leaves_its_samples_out_and_backs_off_its_scale_only(device):
    (p0, s0, o0), (p1, s1, o1) = run_pair(device, poison=True)
    assert all(o == StepOutcome.STEPPED for o in (*o0.values(), *o1.values())), (o0, o1)
    assert not torch.equal(p0[OVERFLOW_STEP], p0[OVERFLOW_STEP + 1]), "the others' samples made no step"
    for s in range(7):
        assert torch.equal(p0[s], p1[s]), f"peers differ after step {s}"
    assert s1[OVERFLOW_STEP + 1] == s1[OVERFLOW_STEP] * 0.5  # the overflowing peer backed off
    assert s0[OVERFLOW_STEP + 1] == s0[OVERFLOW_STEP] * 2  # the other did not: its third good step grew it
    assert s1[OVERFLOW_STEP + 4] == s1[OVERFLOW_STEP + 1] * 2  # grown again after growth_interval
    assert torch.isfinite(p0[6]).all()


@pytest.mark.timeout(180)
def test_a_member_flagging_an_overflow_every_step_skips_nothing():
    """At b122246 the averaged vector's last entry was an overflow flag: one member setting it made
    every peer skip every step (a veto)."""
    (p0, s0, o0), (p1, s1, o1) = run_pair("cpu", flags=True)
    assert all(o == StepOutcome.STEPPED for o in (*o0.values(), *o1.values())), (o0, o1)
    assert all(torch.equal(p0[s], p1[s]) for s in range(7)) and not torch.equal(p0[0], p0[6])
    assert s0 == s1  # nobody's scale backed off
