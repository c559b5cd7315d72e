"""`dedloc demo`: a local collaboration pretraining a small ALBERT with masked-language modelling.

A backbone peer (in this process) and several trainer processes of different speeds (one in
client mode) train one model through the collaborative optimizer. The terminal shows live
progress; ``out_dir`` receives ``loss.png`` and ``summary.json``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue as queue_mod
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dedloc.config import AveragingConfig, BackboneConfig, OptimizerConfig, PeerConfig
from dedloc.errors import ConfigError, DedlocError


def _opt(help: str, **kw: Any) -> Any:
    return field(metadata={"help": help}, **kw)


@dataclass
class DemoConfig:
    """What the demo runs; every field is also a ``dedloc demo --option``."""

    trainers: int = _opt("trainer peers (the last one runs in client mode)", default=3)
    steps: int = _opt("global optimizer steps to train", default=60)
    target_batch_size: int = _opt("samples per global step (the collaboration's batch)", default=96)
    micro_batch: int = _opt("the fastest trainer's micro-batch; slower ones use half", default=16)
    slowdown: float = _opt("extra seconds per micro-batch on the slowest trainer (speeds differ)", default=0.15)
    hidden_size: int = _opt("ALBERT hidden size", default=128)
    layers: int = _opt("ALBERT layers", default=2)
    heads: int = _opt("ALBERT attention heads", default=2)
    vocab_size: int = _opt("tokenizer vocabulary, trained at start on stdlib docstrings", default=3000)
    seq_len: int = _opt("tokens per example", default=64)
    corpus_files: int = _opt("standard-library files to read docstrings from", default=1500)
    lr: float = _opt("peak learning rate (AdamW, linear warmup then decay)", default=3e-3)
    delay_updates: bool = _opt("delayed parameter updates (overlap averaging with compute)", default=False)
    out: str | None = _opt("write loss.png and summary.json into this directory", default=None)
    seed: int = _opt("seed of the shared initial model", default=0)
    time_limit: float = _opt("give up after this many seconds", default=900.0)

    def validate(self) -> "DemoConfig":
        if self.trainers < 2:
            raise ConfigError("invalid config: trainers must be >= 2")
        for name in ("steps", "target_batch_size", "micro_batch", "hidden_size", "layers", "heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"invalid config: {name} must be >= 1")
        if self.vocab_size < 100:
            raise ConfigError("invalid config: vocab_size must be >= 100")
        if self.hidden_size % self.heads:
            raise ConfigError("invalid config: hidden_size must be a multiple of heads")
        if self.seq_len < 8:
            raise ConfigError("invalid config: seq_len must be >= 8")
        return self


AVERAGING = AveragingConfig(matchmaking_time=2.0, averaging_timeout=30.0)


def model_config(cfg: DemoConfig, vocab_size: int):
    from transformers import AlbertConfig

    return AlbertConfig(vocab_size=vocab_size, embedding_size=max(16, cfg.hidden_size // 2),
                        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                        intermediate_size=4 * cfg.hidden_size, max_position_embeddings=max(64, cfg.seq_len))


def mlm_worker(cfg: DemoConfig, blocks: torch.Tensor, tokenizer, index: int):
    """(model, micro_step) for peer ``index``: the same initial model on every peer, its own data shard
    and masks; ``micro_step(n)`` runs forward and backward on n examples and returns the loss."""
    from transformers import AlbertForMaskedLM, DataCollatorForLanguageModeling

    from dedloc.demo.corpus import shard_stream

    torch.manual_seed(cfg.seed)
    model = AlbertForMaskedLM(model_config(cfg, len(tokenizer)))
    torch.manual_seed(cfg.seed + 1 + index)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    stream = shard_stream(blocks, index, cfg.trainers, buffer=256, seed=index)

    def micro_step(n: int) -> float:
        batch = collate([{"input_ids": next(stream)} for _ in range(n)])
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        return loss.item()

    return model, micro_step


def _trainer(index: int, spec: dict[str, Any], cfg: DemoConfig, blocks: torch.Tensor, tokenizer, events,
             release) -> None:
    """One trainer process: an ordinary MLM training loop around the collaborative optimizer."""
    import logging

    from dedloc.logs import configure
    from dedloc.optim import CollaborativeOptimizer, StepOutcome
    from dedloc.peer import Peer

    configure(spec["log_level"])
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    peer = Peer(PeerConfig(run_id=spec["run_id"], initial_peers=tuple(spec["initial_peers"]),
                           client_mode=spec["client"], log_level=spec["log_level"]), AVERAGING)
    try:
        model, micro_step = mlm_worker(cfg, blocks, tokenizer, index)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        warmup = max(1, cfg.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warmup, max(0.05, (cfg.steps - s) / max(1, cfg.steps - warmup))))
        copt = CollaborativeOptimizer(opt, peer, OptimizerConfig(target_batch_size=cfg.target_batch_size,
                                                                 delay_updates=cfg.delay_updates, clip_grad_norm=1.0),
                                      scheduler=sched, model=model)
        losses: dict[int, list[float]] = {}
        while copt.global_step < cfg.steps:
            loss = micro_step(spec["micro"])
            if spec["delay"]:
                time.sleep(spec["delay"])  # emulates a slower device
            acc = losses.setdefault(copt.global_step, [0.0, 0])
            acc[0] += loss * spec["micro"]
            acc[1] += spec["micro"]
            outcome = copt.step(spec["micro"])
            if outcome in (StepOutcome.STEPPED, StepOutcome.SKIPPED):
                s = copt.global_step - 1
                loss_sum, n = losses.pop(s, (0.0, 0))
                rec = copt.history[-1] if copt.history and not cfg.delay_updates else None
                events.put(("step", index, s, loss_sum, n, rec.batch if rec else None,
                            copt.samples_per_second))
            elif outcome == StepOutcome.RESYNCED:
                losses.clear()
                events.put(("resync", index, copt.global_step))
        copt.offer_state()  # the backbone takes the final checkpoint before we leave
        events.put(("final", index, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
                    [asdict(r) for r in copt.history]))
        release.wait(120)
        copt.close()
    except KeyboardInterrupt:
        pass
    except BaseException as e:
        events.put(("error", index, f"{type(e).__name__}: {e}"))
    finally:
        peer.close()


class _Display:
    def __init__(self, cfg: DemoConfig):
        self.cfg = cfg
        self.loss: dict[int, list[float]] = {}
        self.batch: dict[int, float] = {}
        self.sps: dict[int, float] = {}
        self.resyncs = 0
        self.view = None
        self.checkpoint = -1
        self.started = time.monotonic()

    def step_loss(self, s: int) -> float | None:
        total = self.loss.get(s)
        return total[0] / total[1] if total and total[1] else None

    def render(self):
        from rich.table import Table

        done = [s for s in self.loss if self.step_loss(s) is not None]
        step = max(done) + 1 if done else 0
        last = self.step_loss(max(done)) if done else None
        table = Table(title=f"dedloc demo: ALBERT MLM, {self.cfg.trainers} trainers + 1 backbone", expand=False)
        table.add_column("global step")
        table.add_column("loss")
        table.add_column("samples/s")
        table.add_column("batch")
        table.add_column("checkpoint")
        table.add_column("elapsed")
        table.add_row(f"{step}/{self.cfg.steps}", f"{last:.3f}" if last is not None else "-",
                      f"{sum(self.sps.values()):.0f}", f"{self.batch.get(step - 1, 0):.0f}",
                      str(self.checkpoint) if self.checkpoint >= 0 else "-",
                      f"{time.monotonic() - self.started:.0f} s")
        peers = Table(title="peers", expand=False)
        for col in ("peer", "role", "step", "samples", "samples/s"):
            peers.add_column(col)
        if self.view is not None:
            for r in self.view.peers:
                peers.add_row(r.peer_id[-8:], r.role.value, str(r.step), str(r.samples), f"{r.samples_per_second:.0f}")
        from rich.console import Group

        return Group(table, peers)


def run(cfg: DemoConfig, log_level: str = "WARNING") -> dict[str, Any]:
    """Run the demo; returns the summary (also written to ``cfg.out`` when set)."""
    import uuid

    from rich.console import Console
    from rich.live import Live

    from dedloc.demo.corpus import stdlib_docstrings, token_blocks, train_tokenizer
    from dedloc.roles.backbone import Backbone

    cfg.validate()
    console = Console()
    t0 = time.monotonic()
    with console.status("building the corpus and training the tokenizer"):
        texts = stdlib_docstrings(cfg.corpus_files)
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
        blocks = token_blocks(texts, tokenizer, cfg.seq_len)
    console.print(f"corpus: {len(texts)} stdlib docstrings, {len(blocks)} examples of {cfg.seq_len} tokens, "
                  f"vocabulary {len(tokenizer)} ({time.monotonic() - t0:.1f} s)")
    run_id = "demo-" + uuid.uuid4().hex[:8]
    ckpt_dir = Path(cfg.out) / "checkpoints" if cfg.out else Path(tempfile.mkdtemp(prefix="dedloc-demo-"))
    backbone = Backbone(PeerConfig(run_id=run_id, log_level=log_level),
                        BackboneConfig(checkpoint_dir=str(ckpt_dir), checkpoint_interval=5.0, resume=False),
                        AVERAGING)
    stop = threading.Event()
    pulling = threading.Thread(target=backbone.run, args=(stop,), name="backbone", daemon=True)
    pulling.start()
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    release = ctx.Event()
    procs = []
    display = _Display(cfg)
    finals: dict[int, Any] = {}
    histories: dict[int, list] = {}
    errors: list[str] = []
    try:
        for i in range(cfg.trainers):
            slow = i / max(1, cfg.trainers - 1)  # 0 for the fastest, 1 for the slowest
            spec = {"run_id": run_id, "initial_peers": backbone.maddrs, "client": i == cfg.trainers - 1,
                    "micro": cfg.micro_batch if i == 0 else max(1, cfg.micro_batch // 2),
                    "delay": cfg.slowdown * slow, "log_level": log_level}
            p = ctx.Process(target=_trainer, args=(i, spec, cfg, blocks, tokenizer, events, release),
                            name=f"trainer-{i}")
            p.start()
            procs.append(p)
        deadline = time.monotonic() + cfg.time_limit
        last_view = 0.0
        with Live(display.render(), console=console, refresh_per_second=4) as live:
            while len(finals) + len(errors) < cfg.trainers:
                if time.monotonic() > deadline:
                    raise DedlocError(f"the demo did not finish within {cfg.time_limit:.0f} s")
                if not any(p.is_alive() for p in procs) and events.empty():
                    raise DedlocError("every trainer exited before finishing")
                try:
                    ev = events.get(timeout=0.25)
                except queue_mod.Empty:
                    ev = None
                if ev is not None:
                    kind, index = ev[0], ev[1]
                    if kind == "step":
                        _, _, s, loss_sum, n, batch, sps = ev
                        acc = display.loss.setdefault(s, [0.0, 0])
                        acc[0] += loss_sum
                        acc[1] += n
                        if batch is not None:
                            display.batch[s] = batch
                        display.sps[index] = sps
                    elif kind == "resync":
                        display.resyncs += 1
                    elif kind == "final":
                        finals[index], histories[index] = ev[2], ev[3]
                    elif kind == "error":
                        errors.append(f"trainer {index}: {ev[2]}")
                if time.monotonic() - last_view > 1.0:
                    display.view, last_view = backbone.peer.collaboration(), time.monotonic()
                display.checkpoint = backbone.step
                live.update(display.render())
        console.print()  # the live table leaves the cursor on its last line
        if errors:
            raise DedlocError("; ".join(errors))
        stop.set()
        pulling.join(30)
        if backbone.pull():
            console.print(f"final checkpoint: step {backbone.step} in {ckpt_dir}")
    finally:
        stop.set()
        release.set()
        pulling.join(30)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)
        backbone.close()
    return _summarise(cfg, display, finals, histories, time.monotonic() - t0, console)


def _summarise(cfg: DemoConfig, display: _Display, finals: dict[int, Any], histories: dict[int, list],
               wall: float, console) -> dict[str, Any]:
    steps = sorted(s for s in display.loss if display.step_loss(s) is not None)
    curve = [display.step_loss(s) for s in steps]
    params = [torch.from_numpy(finals[i]) for i in sorted(finals)]
    diff = max((float((a - b).abs().max()) for i, a in enumerate(params) for b in params[i + 1:]), default=0.0)
    realised = {r["step"]: r["batch"] for h in histories.values() for r in h}
    batch_per_step = [realised.get(s, display.batch.get(s)) for s in steps]
    head = max(1, len(curve) // 10)
    summary = {
        "steps": len(steps), "loss_first": curve[0] if curve else None, "loss_last": curve[-1] if curve else None,
        "loss_first_avg": sum(curve[:head]) / head if curve else None,
        "loss_last_avg": sum(curve[-head:]) / head if curve else None,
        "peers": cfg.trainers + 1, "trainers": cfg.trainers, "backbones": 1, "client_mode_trainers": 1,
        "target_batch_size": cfg.target_batch_size, "batch_per_step": batch_per_step,
        "max_param_diff": diff, "resyncs": display.resyncs, "wall_s": round(wall, 1),
        "loss_per_step": curve, "config": asdict(cfg),
    }
    console.print(f"trained {len(steps)} global steps in {wall:.0f} s: loss {summary['loss_first']:.3f} -> "
                  f"{summary['loss_last']:.3f}; batch per step {min(b for b in batch_per_step if b)}-"
                  f"{max(b for b in batch_per_step if b):.0f} (target {cfg.target_batch_size}); "
                  f"largest parameter difference between peers {diff:.3g}")
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        _plot(steps, curve, out / "loss.png")
        console.print(f"wrote {out / 'summary.json'} and {out / 'loss.png'}")
    return summary


def _plot(steps: list[int], curve: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, curve, marker=".")
    ax.set_xlabel("global step")
    ax.set_ylabel("MLM loss")
    ax.set_title("dedloc demo: collaborative ALBERT pretraining")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
