"""One trainer of bench/chaos.py: trains a tiny MLP collaboratively until SIGTERM, logging what it did.

Argument: a JSON spec (see chaos.py). Every event is one JSON line, flushed at once (a kill -9
loses nothing already written) to ``spec["events"]``:
- ``start`` (peer id, runtime pid), ``ready`` (steps after joining);
- ``mb``: a micro-batch's sample ids and the applied step of the parameters it was computed on;
- ``contrib``: just before a round, the step and the micro-batches this peer sends for it;
- ``drop``: the optimizer dropped the gradients in hand (resync);
- ``round``: a round this peer applied (step, realised batch, contributors, skipped);
- ``applied``: the parameters after each applied step (as floats);
- ``end`` or ``crash``.
"""

import json
import signal
import sys
import time
import traceback

import torch

from dedloc.config import AveragingConfig, OptimizerConfig, PeerConfig
from dedloc.logs import configure
from dedloc.optim import CollaborativeOptimizer, StepOutcome
from dedloc.peer import Peer

N, DIM, HIDDEN = 4096, 8, 16
LR, MOMENTUM = 0.05, 0.9


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    y = torch.sin(x @ torch.randn(DIM, 1, generator=g)) + 0.1 * torch.randn(N, 1, generator=g)
    return x, y


def make_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def make_opt(model: torch.nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    return opt, sched


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    configure(spec.get("log_level", "INFO"))
    events = open(spec["events"], "a")

    def log(kind: str, **fields) -> None:
        events.write(json.dumps({"e": kind, "t": time.time(), "inc": spec["incarnation"], **fields}) + "\n")
        events.flush()

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    peer = Peer(PeerConfig(run_id=spec["run_id"], initial_peers=tuple(spec["initial_peers"]),
                           identity_path=spec["identity"], client_mode=spec["client"],
                           log_level=spec.get("log_level", "INFO")),
                AveragingConfig(matchmaking_time=2.0, averaging_timeout=20.0, probe_interval=0))
    log("start", peer_id=peer.peer_id, runtime_pid=peer.runtime.pid)
    try:
        x, y = data()
        model = make_model()
        sgd, sched = make_opt(model)
        pending: list[list] = []

        def contributed(step: int, samples: int) -> None:  # (a step declined keeps them for the next try)
            log("contrib", step=step, samples=samples, mbs=pending[:] if samples else [])

        opt = CollaborativeOptimizer(sgd, peer, OptimizerConfig(target_batch_size=spec["target"],
                                                                delay_updates=spec["delay_updates"],
                                                                state_timeout=spec.get("state_timeout", 120.0),
                                                                hand_on_timeout=20.0),  # chaos kills at 30 s
                                     scheduler=sched, model=model, on_contribute=contributed)
        log("ready", global_step=opt.global_step, applied=opt.applied_step)
        log("applied", applied=opt.applied_step, params=flat(model), via="join")
        order = torch.Generator().manual_seed(1000 * spec["index"] + spec["incarnation"])
        micro, pace = spec["micro"], spec["mb_seconds"]
        seen_rounds = 0
        applied = opt.applied_step
        while not stop:
            t0 = time.perf_counter()
            ids = torch.randint(0, N, (micro,), generator=order)
            loss = torch.nn.functional.mse_loss(model(x[ids]), y[ids])
            loss.backward()
            applied = opt.applied_step
            pending.append([ids.tolist(), applied])
            log("mb", applied=applied, step=opt.global_step, loss=loss.item())
            time.sleep(max(0.0, pace - (time.perf_counter() - t0)))  # the emulated device's speed
            outcome = opt.step(micro)
            if outcome == StepOutcome.RESYNCED:
                log("drop", samples=sum(len(m[0]) for m in pending))
                pending.clear()
            elif outcome in (StepOutcome.STEPPED, StepOutcome.SKIPPED):  # they went into that step's round
                pending.clear()
            for r in opt.history[seen_rounds:]:
                log("round", step=r.step, batch=r.batch, contributors=list(r.contributors), skipped=r.skipped,
                    local=r.local_samples, group=r.group_size)
            seen_rounds = len(opt.history)
            if opt.applied_step != applied:
                log("applied", applied=opt.applied_step, params=flat(model),
                    via="round" if outcome in (StepOutcome.STEPPED, StepOutcome.SKIPPED) else "state")
        opt.close()
        if opt.applied_step != applied:  # close() may land an update still in flight
            log("applied", applied=opt.applied_step, params=flat(model), via="round")
        for r in opt.history[seen_rounds:]:
            log("round", step=r.step, batch=r.batch, contributors=list(r.contributors), skipped=r.skipped,
                local=r.local_samples, group=r.group_size)
        log("end", resyncs=opt.resyncs, catchups=opt.catchups, skipped=opt.skipped_steps,
            forks_refused=opt.forks_refused)
    except BaseException as e:
        log("crash", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        raise
    finally:
        peer.close()
        events.close()


if __name__ == "__main__":
    main()
