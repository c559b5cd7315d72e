"""Collaborative training throughput on the demo's task (small ALBERT, MLM on stdlib docstrings).

Runs, one after the other on this machine:
- ``single``: one process training alone, accumulating micro-batches up to the target batch;
- ``collab``: N dedloc peers (separate processes) with the collaborative optimizer;
- ``hivemind``: N peers with hivemind's ``Optimizer`` (the incumbent).
Each reports samples/s over the training phase (after the first global step, so start-up and
joining are excluded), the realised batch of each step and, for collaborations, the largest
difference between two peers' final parameters. Prints one JSON line.

    python bench/collab.py --peers 3 --steps 12
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
import uuid

import torch

from dataclasses import dataclass


@dataclass
class BenchConfig:
    trainers: int = 3
    steps: int = 12
    target_batch_size: int = 128
    micro_batch: int = 16
    lr: float = 3e-3
    delay_updates: bool = False
    seq_len: int = 64
    vocab_size: int = 3000
    time_limit: float = 900.0


def token_blocks(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """All texts as one token stream cut into ``[CLS] ... [SEP]`` blocks of ``seq_len``: (N, seq_len) int64.
    In memory, so that both collaborations read the same samples at no cost."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.sep_token_id)
    body = seq_len - 2
    n = len(ids) // body
    blocks = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
    cls = torch.full((n, 1), tokenizer.cls_token_id, dtype=torch.long)
    sep = torch.full((n, 1), tokenizer.sep_token_id, dtype=torch.long)
    return torch.cat([cls, blocks, sep], dim=1)


def mlm_worker(cfg: BenchConfig, blocks: torch.Tensor, tokenizer, index: int):
    """(model, micro_step): the tiny-mlm recipe's model (the same on every peer), peer ``index``'s
    shard of the blocks (every trainers-th, cycled) and its own masks."""
    from transformers import DataCollatorForLanguageModeling

    from dedloc.recipes import get_recipe

    model = get_recipe("tiny-mlm", seq_len=cfg.seq_len).build_model(len(tokenizer))
    torch.manual_seed(1 + index)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    shard = blocks[index::cfg.trainers]
    pos = [0]

    def micro_step(n: int) -> float:
        rows = [shard[(pos[0] + i) % len(shard)] for i in range(n)]
        pos[0] += n
        batch = collate([{"input_ids": r} for r in rows])
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        return loss.item()

    return model, micro_step


def _setup(cfg: BenchConfig, blocks, tokenizer, index: int):
    torch.set_num_threads(1)
    return mlm_worker(cfg, blocks, tokenizer, index)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def single(cfg: BenchConfig, blocks, tokenizer, out) -> None:
    model, micro_step = _setup(cfg, blocks, tokenizer, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start, samples = None, 0
    for step in range(cfg.steps):
        n = 0
        while n < cfg.target_batch_size:
            micro_step(cfg.micro_batch)
            n += cfg.micro_batch
        for p in model.parameters():
            p.grad /= n // cfg.micro_batch
        opt.step()
        opt.zero_grad()
        if start is None:
            start = time.monotonic()
        else:
            samples += n
    out.put({"sps": samples / (time.monotonic() - start), "batches": [cfg.target_batch_size] * cfg.steps})


def dedloc_peer(cfg: BenchConfig, blocks, tokenizer, index: int, run_id: str, initial, out, go) -> None:
    from dedloc.config import OptimizerConfig, PeerConfig
    from dedloc.demo.collab import AVERAGING
    from dedloc.optim import CollaborativeOptimizer, StepOutcome
    from dedloc.peer import Peer

    model, micro_step = _setup(cfg, blocks, tokenizer, index)
    with Peer(PeerConfig(run_id=run_id, initial_peers=tuple(initial), log_level="WARNING"), AVERAGING) as peer:
        out.put(("joined", index, list(peer.maddrs)))
        go.wait()
        opt = CollaborativeOptimizer(torch.optim.AdamW(model.parameters(), lr=cfg.lr), peer,
                                     OptimizerConfig(target_batch_size=cfg.target_batch_size,
                                                     delay_updates=cfg.delay_updates), model=model)
        start, samples = None, 0
        while opt.global_step < cfg.steps:
            micro_step(cfg.micro_batch)
            if opt.step(cfg.micro_batch) != StepOutcome.ACCUMULATED:
                if start is None:
                    start, samples = time.monotonic(), 0
            elif start is not None:
                samples += cfg.micro_batch
        end = time.monotonic()
        opt.close()
        out.put(("done", index, samples, start, end, _flat(model), [r.batch for r in opt.history]))


def hivemind_peer(cfg: BenchConfig, blocks, tokenizer, index: int, run_id: str, initial, out, go) -> None:
    import hivemind

    model, micro_step = _setup(cfg, blocks, tokenizer, index)
    dht = hivemind.DHT(initial_peers=list(initial), start=True)
    out.put(("joined", index, [str(a) for a in dht.get_visible_maddrs()]))
    go.wait()
    opt = hivemind.Optimizer(dht=dht, run_id=run_id, params=model.parameters(),
                             optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
                             target_batch_size=cfg.target_batch_size, batch_size_per_step=cfg.micro_batch,
                             matchmaking_time=2.0, averaging_timeout=30.0, verbose=False,
                             delay_optimizer_step=cfg.delay_updates, delay_grad_averaging=cfg.delay_updates)
    start, samples, batches = None, 0, []
    epoch = opt.local_epoch
    while opt.local_epoch < cfg.steps:
        micro_step(cfg.micro_batch)
        before = opt.tracker.global_progress.samples_accumulated
        opt.step()
        opt.zero_grad()
        if opt.local_epoch != epoch:
            batches.append(before)
            epoch = opt.local_epoch
            if start is None:
                start, samples = time.monotonic(), 0
        elif start is not None:
            samples += cfg.micro_batch
    end = time.monotonic()
    out.put(("done", index, samples, start, end, _flat(model), batches))
    opt.shutdown()
    dht.shutdown()


def _guarded(worker, *args) -> None:
    """Run a worker process body; report its failure instead of leaving the parent waiting."""
    out, index = args[-2], args[3]
    try:
        worker(*args)
    except BaseException as e:
        out.put(("error", index, f"{type(e).__name__}: {e}"))


def _expect(out, kind: str, timeout: float):
    msg = out.get(timeout=timeout)
    if msg[0] == "error":
        raise RuntimeError(f"peer {msg[1]} failed: {msg[2]}")
    assert msg[0] == kind, msg
    return msg


def collaboration(worker, cfg: BenchConfig, blocks, tokenizer, ctx) -> dict:
    """Run N peers of ``worker``; all join before any trains, so the measurement covers N peers."""
    out, go = ctx.Queue(), ctx.Event()
    run_id = "bench" + uuid.uuid4().hex[:8]

    def spawn(i: int, initial: list[str]):
        p = ctx.Process(target=_guarded, args=(worker, cfg, blocks, tokenizer, i, run_id, initial, out, go))
        p.start()
        return p

    procs = [spawn(0, [])]
    try:
        maddrs = _expect(out, "joined", 120)[2]
        procs += [spawn(i, maddrs) for i in range(1, cfg.trainers)]
        for _ in procs[1:]:
            _expect(out, "joined", 120)
        go.set()
        results = [_expect(out, "done", cfg.time_limit) for _ in procs]
    finally:
        go.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
    starts = [r[3] for r in results if r[3] is not None]
    ends = [r[4] for r in results]
    samples = sum(r[2] for r in results)
    params = [r[5] for r in results]
    diff = max(float((a - b).abs().max()) for i, a in enumerate(params) for b in params[i + 1:])
    return {"sps": samples / (max(ends) - min(starts)), "max_param_diff": diff,
            "batches": max((r[6] for r in results), key=len)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--target-batch-size", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--skip-hivemind", action="store_true")
    args = parser.parse_args()
    from dedloc.data.tokenizer import train_tokenizer
    from dedloc.demo.corpus import stdlib_docstrings

    cfg = BenchConfig(trainers=args.peers, steps=args.steps, target_batch_size=args.target_batch_size,
                      micro_batch=args.micro_batch)
    texts = stdlib_docstrings()
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    blocks = token_blocks(texts, tokenizer, cfg.seq_len)
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    p = spawn.Process(target=single, args=(cfg, blocks, tokenizer, q))
    p.start()
    alone = q.get(timeout=cfg.time_limit)
    p.join()
    ours = collaboration(dedloc_peer, cfg, blocks, tokenizer, spawn)
    theirs = collaboration(hivemind_peer, cfg, blocks, tokenizer, mp.get_context("fork")) \
        if not args.skip_hivemind else None
    print(json.dumps({
        "peers": cfg.trainers, "steps": cfg.steps, "target_batch_size": cfg.target_batch_size,
        "micro_batch": cfg.micro_batch,
        "single_sps": round(alone["sps"], 2), "collab_sps": round(ours["sps"], 2),
        "hivemind_sps": round(theirs["sps"], 2) if theirs else None,
        "collab_over_single": round(ours["sps"] / alone["sps"], 3),
        "hivemind_over_single": round(theirs["sps"] / alone["sps"], 3) if theirs else None,
        "collab_max_param_diff": ours["max_param_diff"],
        "hivemind_max_param_diff": theirs["max_param_diff"] if theirs else None,
        "collab_batches": ours["batches"], "hivemind_batches": theirs["batches"] if theirs else None,
    }))


if __name__ == "__main__":
    main()
