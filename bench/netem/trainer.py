"""One trainer of bench/netem/collab.py, run inside a network namespace.

Trains a synthetic MLP regression with the collaborative optimizer. ``samples_per_second``
emulates the device: each micro-batch takes at least ``micro / samples_per_second`` seconds.
A part-time peer starts training once the collaboration reaches ``join_step`` (downloading
the state) and leaves at ``leave_step``. Prints JSON lines: first {"maddrs"}, then the result.
"""

import json
import logging
import sys
import time

import torch

from dedloc.config import AveragingConfig, OptimizerConfig, PeerConfig
from dedloc.logs import configure
from dedloc.optim import CollaborativeOptimizer
from dedloc.peer import Peer

DIM = 256
log = logging.getLogger("dedloc.bench.trainer")


def model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def main() -> None:
    spec = json.loads(sys.argv[1])
    out, sys.stdout = sys.stdout, sys.stderr
    torch.set_num_threads(1)
    configure()  # the optimizer's events (state downloaded, step skipped) go to the peer's log too
    peer = Peer(PeerConfig(**spec["peer"]), AveragingConfig(**spec["averaging"]))
    out.write(json.dumps({"maddrs": peer.maddrs, "peer_id": peer.peer_id}) + "\n")
    out.flush()
    try:
        join, leave, steps = spec.get("join_step", 0), spec.get("leave_step"), spec["steps"]
        deadline = time.monotonic() + spec["time_limit"]
        # build everything before joining: the first torch optimizer imports torch._dynamo, which took
        # 7-14 s with the collaboration's peers busy on this machine's 2 cores
        net = model(spec["hidden"])
        sgd = torch.optim.SGD(net.parameters(), lr=0.01)
        while join and peer.collaboration().global_step < join and time.monotonic() < deadline:
            time.sleep(0.2)  # a part-time peer: not part of the collaboration yet
        while not join and time.monotonic() < deadline:  # full-time peers start together
            peer.publish_progress(0, 0, 0.0)
            if sum(r.role.trains for r in peer.collaboration().peers) >= spec.get("start_with", 0):
                break
            time.sleep(0.2)
        built = time.monotonic()
        opt = CollaborativeOptimizer(sgd, peer, OptimizerConfig(**spec["optimizer"]), model=net)
        log.info(f"optimizer ready at step {opt.global_step} in {time.monotonic() - built:.1f} s")
        gen = torch.Generator().manual_seed(spec["index"])
        w_true = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
        samples, started, step_times = 0, time.time(), []
        micro, sps = spec["micro"], spec["samples_per_second"]
        while opt.global_step < steps and time.monotonic() < deadline:
            if leave is not None and opt.global_step >= leave:
                break
            t0 = time.perf_counter()
            x = torch.randn(micro, DIM, generator=gen)
            loss = torch.nn.functional.mse_loss(net(x), torch.tanh(x @ w_true))
            loss.backward()
            time.sleep(max(0.0, micro / sps - (time.perf_counter() - t0)))  # the emulated device's speed
            samples += micro
            before = opt.applied_step
            opt.step(micro)
            if opt.applied_step != before:
                step_times.append([opt.applied_step, time.time()])
        opt.close()
        digest = float(sum(p.detach().double().sum() for p in net.parameters()))
        out.write(json.dumps({"index": spec["index"], "samples": samples, "started": started, "ended": time.time(),
                              "applied_step": opt.applied_step, "resyncs": opt.resyncs, "catchups": opt.catchups,
                              "param_sum": digest,
                              "step_times": step_times,
                              "history": [[r.step, r.local_samples, r.batch, r.group_size, r.averaging_s, r.skipped]
                                          for r in opt.history]}) + "\n")
        out.flush()
    finally:
        peer.close()


if __name__ == "__main__":
    main()
