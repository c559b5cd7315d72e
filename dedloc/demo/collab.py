"""`dedloc demo`: a local collaboration pretraining a small ALBERT with masked-language modelling.

A backbone peer (in this process) and several ``dedloc train`` peers (trainer processes running
:class:`~dedloc.roles.trainer.Trainer` on the tiny-mlm recipe, of different speeds, one in client
mode) train one model. The data path is a real run's: the corpus (the standard library's
docstrings) is written as a JSON-lines file, the tokenizer is trained from it as
``dedloc tokenizer`` does, and every trainer streams it through ``datasets`` in its own shuffled
order. The terminal shows live progress; ``out`` receives ``loss.png`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue as queue_mod
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dedloc.config import AveragingConfig, BackboneConfig, PeerConfig
from dedloc.data.mlm import DataConfig
from dedloc.errors import ConfigError, DedlocError
from dedloc.files import make_dir
from dedloc.recipes.mlm import MLMRecipe


def _opt(help: str, **kw: Any) -> Any:
    return field(metadata={"help": help}, **kw)


@dataclass
class DemoConfig:
    """What the demo runs; every field is also a ``dedloc demo --option`` (and so is every field of
    the tiny-mlm recipe, :class:`~dedloc.recipes.mlm.MLMRecipe`)."""

    trainers: int = _opt("trainer peers (the last one runs in client mode)", default=3)
    steps: int = _opt("global optimizer steps to train (the learning-rate schedule spans them)", default=60)
    slowdown: float = _opt("extra seconds per micro-batch on the slowest trainer (speeds differ)", default=0.15)
    corpus_files: int = _opt("standard-library files to read docstrings from", default=1500)
    out: str | None = _opt("write loss.png and summary.json (and the corpus, tokenizer and checkpoints) "
                           "into this directory", default=None)
    time_limit: float = _opt("give up after this many seconds", default=900.0)
    dashboard_port: int = _opt("serve the run's dashboard (as `dedloc monitor` does) on this port of 127.0.0.1 "
                               "(0: any free port, -1: none)", default=0)
    invite_only: bool = _opt("run invite-only: the demo is the run's owner (`dedloc run init` in OUT/run), invites "
                             "the backbone and every trainer by peer id, and each checks the others' invitations",
                             default=False)

    def validate(self) -> "DemoConfig":
        if self.trainers < 2:
            raise ConfigError("invalid config: trainers must be >= 2")
        if self.steps < 1:
            raise ConfigError("invalid config: steps must be >= 1")
        BackboneConfig(dashboard_port=self.dashboard_port).validate()  # the backbone serves it: its check, now
        if self.slowdown < 0 or self.corpus_files < 1:
            raise ConfigError("invalid config: slowdown must be >= 0 and corpus_files >= 1")
        return self


AVERAGING = AveragingConfig(matchmaking_time=2.0, averaging_timeout=30.0)


def _trainer(index: int, spec: dict[str, Any], recipe: MLMRecipe, data: DataConfig, events, release) -> None:
    """One trainer process: ``dedloc train``'s peer (:class:`~dedloc.roles.trainer.Trainer`), reporting here."""
    import logging

    from dedloc.logs import configure
    from dedloc.roles.trainer import TrainConfig, Trainer

    configure(spec["log_level"])
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    trainer = None
    try:
        trainer = Trainer(TrainConfig(tokenizer=spec["tokenizer"], state_dir=spec["state_dir"],
                                      max_steps=spec["steps"], throttle=spec["delay"]),
                          dataclasses.replace(recipe, micro_batch=spec["micro"]), data,
                          PeerConfig(run_id=spec["run_id"], initial_peers=tuple(spec["initial_peers"]),
                                     client_mode=spec["client"], log_level=spec["log_level"], **spec["membership"]),
                          AVERAGING)
        trainer.run(on_step=lambda e: events.put(("step", index, e)),
                    on_resync=lambda step: events.put(("resync", index, step)))
        trainer.opt.offer_state()  # the backbone takes the final checkpoint before we leave
        trainer.opt.report()  # and sees that we hold it (the last record named the step before)
        events.put(("final", index, trainer.parameters_vector().numpy(),
                    [dataclasses.asdict(r) for r in trainer.opt.history]))
        release.wait(120)
    except KeyboardInterrupt:
        pass
    except BaseException as e:
        events.put(("error", index, f"{type(e).__name__}: {e}"))
    finally:
        if trainer is not None:
            trainer.close()


def _inviter(workdir: Path, run_id: str):
    """The owner's side, as `dedloc run init` and `dedloc invite` do it: a function from a peer's identity
    file (created if missing) to the PeerConfig fields that make it an invited member."""
    from dedloc.auth.invitation import RunOwner
    from dedloc.roles.membership import identity

    owner = RunOwner.init(str(workdir / "run"), run_id)

    def invite(path: Path) -> dict[str, Any]:
        peer_id = identity(str(path))
        backbone = path.name == "backbone.key"
        return {"owner": owner.public, "invite": owner.invite(peer_id, 86400.0, backbone), "identity_path": str(path),
                "revocations": str(workdir / "run" / "revoked") if backbone else ""}

    return invite


def prepare(cfg: DemoConfig, recipe: MLMRecipe, workdir: Path, console) -> tuple[Path, Path]:
    """Write the corpus and train the tokenizer from it (as ``dedloc tokenizer`` does): (corpus, tokenizer)."""
    from dedloc.data.sources import open_sources
    from dedloc.data.tokenizer import save_tokenizer, train_tokenizer
    from dedloc.demo.corpus import write_corpus

    t0 = time.monotonic()
    corpus, tok_dir = workdir / "corpus.jsonl", workdir / "tokenizer"
    with console.status("building the corpus and training the tokenizer"):
        n = write_corpus(corpus, cfg.corpus_files)
        tokenizer = train_tokenizer((e["text"] for e in open_sources([str(corpus)])), recipe.vocab_size)
        save_tokenizer(tokenizer, str(tok_dir))
    console.print(f"corpus: {n} stdlib docstrings in {corpus}; tokenizer: vocabulary {len(tokenizer)} "
                  f"({time.monotonic() - t0:.1f} s)")
    return corpus, tok_dir


def run(cfg: DemoConfig, recipe: MLMRecipe | None = None, log_level: str = "WARNING") -> dict[str, Any]:
    """Run the demo; returns the summary (also written to ``cfg.out`` when set)."""
    import uuid

    from rich.console import Console
    from rich.live import Live

    from dedloc.roles.backbone import Backbone
    from dedloc.roles.progress import ProgressDisplay

    cfg.validate()
    recipe = dataclasses.replace(recipe or MLMRecipe(), total_steps=cfg.steps,
                                 warmup_steps=max(1, cfg.steps // 10)).validate()
    console = Console()
    t0 = time.monotonic()
    workdir = Path(cfg.out) if cfg.out else Path(tempfile.mkdtemp(prefix="dedloc-demo-"))
    make_dir(workdir, "--out")
    corpus, tok_dir = prepare(cfg, recipe, workdir, console)
    data = DataConfig(data=(str(corpus),), shuffle_buffer=256, data_workers=1)
    run_id = "demo-" + uuid.uuid4().hex[:8]
    ckpt_dir = workdir / "checkpoints"
    invite = _inviter(workdir, run_id) if cfg.invite_only else (lambda identity: {})
    backbone = Backbone(PeerConfig(run_id=run_id, log_level=log_level, **invite(workdir / "backbone.key")),
                        BackboneConfig(checkpoint_dir=str(ckpt_dir), checkpoint_interval=5.0, resume=False,
                                       dashboard_port=cfg.dashboard_port),
                        AVERAGING)
    if backbone.dashboard is not None:
        console.print(f"dashboard: {backbone.dashboard.url}")
    pulling = backbone.in_background()
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    release = ctx.Event()
    procs = []
    display = ProgressDisplay(f"dedloc demo: ALBERT MLM, {cfg.trainers} trainers + 1 backbone", cfg.steps)
    finals: dict[int, Any] = {}
    histories: dict[int, list] = {}
    errors: list[str] = []
    try:
        for i in range(cfg.trainers):
            slow = i / max(1, cfg.trainers - 1)  # 0 for the fastest, 1 for the slowest
            spec = {"run_id": run_id, "initial_peers": backbone.maddrs, "client": i == cfg.trainers - 1,
                    "micro": recipe.micro_batch if i == 0 else max(1, recipe.micro_batch // 2),
                    "delay": cfg.slowdown * slow, "log_level": log_level, "steps": cfg.steps,
                    "tokenizer": str(tok_dir), "state_dir": str(workdir / f"trainer-{i}"),
                    "membership": invite(workdir / f"trainer-{i}" / "identity.key")}
            p = ctx.Process(target=_trainer, args=(i, spec, recipe, data, events, release), name=f"trainer-{i}")
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
                        display.add(ev[2], source=index)
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
        pulling.stop()
        if backbone.pull():
            console.print(f"final checkpoint: step {backbone.step} in {ckpt_dir}")
    finally:
        release.set()
        pulling.stop()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)
        backbone.close()
    return _summarise(cfg, recipe, display, finals, histories, time.monotonic() - t0, console)


def _summarise(cfg: DemoConfig, recipe: MLMRecipe, display, finals: dict[int, Any], histories: dict[int, list],
               wall: float, console) -> dict[str, Any]:
    from dedloc.roles.report import loss_summary, write_outputs

    steps, curve = display.curve()
    params = [torch.from_numpy(finals[i]) for i in sorted(finals)]
    diff = max((float((a - b).abs().max()) for i, a in enumerate(params) for b in params[i + 1:]), default=0.0)
    realised = {r["step"]: r["batch"] for h in histories.values() for r in h}
    batch_per_step = [realised.get(s, display.batch.get(s)) for s in steps]
    local = {(i, r["step"]): r["local_samples"] for i, h in histories.items() for r in h}
    samples_per_trainer = [[local.get((i, s)) for i in sorted(histories)] for s in steps]
    summary = {
        "steps": len(steps), **loss_summary(curve),
        "peers": cfg.trainers + 1, "trainers": cfg.trainers, "backbones": 1, "client_mode_trainers": 1,
        "target_batch_size": recipe.target_batch_size, "batch_per_step": batch_per_step,
        "samples_per_trainer": samples_per_trainer,
        "max_param_diff": diff, "resyncs": display.resyncs, "wall_s": round(wall, 1), "invite_only": cfg.invite_only,
        "loss_per_step": curve, "config": dataclasses.asdict(cfg), "recipe": dataclasses.asdict(recipe),
    }
    known = [b for b in batch_per_step if b]
    console.print(f"trained {len(steps)} global steps in {wall:.0f} s: loss {summary['loss_first']:.3f} -> "
                  f"{summary['loss_last']:.3f}; batch per step {min(known, default=0):.0f}-{max(known, default=0):.0f}"
                  f" (target {recipe.target_batch_size}); largest parameter difference between peers {diff:.3g}")
    if cfg.out:
        paths = write_outputs(cfg.out, summary, steps, curve, "dedloc demo: collaborative ALBERT pretraining")
        console.print(f"wrote {paths[0]} and {paths[1]}")
    return summary
