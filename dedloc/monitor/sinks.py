"""Where the monitor also writes the collaboration's curves (optional): TensorBoard event files
(``MonitorConfig.tensorboard_dir``, needs the ``tensorboard`` package) and a Weights & Biases run
(``MonitorConfig.wandb_project``, needs ``wandb``). A sink named in the config whose package is
missing fails at start with the package to install; a sink that fails later is logged and closed,
never stopping the dashboard.

Each poll, :class:`Curves` hands every sink what is new: the collaboration's loss per global step
(once the step's losses are in), and samples/s and live peers at each new global step.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from dedloc.errors import ConfigError

logger = logging.getLogger(__name__)


class Sink(ABC):
    @abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at global step ``step`` (steps may arrive out of order across names)."""

    def close(self) -> None:
        pass


class TensorBoardSink(Sink):
    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("invalid config: tensorboard_dir needs the tensorboard package "
                              "(pip install tensorboard)") from None
        self.writer = SummaryWriter(log_dir)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"collaboration/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(Sink):
    def __init__(self, project: str, run_id: str):
        try:
            import wandb
        except ImportError:
            raise ConfigError("invalid config: wandb_project needs the wandb package (pip install wandb)") from None
        self.run = wandb.init(project=project, name=run_id, job_type="monitor")
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "global_step": step})

    def close(self) -> None:
        self.run.finish()


class Curves:
    """Feeds the sinks what each poll adds (collector state in, new points out)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self._loss_through = -1
        self._step = -1

    def update(self, state: dict[str, Any]) -> None:
        points: list[tuple[int, dict[str, float]]] = []
        for step, loss in zip(state["loss"]["step"][:-1], state["loss"]["loss"][:-1]):  # the newest may grow
            if step > self._loss_through:
                points.append((step, {"loss": loss}))
                self._loss_through = step
        speed = state["history"]["samples_per_second"]
        if state["step"] > self._step and speed:
            self._step = state["step"]
            points.append((self._step, {"samples_per_second": speed[-1][1], "peers": float(len(state["peers"]))}))
        for sink in list(self.sinks):
            try:
                for step, values in points:
                    sink.log(step, values)
            except Exception as e:
                logger.warning(f"{type(sink).__name__} failed ({type(e).__name__}: {e}); it is closed")
                self.sinks.remove(sink)
                self._close(sink)

    def close(self) -> None:
        for sink in self.sinks:
            self._close(sink)
        self.sinks = []

    @staticmethod
    def _close(sink: Sink) -> None:
        try:
            sink.close()
        except Exception as e:
            logger.debug(f"closing {type(sink).__name__}: {e!r}")


def make_sinks(tensorboard_dir: str, wandb_project: str, run_id: str) -> list[Sink]:
    """The sinks the config names (ConfigError naming the missing package)."""
    sinks: list[Sink] = []
    if tensorboard_dir:
        sinks.append(TensorBoardSink(tensorboard_dir))
    if wandb_project:
        sinks.append(WandbSink(wandb_project, run_id))
    return sinks


__all__ = ["Sink", "TensorBoardSink", "WandbSink", "Curves", "make_sinks"]
