"""A training run's outputs: ``summary.json`` and ``loss.png`` in the ``--out`` directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dedloc.files import make_dir


def write_outputs(out: str, summary: dict[str, Any], steps: list[int], curve: list[float], title: str) -> list[Path]:
    """Write ``summary.json`` and the loss curve ``loss.png`` into ``out`` (created); returns the paths."""
    path = make_dir(out, "--out")
    (path / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_loss(steps, curve, path / "loss.png", title)
    return [path / "summary.json", path / "loss.png"]


def plot_loss(steps: list[int], curve: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, curve, marker=".")
    ax.set_xlabel("global step")
    ax.set_ylabel("MLM loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def loss_summary(curve: list[float]) -> dict[str, float | None]:
    """First and last loss, and the means of the first and last tenth of the curve."""
    head = max(1, len(curve) // 10)
    return {"loss_first": curve[0] if curve else None, "loss_last": curve[-1] if curve else None,
            "loss_first_avg": sum(curve[:head]) / head if curve else None,
            "loss_last_avg": sum(curve[-head:]) / head if curve else None}
