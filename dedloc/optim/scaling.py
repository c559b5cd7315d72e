"""Loss scaling shared by the whole collaboration (mixed precision with torch.amp.GradScaler).

Each peer scales its own loss; the scale changes only at global steps: after a step in which this
peer's accumulated gradient overflowed (its samples were left out of the step, the others' made
it), it backs off; after ``growth_interval`` steps without, it grows. A peer that joins takes its
donor's scale. Scales may differ between peers; parameters do not (gradients are unscaled before
averaging). An overflow elsewhere is no business of this peer's scale (nor of the step: one
member claiming an overflow must not make every peer skip it).
"""

from __future__ import annotations

from typing import Any

import torch


class CollaborativeScale:
    def __init__(self, scaler: "torch.amp.GradScaler"):
        self.scaler = scaler
        self.good_steps = 0

    @property
    def enabled(self) -> bool:
        return self.scaler.is_enabled()

    def current(self) -> float:
        """The scale the last backward used (1.0 when disabled or before the first ``scale()``)."""
        if not self.enabled or getattr(self.scaler, "_scale", None) is None:
            return 1.0
        return float(self.scaler.get_scale())

    def update(self, overflow: bool) -> None:
        if not self.enabled or getattr(self.scaler, "_scale", None) is None:
            return
        scale = self.current()
        if overflow:
            self.good_steps = 0
            scale *= self.scaler.get_backoff_factor()
        else:
            self.good_steps += 1
            if self.good_steps >= self.scaler.get_growth_interval():
                self.good_steps = 0
                scale *= self.scaler.get_growth_factor()
        self.scaler.update(new_scale=scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.current(), "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.good_steps = int(state.get("good_steps", 0))
        if self.enabled and getattr(self.scaler, "_scale", None) is not None:
            self.scaler.update(new_scale=float(state["scale"]))
        elif self.enabled:
            self.scaler._init_scale = float(state["scale"])  # applied when the scaler first scales a loss
