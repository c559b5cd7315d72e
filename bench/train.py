"""`dedloc train` with one peer against plain single-process training, and the data pipeline's speed.

Runs, one after the other, each in a fresh process, on the same recipe, corpus (the standard
library's docstrings as a JSON-lines file), tokenizer, data pipeline and micro-batches:

- ``plain``: an ordinary loop: micro-batches from the same DataLoader, gradients accumulated up
  to the target batch, then ``optimizer.step()`` and the schedule;
- ``dedloc``: :class:`dedloc.roles.trainer.Trainer` (what ``dedloc train`` runs), alone in its
  collaboration;
- ``pipeline``: the DataLoader alone, as fast as it goes.

Samples/s are measured from the end of the first global step to the end of the last (start-up
excluded). Prints one JSON line: ``plain_sps``, ``dedloc_sps``, ``dedloc_over_plain`` (goal
>= 0.95), ``pipeline_tokens_per_s``, ``model_tokens_per_s`` (what plain training consumes) and
``pipeline_over_model`` (> 1: the model never waits for data).

    python bench/train.py [--recipe tiny-mlm] [--steps 12] [--micro-batch 16] [--data-workers 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import tempfile
import time
import uuid
from pathlib import Path


def _plain(recipe, data, tokenizer: str, steps: int, device: str, out) -> None:
    import torch

    from dedloc.data.mlm import BatchSpec, loader
    from dedloc.data.stream import peer_seed
    from dedloc.data.tokenizer import load_tokenizer
    from dedloc.roles.trainer import pick_device, pick_precision

    torch.set_num_threads(max(1, torch.get_num_threads()))
    dev = pick_device(device)
    precision = pick_precision(recipe.precision, dev)
    batches = iter(loader(data, BatchSpec(tokenizer, recipe.seq_len, recipe.micro_batch, recipe.mlm_probability,
                                          seed=peer_seed("plain")), pin_memory=dev.type == "cuda"))
    model = recipe.build_model(len(load_tokenizer(tokenizer))).to(dev)
    opt = recipe.build_optimizer(model)
    sched = recipe.build_scheduler(opt)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    start, samples = None, 0
    for step in range(steps):
        n = 0
        while n < recipe.target_batch_size:
            batch = next(batches)
            with torch.autocast(dev.type, dtype=dtype, enabled=precision in ("fp16", "bf16")):
                loss = model(input_ids=batch["input_ids"].to(dev), labels=batch["labels"].to(dev)).loss
            (scaler.scale(loss) if scaler else loss).backward()
            loss.item()
            n += int(batch["input_ids"].shape[0])
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= n / recipe.micro_batch
        if scaler is not None:
            scaler.unscale_(opt)
        if recipe.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        opt.zero_grad()
        if start is None:
            start = time.monotonic()
        else:
            samples += n
    out.put({"sps": samples / (time.monotonic() - start)})


def _dedloc(recipe, data, tokenizer: str, steps: int, device: str, state_dir: str, out) -> None:
    from dedloc.config import AveragingConfig, PeerConfig
    from dedloc.roles.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(tokenizer=tokenizer, state_dir=state_dir, max_steps=steps, device=device),
                      recipe, data, PeerConfig(run_id="bench-" + uuid.uuid4().hex[:8], log_level="WARNING"),
                      AveragingConfig(matchmaking_time=2.0))
    ends: list[float] = []
    samples = [0]

    def on_step(event) -> None:
        ends.append(time.monotonic())
        if len(ends) > 1:
            samples[0] += event.samples

    try:
        trainer.run(on_step=on_step)
    finally:
        trainer.close()
    out.put({"sps": samples[0] / (ends[-1] - ends[0])})


def _pipeline(recipe, data, tokenizer: str, seconds: float, out) -> None:
    from dedloc.data.mlm import BatchSpec, loader
    from dedloc.data.stream import peer_seed

    batches = iter(loader(data, BatchSpec(tokenizer, recipe.seq_len, recipe.micro_batch, recipe.mlm_probability,
                                          seed=peer_seed("pipeline"))))
    next(batches)  # start-up
    start, tokens = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        tokens += int(next(batches)["input_ids"].numel())
    out.put({"tokens_per_s": tokens / (time.monotonic() - start)})


def _in_process(ctx, target, *args) -> dict:
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        return q.get(timeout=1800)
    finally:
        p.join(60)
        if p.is_alive():
            p.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-mlm")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--target-batch-size", type=int, default=None)
    parser.add_argument("--data-workers", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--corpus-files", type=int, default=600)
    parser.add_argument("--pipeline-seconds", type=float, default=10.0)
    args = parser.parse_args()
    from dedloc.data.mlm import DataConfig
    from dedloc.data.sources import open_sources
    from dedloc.data.tokenizer import save_tokenizer, train_tokenizer
    from dedloc.demo.corpus import write_corpus
    from dedloc.recipes import get_recipe

    overrides = {k: v for k, v in (("micro_batch", args.micro_batch), ("target_batch_size", args.target_batch_size))
                 if v is not None}
    recipe = get_recipe(args.recipe, **overrides)
    work = Path(tempfile.mkdtemp(prefix="dedloc-bench-train-"))
    corpus = work / "corpus.jsonl"
    write_corpus(corpus, args.corpus_files)
    tokenizer = str(work / "tok")
    save_tokenizer(train_tokenizer((e["text"] for e in open_sources([str(corpus)])), recipe.vocab_size), tokenizer)
    data = DataConfig(data=(str(corpus),), shuffle_buffer=1000, data_workers=args.data_workers)
    ctx = mp.get_context("spawn")
    plain = _in_process(ctx, _plain, recipe, data, tokenizer, args.steps, args.device)
    ours = _in_process(ctx, _dedloc, recipe, data, tokenizer, args.steps, args.device, str(work / "state"))
    pipe = _in_process(ctx, _pipeline, recipe, data, tokenizer, args.pipeline_seconds)
    model_tps = plain["sps"] * recipe.seq_len
    print(json.dumps({
        "recipe": args.recipe, "steps": args.steps, "micro_batch": recipe.micro_batch,
        "target_batch_size": recipe.target_batch_size, "seq_len": recipe.seq_len, "data_workers": args.data_workers,
        "plain_sps": round(plain["sps"], 2), "dedloc_sps": round(ours["sps"], 2),
        "dedloc_over_plain": round(ours["sps"] / plain["sps"], 3),
        "pipeline_tokens_per_s": round(pipe["tokens_per_s"]), "model_tokens_per_s": round(model_tps),
        "pipeline_over_model": round(pipe["tokens_per_s"] / model_tps, 2),
        "recipe_config": dataclasses.asdict(recipe),
    }))


if __name__ == "__main__":
    main()
