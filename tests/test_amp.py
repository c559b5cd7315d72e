"""Mixed precision: a collaboration-wide loss scale; an overflow on one peer makes every peer skip."""

import threading

import pytest
import torch

from dedloc.config import OptimizerConfig
from dedloc.optim import CollaborativeOptimizer, StepOutcome

from conftest import run_id
from test_optimizer import data, flat, make_model, start

OVERFLOW_STEP = 2


def train(peer, index, steps, poison, out, device="cpu"):
    try:
        x, y = (t.to(device) for t in data())
        model = make_model().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=3)
        dtype = torch.float16 if device == "cuda" else torch.bfloat16
        copt = CollaborativeOptimizer(opt, peer, OptimizerConfig(target_batch_size=32), scaler=scaler, model=model)
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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="fp16 with GradScaler on CUDA needs a GPU"))])
def test_overflow_on_one_peer_skips_the_step_on_all(device):
    torch.set_num_threads(1)
    peers = start(2, run_id())
    out = {}
    try:
        threads = [threading.Thread(target=train, args=(p, i, 6, i == 1, out, device)) for i, p in enumerate(peers)]
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
    (p0, s0, o0), (p1, s1, o1) = out[0], out[1]
    assert o0[OVERFLOW_STEP] == o1[OVERFLOW_STEP] == StepOutcome.SKIPPED
    assert all(o0[s] == StepOutcome.STEPPED for s in o0 if s != OVERFLOW_STEP)
    assert torch.equal(p0[OVERFLOW_STEP], p0[OVERFLOW_STEP + 1]), "the skipped step changed the parameters"
    for s in range(7):
        assert torch.equal(p0[s], p1[s]) and s0[s] == s1[s], f"peers differ after step {s}"
    assert s0[OVERFLOW_STEP + 1] == s0[OVERFLOW_STEP] * 0.5  # backed off together
    assert s0[OVERFLOW_STEP + 4] == s0[OVERFLOW_STEP + 1] * 2  # grown together after growth_interval
    assert torch.isfinite(p0[6]).all()
