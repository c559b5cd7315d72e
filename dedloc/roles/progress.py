"""The live progress table shared by ``dedloc train`` and ``dedloc demo`` (rich)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from dedloc.records import CollaborationView, label


@dataclass
class StepEvent:
    """One global step as one trainer saw it."""

    step: int
    loss_sum: float
    """Sum of this peer's per-sample losses over its micro-batches of this step."""
    samples: int
    """This peer's samples in the step."""
    batch: float | None
    """The realised global batch (None when not known yet, e.g. with delayed updates)."""
    samples_per_second: float


class LossCurve:
    """Mean loss per global step, pooled over every :class:`StepEvent` added (one trainer's, or several)."""

    def __init__(self) -> None:
        self.totals: dict[int, list[float]] = {}
        """Step -> [sum of per-sample losses, samples]."""

    def add(self, event: StepEvent) -> None:
        acc = self.totals.setdefault(event.step, [0.0, 0])
        acc[0] += event.loss_sum
        acc[1] += event.samples

    def curve(self) -> tuple[list[int], list[float]]:
        """(steps, their mean losses), the steps with at least one sample, in order."""
        steps = sorted(s for s, (_, n) in self.totals.items() if n)
        return steps, [self.totals[s][0] / self.totals[s][1] for s in steps]


class ProgressDisplay:
    """Loss per global step (pooled over the trainers that report to it), speed, batch, peers."""

    def __init__(self, title: str, total_steps: int | None = None, me: str = ""):
        """``me``: this peer's id (its row is marked), if it is one."""
        self.title, self.total_steps, self.me = title, total_steps, me
        self.loss = LossCurve()
        self.batch: dict[int, float] = {}
        self.sps: dict[Any, float] = {}
        self.resyncs = 0
        self.view: CollaborationView | None = None
        self.checkpoint = -1
        self.started = time.monotonic()
        self.mine = 0
        """Samples the reporting trainer(s) put into the steps shown (``dedloc train``: this peer's)."""
        self.first_step: int | None = None
        """The first global step seen: the ETA counts the pace from there."""

    def add(self, event: StepEvent, source: Any = 0) -> None:
        self.loss.add(event)
        if event.batch is not None:
            self.batch[event.step] = event.batch
        self.sps[source] = event.samples_per_second
        self.mine += event.samples
        if self.first_step is None:
            self.first_step = event.step

    def curve(self) -> tuple[list[int], list[float]]:
        return self.loss.curve()

    COLUMNS = ("global step", "loss", "samples/s", "batch", "my samples (share)", "checkpoint", "elapsed", "eta")

    def _row(self) -> tuple[str, ...]:
        """The table's first row (``COLUMNS``). ``my samples``: what this trainer put into the steps
        shown, and its share of their batches (known without delayed updates; ``-`` for a display of
        several trainers, the demo's); ``eta``: to
        ``total_steps`` at the pace since the first step shown."""
        steps, curve = self.curve()
        step = steps[-1] + 1 if steps else 0
        total = f"/{self.total_steps}" if self.total_steps else ""
        elapsed = time.monotonic() - self.started
        batches = sum(self.batch.get(s, 0.0) for s in steps)
        share = f" ({100 * self.mine / batches:.0f}%)" if batches > 0 and len(self.batch) >= len(steps) else ""
        eta = "-"
        if self.total_steps and self.first_step is not None and step > self.first_step + 1:
            pace = elapsed / (step - self.first_step)
            eta = f"{max(0, self.total_steps - step) * pace:.0f} s"
        return (f"{step}{total}", f"{curve[-1]:.3f}" if curve else "-", f"{sum(self.sps.values()):.0f}",
                f"{self.batch.get(step - 1, 0):.0f}", f"{self.mine}{share}" if self.me else "-",
                str(self.checkpoint) if self.checkpoint >= 0 else "-", f"{elapsed:.0f} s", eta)

    def line(self) -> str:
        """The table's first row as one line: what a log file gets (off a terminal nothing redraws the
        table; under nohup, tmux logging, docker or systemd the file stayed empty until exit)."""
        step, loss, sps, batch, mine, checkpoint, elapsed, eta = self._row()
        peers = len(self.view.peers) if self.view is not None else 0
        return (f"global step {step}: loss {loss}, {sps} samples/s, batch {batch}, {peers} peers, "
                + (f"mine {mine}, " if mine != "-" else "") + f"checkpoint {checkpoint}, {elapsed}"
                + (f", eta {eta}" if eta != "-" else ""))

    def render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text  # a name is the peer's own text: never read as markup

        table = Table(title=self.title, expand=False)
        for col in self.COLUMNS:
            table.add_column(col)
        table.add_row(*self._row())
        peers = Table(title="peers", expand=False)
        for col in ("peer", "role", "step", "samples", "samples/s"):
            peers.add_column(col)
        if self.view is not None:
            for r in self.view.peers:
                you = " (you)" if r.peer_id == self.me else ""
                peers.add_row(Text(label(r.peer_id, r.name) + you), r.role.value, str(r.step), str(r.samples), f"{r.samples_per_second:.0f}")
        return Group(table, peers)
