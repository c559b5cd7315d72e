"""A Hugging Face ``transformers.Trainer`` that trains collaboratively: swap the class, add a peer.

Example (an existing Trainer script, plus two lines)::

    peer = Peer(PeerConfig(run_id="my-run", initial_peers=[...]))
    trainer = CollaborativeTrainer(peer=peer, target_batch_size=4096,          # was: Trainer(
                                   model=model, args=TrainingArguments(..., max_steps=125_000),
                                   train_dataset=ds, data_collator=collator)
    trainer.train()

What follows the collaboration, not this peer's micro-batches:

- ``state.global_step`` is the collaboration's global step (``CollaborativeOptimizer``); a
  newcomer starts at the step it downloads, and ``max_steps`` counts global steps;
- the learning-rate schedule (the one ``args`` describes, or the one passed in ``optimizers``)
  is stepped once per global step, on every peer alike;
- ``logging_steps``, ``save_steps`` and ``eval_steps`` fire when the global step reaches a
  multiple, once (not on every micro-batch at that step); the logged loss is this peer's mean
  micro-batch loss since the last log;
- ``max_grad_norm`` clips the averaged gradient, once per global step (the Trainer's own
  per-micro-batch clipping is turned off: it would break large-batch equivalence).

Each micro-batch (``per_device_train_batch_size``) is one ``opt.step``; the collaboration
accumulates, so ``gradient_accumulation_steps`` must be 1 (ConfigError otherwise). fp16 loss
scaling through the Trainer is not supported yet (ConfigError); bf16 works. Errors from the
collaboration (StateError, RuntimeClosedError) propagate out of ``train()``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from dedloc.config import OptimizerConfig
from dedloc.errors import ConfigError
from dedloc.extras import require

transformers = require("transformers")
require("accelerate")


class _CollaborativeStep(torch.optim.Optimizer):
    """What the Trainer sees as its optimizer: ``step()`` hands one micro-batch to the collaboration."""

    def __init__(self, collaborative: Any):
        self.collaborative = collaborative
        inner = collaborative.opt
        self.defaults, self.param_groups, self.state = inner.defaults, inner.param_groups, inner.state
        self.batch_size = 0
        """Samples in the micro-batch whose gradients are in the parameters (set by training_step)."""

    def step(self, closure: Any = None) -> None:
        if self.batch_size > 0:
            self.collaborative.step(self.batch_size)
        self.batch_size = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.collaborative.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.collaborative.opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.collaborative.opt.load_state_dict(state_dict)


class _FollowsGlobalStep:
    """What the Trainer sees as its scheduler: stepping it does nothing (the collaborative optimizer
    steps the real one at each global step); it reports the real one's learning rates."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


class _GlobalStepCallback(transformers.TrainerCallback):
    """Runs after the Trainer's own flow callback and decides log/save/evaluate/stop by the global step."""

    def __init__(self, trainer: "CollaborativeTrainer"):
        self.trainer = trainer
        self.last = 0

    def on_train_begin(self, args, state, control, **kwargs):
        state.global_step = self.last = self.trainer.collaborative.global_step
        return control

    def on_step_end(self, args, state, control, **kwargs):
        step = self.trainer.collaborative.global_step
        advanced = step > self.last
        state.global_step, self.last = step, step

        def due(strategy: Any, every: float) -> bool:
            interval = int(every if every >= 1 else max(1, every * max(state.max_steps, 1)))
            return advanced and str(getattr(strategy, "value", strategy)) == "steps" and step % interval == 0

        control.should_log = due(args.logging_strategy, args.logging_steps) or (
            advanced and args.logging_first_step and step == 1)
        control.should_evaluate = due(args.eval_strategy, args.eval_steps or args.logging_steps)
        control.should_save = due(args.save_strategy, args.save_steps)
        control.should_training_stop = state.max_steps > 0 and step >= state.max_steps
        if control.should_training_stop and advanced:
            control.should_save = control.should_save or str(getattr(args.save_strategy, "value",
                                                                     args.save_strategy)) == "steps"
        return control


class CollaborativeTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose steps are the collaboration's; see the module docs."""

    def __init__(self, *args: Any, peer: Any, target_batch_size: int,
                 collaboration: OptimizerConfig | None = None, **kwargs: Any):
        from dedloc.optim import CollaborativeOptimizer

        super().__init__(*args, **kwargs)
        targs = self.args
        if targs.gradient_accumulation_steps != 1:
            raise ConfigError("invalid config: gradient_accumulation_steps must be 1 with CollaborativeTrainer "
                              "(the collaboration accumulates up to target_batch_size)")
        if targs.fp16:
            raise ConfigError("invalid config: fp16 through CollaborativeTrainer is not supported yet; use bf16")
        if targs.max_steps <= 0:
            raise ConfigError("invalid config: CollaborativeTrainer needs args.max_steps (global steps)")
        config = collaboration or OptimizerConfig()
        config = dataclasses.replace(config, target_batch_size=target_batch_size,
                                     clip_grad_norm=config.clip_grad_norm or (targs.max_grad_norm or None))
        targs.max_grad_norm = 0.0  # the collaborative optimizer clips the averaged gradient instead
        self.create_optimizer()
        inner_opt = self.optimizer
        inner_sched = self.lr_scheduler  # passed in `optimizers`, else the one `args` describes (built here,
        # not by create_scheduler, which the Trainer would rebuild on our wrapper at train())
        if inner_sched is None:
            inner_sched = transformers.get_scheduler(
                targs.lr_scheduler_type, optimizer=inner_opt, num_warmup_steps=targs.get_warmup_steps(targs.max_steps),
                num_training_steps=targs.max_steps, scheduler_specific_kwargs=targs.lr_scheduler_kwargs)
        self.collaborative = CollaborativeOptimizer(inner_opt, peer, config, scheduler=inner_sched, model=self.model)
        self._step = self.optimizer = _CollaborativeStep(self.collaborative)  # accelerate wraps self.optimizer
        self.lr_scheduler = _FollowsGlobalStep(inner_sched)
        # after the Trainer's flow callback (it counts micro-batches), before its progress and log printers
        self.callback_handler.callbacks.insert(1, _GlobalStepCallback(self))
        self._losses = [0.0, 0]
        self._by_step: dict[int, list[float]] = {}
        """Global step -> [sum of per-sample losses, samples] of this peer's micro-batches toward it."""

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        values = list(super().set_initial_training_values(args, dataloader))
        values[0] = sys.maxsize  # epochs: as many passes over the local data as the global steps take
        return tuple(values)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        step = self.collaborative.global_step
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step.batch_size = n = _batch_size(inputs)
        value = float(loss.detach().float().item())
        self._losses[0] += value
        self._losses[1] += 1
        acc = self._by_step.setdefault(step, [0.0, 0])
        acc[0] += value * n
        acc[1] += n
        for done in [s for s in self._by_step if s < step]:  # published with the next progress record
            total, count = self._by_step.pop(done)
            self.collaborative.note_loss(done, total / count, count)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._losses[1]:
            logs["loss"] = self._losses[0] / self._losses[1]
            self._losses = [0.0, 0]
        logs.setdefault("global_step", self.collaborative.global_step)
        super().log(logs, start_time)


def _batch_size(inputs: dict[str, Any]) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ConfigError("cannot tell the micro-batch size: no tensor input with a batch dimension")
