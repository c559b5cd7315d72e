"""A training peer (``dedloc train``): joins a run and trains the recipe's model on its own data stream.

Guarantees:
- *One identity across restarts.* The peer's key and its data position live in ``state_dir``; a
  restarted peer has the same peer id, downloads the collaboration's current state (parameters,
  optimizer, schedule, step) from a peer, and continues its data after the last micro-batch it
  took: it does not replay samples it already contributed (the few waiting in the shuffle buffer
  or in a partly used text are dropped instead).
- *Large-batch equivalence* and identical parameters across peers: those of
  :class:`~dedloc.optim.CollaborativeOptimizer`.
- The model never waits for text processing while the DataLoader workers keep up: reading,
  tokenizing and masking run ``data_workers`` processes ahead.

Failure behaviour: a missing tokenizer, an unreadable or empty source, or a bad option fails at
start with a :class:`~dedloc.errors.DedlocError` naming it, before the peer joins. A peer that
cannot get the state raises ``StateError`` from :meth:`Trainer.run`. :meth:`Trainer.close` stops the
DataLoader workers and the peer's background process (also after a failure or Ctrl+C).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dedloc.files import hold_dir, make_dir
from dedloc.config import AveragingConfig, OptimizerConfig, PeerConfig
from dedloc.data.mlm import BatchSpec, DataConfig, loader
from dedloc.errors import ConfigError
from dedloc.recipes.mlm import MLMRecipe
from dedloc.roles.progress import LossCurve, StepEvent

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """How this peer trains (the recipe says what): its tokenizer, its files, when it stops."""

    recipe: str = "tiny-mlm"
    """The recipe: tiny-mlm (the demo's small ALBERT) or albert-mlm (sahajBERT's ALBERT-large)."""
    tokenizer: str | None = None
    """The run's tokenizer: a directory written by `dedloc tokenizer` (or a tokenizer.json)."""
    state_dir: str | None = None
    """Keeps this peer's identity key and data position across restarts (default: dedloc-state/RUN_ID)."""
    max_steps: int | None = None
    """Stop once the collaboration has taken this many global steps (None: run until Ctrl+C)."""
    out: str | None = None
    """Write loss.png and summary.json into this directory at the end."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:N' or 'mps' (Apple GPUs, fp32 or
    bf16; not covered by this project's CI, which has no Apple hardware)."""
    handover_timeout: float = 90.0
    """After the last step (--max-steps), keep serving this peer's state for up to this many seconds,
    until a backbone has checkpointed it (0: leave at once)."""
    throttle: float = 0.0
    """Extra seconds after each micro-batch: emulates a slower device (for demos and tests)."""

    def validate(self) -> "TrainConfig":
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError("invalid config: max_steps must be >= 1")
        if self.handover_timeout < 0:
            raise ConfigError("invalid config: handover_timeout must be >= 0")
        if self.throttle < 0:
            raise ConfigError("invalid config: throttle must be >= 0")
        if not (self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:")):
            raise ConfigError(f"invalid config: device must be auto, cpu, cuda, cuda:N or mps (got {self.device!r})")
        return self


def state_dir_of(state_dir: str | None, run_id: str) -> str:
    """A peer's state directory: ``state_dir``, or ``dedloc-state/RUN_ID`` (train's default, which
    ``doctor``, ``ledger --peer me`` and ``identity`` look in too)."""
    return state_dir or os.path.join("dedloc-state", run_id)


def on_defaults(peer_config: PeerConfig) -> list[str]:
    """Warnings for a training peer left on defaults that a run should not share by accident (none in
    a run on this machine alone: its initial peers all on loopback, as the demo's)."""
    out: list[str] = []
    if peer_config.initial_peers and all(a.startswith(("/ip4/127.", "/ip6/::1/")) for a in peer_config.initial_peers):
        return out
    if peer_config.run_id == PeerConfig.run_id:
        out.append(f"--run-id is the default {PeerConfig.run_id!r}: any run started without one has the same id, "
                   f"and their peers would meet; give the run its own (the organiser's --join line sets it)")
    if not peer_config.owner and peer_config.initial_peers:
        out.append("an open run (no --owner): any peer that knows its id and an address may take part and "
                   "send gradients (docs/security.md; `dedloc run init` makes it invite-only)")
    return out


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"invalid config: device {name!r}, but CUDA is not available here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("invalid config: device 'mps', but this torch build or machine has no Apple GPU (MPS)")
    return device


def pick_precision(name: str, device: torch.device) -> str:
    """'fp32', 'fp16' (CUDA, with loss scaling) or 'bf16' (autocast)."""
    if name == "auto":
        return "fp16" if device.type == "cuda" else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ConfigError(f"invalid config: precision fp16 needs a CUDA device (its loss scaler is CUDA's; use bf16 "
                          f"or fp32 on {device.type})")
    return name


class Trainer:
    """One training peer; see the module docs for its guarantees."""

    def __init__(self, config: TrainConfig, recipe: MLMRecipe, data: DataConfig, peer_config: PeerConfig,
                 averaging: AveragingConfig | None = None):
        self.config, self.recipe, self.data = config.validate(), recipe.validate(), data.validate()
        self.state_dir = state_dir_of(config.state_dir, peer_config.run_id)
        make_dir(self.state_dir, "--state-dir")
        self._held = hold_dir(self.state_dir, "--state-dir")  # its identity, data position and state are this peer's
        try:
            self._start(config, recipe, data, peer_config, averaging)
        except BaseException:
            self._held.close()
            raise

    def _start(self, config: TrainConfig, recipe: MLMRecipe, data: DataConfig, peer_config: PeerConfig,
               averaging: AveragingConfig | None) -> None:
        from dedloc.data.position import DataPosition
        from dedloc.data.sources import first_text
        from dedloc.data.stream import peer_seed
        from dedloc.data.tokenizer import load_tokenizer
        from dedloc.optim import CollaborativeOptimizer
        from dedloc.peer import Peer
        from dedloc.roles.manifest import recipe_hash

        if peer_config.identity_path is None:
            peer_config = dataclasses.replace(peer_config, identity_path=os.path.join(self.state_dir, "identity.key"))
        self.device = pick_device(config.device)
        self.precision = pick_precision(recipe.precision, self.device)
        tokenizer = load_tokenizer(config.tokenizer)
        if not data.data:
            raise ConfigError("invalid config: no training data: name at least one source with --data")
        for spec in data.data:
            first_text(spec, data.text_column)
        averaging = dataclasses.replace(averaging or AveragingConfig(), compression=recipe.wire)
        self.peer = Peer(peer_config, averaging)
        if not peer_config.initial_peers:
            logger.warning(f"no --initial-peers: this peer starts run {peer_config.run_id!r} alone; others join "
                           f"with --initial-peers {' '.join(self.peer.maddrs) or '(none: this peer accepts no connections)'}")
        for warning in on_defaults(peer_config):
            logger.warning(warning)
        self.batches: Any = None
        self.opt: Any = None
        try:
            key = {"data": list(data.data), "weights": list(data.data_weights), "text_column": data.text_column,
                   "seed": data.data_seed, "workers": data.data_workers,
                   "tokenizer": os.path.abspath(config.tokenizer), "seq_len": recipe.seq_len}
            self.position = DataPosition(os.path.join(self.state_dir, "data-position.json"), key)
            spec = BatchSpec(config.tokenizer, recipe.seq_len, recipe.micro_batch, recipe.mlm_probability,
                             seed=peer_seed(self.peer.peer_id, data.data_seed), positions=self.position.load())
            self.batches = iter(loader(data, spec, pin_memory=self.device.type == "cuda"))
            self.model = recipe.build_model(len(tokenizer)).to(self.device)
            optimizer = recipe.build_optimizer(self.model)
            self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
            self.opt = CollaborativeOptimizer(
                optimizer, self.peer, OptimizerConfig(target_batch_size=recipe.target_batch_size,
                                                      delay_updates=recipe.delay_updates,
                                                      clip_grad_norm=recipe.clip_grad_norm,
                                                      run_hash=recipe_hash(recipe)),
                scheduler=recipe.build_scheduler(optimizer), scaler=self.scaler, model=self.model)
        except BaseException:
            self.close()
            raise
        self.losses = LossCurve()
        """Mean loss of every global step this peer took part in."""
        self.resyncs = 0
        logger.info(f"training {config.recipe} on {self.device} ({self.precision}) as {self.peer.peer_id}, "
                    f"global step {self.opt.global_step}; data: {', '.join(data.data)}")

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    def run(self, stop: threading.Event | None = None, on_step: Callable[[StepEvent], None] | None = None,
            on_resync: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Train until ``max_steps`` global steps are taken or ``stop`` is set; returns a summary.

        ``on_step`` is called from this thread after every global step this peer took part in,
        ``on_resync`` after every state download that dropped its gradients."""
        from dedloc.optim import StepOutcome

        started = time.monotonic()
        losses: dict[int, list[float]] = {}
        max_steps, opt = self.config.max_steps, self.opt
        autocast = self.precision in ("fp16", "bf16")
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        try:
            while not (stop is not None and stop.is_set()) and (max_steps is None or opt.global_step < max_steps):
                batch = next(self.batches)
                input_ids = batch["input_ids"].to(self.device, non_blocking=True)
                labels = batch["labels"].to(self.device, non_blocking=True)
                with torch.autocast(self.device.type, dtype=dtype, enabled=autocast):
                    loss = self.model(input_ids=input_ids, labels=labels).loss
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                if self.config.throttle:
                    time.sleep(self.config.throttle)
                n = int(input_ids.shape[0])
                acc = losses.setdefault(opt.global_step, [0.0, 0])
                acc[0] += float(loss.item()) * n
                acc[1] += n
                outcome = opt.step(n)
                self.position.took(batch, n)
                if outcome in (StepOutcome.STEPPED, StepOutcome.SKIPPED):
                    step = opt.global_step - 1
                    loss_sum, count = losses.pop(step, (0.0, 0))
                    record = opt.history[-1] if opt.history and not self.recipe.delay_updates else None
                    event = StepEvent(step, loss_sum, count, record.batch if record else None, opt.samples_per_second)
                    if count:
                        opt.note_loss(step, loss_sum / count, count)
                    self.losses.add(event)
                    self.position.save()
                    if on_step is not None:
                        on_step(event)
                elif outcome == StepOutcome.RESYNCED:
                    losses.clear()
                    self.resyncs += 1
                    if on_resync is not None:
                        on_resync(opt.global_step)
        finally:
            self.position.save()
        return self.summary(time.monotonic() - started)

    def hand_over(self, stop: threading.Event | None = None) -> bool:
        """Before a planned exit: serve this peer's state until a backbone holds its step (True), or
        until there is no backbone, ``handover_timeout`` passes or ``stop`` is set (False)."""
        from dedloc.optim.hand_on import hand_on

        return hand_on(self.opt, self.config.handover_timeout, stop, backbone=True)

    def summary(self, wall: float) -> dict[str, Any]:
        from dedloc.roles.report import loss_summary

        import hashlib

        steps, curve = self.losses.curve()

        digest = hashlib.sha256(self.parameters_vector().numpy().tobytes()).hexdigest()
        return {"peer_id": self.peer.peer_id, "global_step": self.opt.global_step, "steps": steps,
                "parameters_sha256": digest,
                "loss_per_step": curve, **loss_summary(curve), "resyncs": self.resyncs,
                "samples": self.position.samples, "device": str(self.device), "precision": self.precision,
                "wall_s": round(wall, 1), "recipe": dataclasses.asdict(self.recipe),
                "config": dataclasses.asdict(self.config), "data": dataclasses.asdict(self.data)}

    def parameters_vector(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.model.parameters()])

    def close(self) -> None:
        """Leave the collaboration, stop the DataLoader workers and the peer's background process."""
        try:
            if self.opt is not None:
                self.opt.close()
        finally:
            batches, self.batches = self.batches, None
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            try:
                self.peer.close()
            finally:
                self._held.close()
