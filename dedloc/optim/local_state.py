"""The state a peer holds: parameters, inner optimizer, scheduler, loss scale, the applied step, and
the fingerprints of the steps these parameters went through (their lineage).

Everything that changes the parameters' identity goes through ``advance`` (an update or a skip
was applied) or ``load`` (a state was downloaded or restored), so the applied step, the
fingerprint and the lineage never disagree. What a peer may adopt is decided in
optim/state_sync.py; when a step is taken, in optim/optimizer.py.
"""

from __future__ import annotations

from typing import Any

import torch

from dedloc.errors import StateError
from dedloc.optim.scaling import CollaborativeScale
from dedloc.state import lineage, snapshot


class LocalState:
    """This peer's model and optimizer state, and the step and fingerprint they are at."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: torch.nn.Module | None, scheduler: Any,
                 scale: CollaborativeScale | None, verify: bool):
        self.opt, self.model, self.scheduler, self.scale = optimizer, model, scheduler, scale
        self.verify = verify
        """Whether fingerprints are computed (``OptimizerConfig.verify_sync``); "" otherwise."""
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.applied_step = 0
        """How many global updates the parameters have received."""
        self.fingerprint = self.hash()
        self.lineage = lineage.extend({}, self.fingerprint)
        """Fingerprints of the recent steps these parameters went through (travels with the state)."""

    def nbytes(self) -> int:
        """Bytes of the parameters (and buffers, with a model): what a state download scales with."""
        tensors = list(self.model.parameters()) + list(self.model.buffers()) if self.model is not None else self.params
        return sum(t.numel() * t.element_size() for t in tensors)

    def hash(self) -> str:
        """The fingerprint of the parameters as they are now, at ``applied_step``."""
        if not self.verify:
            return ""
        return f"{self.applied_step}:{snapshot.fingerprint(self.params)}"

    def advance(self, step: int) -> None:
        """The update of ``step`` was applied (or skipped by all): the parameters are at ``step + 1``."""
        self.applied_step = step + 1
        self.fingerprint = self.hash()
        self.lineage = lineage.extend(self.lineage, self.fingerprint)

    def identity(self) -> tuple[int, str]:
        """What identifies the state held (its applied step and parameters' fingerprint)."""
        return self.applied_step, self.fingerprint

    def history(self) -> list[str]:
        """The lineage's fingerprints, oldest first (what an offered state carries)."""
        return [f for _, f in sorted(self.lineage.items())]

    def fingerprint_of(self, state: dict[str, Any]) -> str | None:
        """The fingerprint these parameters would have after loading ``state`` (None: cannot tell)."""
        try:
            if self.model is not None:
                names = {id(p): n for n, p in self.model.named_parameters()}
                tensors = [state["model"][names[id(p)]] for p in self.params]
            else:
                tensors = list(state["params"])
            return f"{int(state['step'])}:{snapshot.fingerprint(tensors)}"
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def state_dict(self) -> dict[str, Any]:
        """Everything a peer needs to continue from here: parameters, optimizer, scheduler, scale, step."""
        state: dict[str, Any] = {"step": self.applied_step, "optimizer": self.opt.state_dict(),
                                 "lineage": dict(self.lineage)}
        if self.model is not None:
            state["model"] = self.model.state_dict()
        else:
            state["params"] = [p.detach() for p in self.params]
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scale is not None:
            state["scaler"] = self.scale.state_dict()
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` (or a download); raises StateError if it does not fit."""
        try:
            self._load(state)
        except StateError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise StateError(f"the state does not fit this model/optimizer: {type(e).__name__}: {e}") from None

    def _load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            if self.model is not None:
                if "model" not in state:
                    raise StateError("the downloaded state has no model weights")
                self.model.load_state_dict(state["model"])
            else:
                params = state.get("params")
                if not isinstance(params, list) or len(params) != len(self.params) or any(
                        a.shape != b.shape for a, b in zip(params, self.params)):
                    raise StateError("the downloaded state's parameters do not match this model")
                for p, v in zip(self.params, params):
                    p.copy_(v)
        self.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scale is not None and "scaler" in state:
            self.scale.load_state_dict(state["scaler"])
        self.applied_step = int(state["step"])
        self.fingerprint = self.hash()
        self.lineage = lineage.extend(lineage.of_state(state), self.fingerprint)

    def zero_grads(self) -> None:
        for p in self.params:
            p.grad = None


__all__ = ["LocalState"]
