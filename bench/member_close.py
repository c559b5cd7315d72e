"""A member takes each step alone: does the run adopt its parameters? (docs/security.md, issue 38)

    python bench/member_close.py [--honest 3] [--steps 12] [--attack-at 3] [--timeout 240] [--name-others]

An invite-only run as the README deploys it (a backbone with a backbone invitation; every other
peer's only initial peer is the backbone) with ``--honest`` honest trainers and one more member,
all training the chaos soak's MLP (bench/chaos_trainer.py) in this process. The member trains
honestly until step ``--attack-at``; then, at each step the run attests, it stores a ``closed``
record of a group of one (itself) for that step, sets its parameters to its own (every weight
``EVIL`` plus a step mark), publishes them as that step's update applied (its lineage continuing
the run's) and serves them (dedloc/testing/members.py). Its service is the real one with one method
added (``close_alone``: store that record under its own key); everything else is the library's
code. With ``--name-others`` its record names the honest trainers as members too at odd steps
(without their join proofs, which it cannot make).

Prints one JSON line for the attack and one for a baseline (the same member training honestly
throughout): ``steps`` (the honest trainers' newest applied step), ``adopted_steps`` (applied
steps at which an honest trainer held the member's parameters), ``honest_resyncs``, ``seconds``,
``stalled`` (the honest trainers did not reach ``--steps`` within ``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import chaos_trainer as model_code  # noqa: E402

from dedloc.auth.identity import create_identity  # noqa: E402
from dedloc.auth.invitation import RunOwner  # noqa: E402
from dedloc.config import AveragingConfig, BackboneConfig, OptimizerConfig, PeerConfig  # noqa: E402
from dedloc.optim import CollaborativeOptimizer, StepOutcome  # noqa: E402
from dedloc.peer import Peer  # noqa: E402
from dedloc.roles.backbone import Backbone  # noqa: E402
from dedloc.testing.members import AloneTaker, ClosingPeer, is_evil  # noqa: E402

AVG = AveragingConfig(matchmaking_time=2.0, averaging_timeout=20.0, probe_interval=0)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class Honest(threading.Thread):
    def __init__(self, index: int, peer: Peer, steps: int, done: threading.Event):
        super().__init__(daemon=True)
        self.index, self.peer, self.steps, self.done = index, peer, steps, done
        self.params: dict[int, torch.Tensor] = {}
        self.resyncs = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            x, y = model_code.data()
            model = model_code.make_model()
            sgd, sched = model_code.make_opt(model)
            copt = CollaborativeOptimizer(sgd, self.peer, OptimizerConfig(target_batch_size=64), scheduler=sched,
                                          model=model)
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(100 + self.index))
            pos = 0
            while copt.global_step < self.steps and not self.done.is_set():
                ids = order[pos:pos + 8]
                pos = (pos + 8) % (len(x) - 8)
                torch.nn.functional.mse_loss(model(x[ids]), y[ids]).backward()
                time.sleep(0.03)
                if copt.step(len(ids)) == StepOutcome.RESYNCED:
                    self.resyncs += 1
                self.params[copt.applied_step] = flat(model)
            copt.close()
        except BaseException as e:
            self.error = e


def attacker(peer: ClosingPeer, attack_at: int, attacking: bool, others) -> AloneTaker:
    """The member: trains honestly until ``attack_at``; then (``attacking``) takes every attested step alone."""
    x, y = model_code.data()
    model = model_code.make_model()
    sgd, _ = model_code.make_opt(model)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(99))
    at = [0]

    def micro_batch(m: torch.nn.Module) -> int:
        ids = order[at[0]:at[0] + 8]
        at[0] = (at[0] + 8) % (len(x) - 8)
        torch.nn.functional.mse_loss(m(x[ids]), y[ids]).backward()
        time.sleep(0.03)
        return len(ids)

    return AloneTaker(peer, model, sgd, OptimizerConfig(target_batch_size=64), micro_batch, attack_at, attacking, others)


def run(args: argparse.Namespace, attacking: bool, workdir: str) -> dict:
    owner = RunOwner.init(os.path.join(workdir, f"run{int(attacking)}"), f"mc{os.getpid()}{int(attacking)}")

    def member(name: str, backbone: bool = False, **kw) -> PeerConfig:
        path = os.path.join(workdir, f"{name}{int(attacking)}.key")
        return PeerConfig(run_id=owner.run_id, owner=owner.public, invite=owner.invite(create_identity(path), 7 * 86400.0,
                                                                                          backbone),
                          identity_path=path, **kw)

    backbone = Backbone(member("backbone", backbone=True),
                        BackboneConfig(checkpoint_dir=os.path.join(workdir, f"ckpt{int(attacking)}")), AVG)
    done = threading.Event()
    pulling = backbone.in_background()
    joined = dict(initial_peers=tuple(backbone.maddrs))
    peers: list[Peer] = []
    started = time.monotonic()
    evil: AloneTaker | None = None
    try:
        peers = [Peer(member(f"honest{i}", **joined), AVG) for i in range(args.honest)]
        peers.append(ClosingPeer(member("member", **joined), AVG))
        honest = [Honest(i, p, args.steps, done) for i, p in enumerate(peers[:-1])]
        evil = attacker(peers[-1], args.attack_at, attacking,
                        (lambda: tuple(p.peer_id for p in peers[:-1])) if args.name_others else tuple)
        for t in honest + [evil]:
            t.start()
        deadline = time.monotonic() + args.timeout
        for t in honest:
            t.join(max(0.1, deadline - time.monotonic()))
        stalled = any(t.is_alive() for t in honest)
        done.set()
        for t in honest:
            t.join(60)
    finally:
        if evil is not None:
            evil.stop.set()
        done.set()
        pulling.stop()
        for p in peers:
            p.close()
        backbone.close()
    seconds = time.monotonic() - started
    evil.join(30)
    adopted = sorted({s for t in honest for s, v in t.params.items() if is_evil(v)})
    return {"attack": attacking, "honest": args.honest, "steps": max(max(t.params, default=0) for t in honest),
            "adopted_steps": adopted, "honest_resyncs": sum(t.resyncs for t in honest),
            "member_took_alone": len(evil.took), "member_error": repr(evil.error) if evil.error else None,
            "seconds": round(seconds, 1), "stalled": stalled,
            "errors": [repr(t.error) for t in honest if t.error is not None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--honest", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--attack-at", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--name-others", action="store_true",
                        help="at odd steps its record names the honest peers as members too (without their proofs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="dedloc-member-close-") as workdir:
        for attacking in (False, True):
            print(json.dumps(run(args, attacking, workdir)), flush=True)


if __name__ == "__main__":
    main()
