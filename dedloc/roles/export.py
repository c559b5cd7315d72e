"""``dedloc export``: a backbone checkpoint as a model people can use, in transformers' own format.

The checkpoint's model weights (``state-*.pt``, or the newest in a checkpoint directory) go into
the recipe's model (``AlbertForMaskedLM`` for the MLM recipes) and out with ``save_pretrained``,
beside the run's tokenizer; ``AutoModelForMaskedLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` load them, and the directory can be pushed to the Hub as is.
A checkpoint that does not fit the recipe (another shape or vocabulary) is refused by name, with
the first tensors that differ; nothing is written then.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dedloc.errors import ConfigError, DataError
from dedloc.recipes.mlm import MLMRecipe


@dataclass
class ExportConfig:
    """What to export, and where."""

    checkpoint: str = ""
    """A backbone checkpoint (state-*.pt) or a checkpoint directory (its newest)."""
    tokenizer: str = ""
    """The run's tokenizer directory (saved beside the model)."""
    out: str = "dedloc-model"
    """The model directory to write (config.json, model.safetensors, the tokenizer's files)."""

    def validate(self) -> "ExportConfig":
        for name in ("checkpoint", "tokenizer", "out"):
            if not getattr(self, name):
                raise ConfigError(f"invalid config: --{name} is required")
        return self


def export(config: ExportConfig, recipe: MLMRecipe) -> dict:
    """Write the model directory; returns what was written (step, tensors, path)."""
    from dedloc.data.tokenizer import load_tokenizer
    from dedloc.files import make_dir
    from dedloc.state.checkpoint import model_weights

    config.validate()
    tokenizer = load_tokenizer(config.tokenizer)
    weights = model_weights(config.checkpoint)
    model = recipe.build_model(len(tokenizer))
    expected = model.state_dict()
    wrong = [k for k, v in weights.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    missing = [k for k in expected if k not in weights]
    unknown = [k for k in weights if k not in expected]
    if wrong or missing or unknown:
        what = (f"shapes differ for {wrong[:3]} (checkpoint {[tuple(weights[k].shape) for k in wrong[:3]]}, "
                f"recipe {[tuple(expected[k].shape) for k in wrong[:3]]})" if wrong else
                f"the recipe's model has {missing[:3]}, the checkpoint does not" if missing else
                f"the checkpoint has {unknown[:3]}, the recipe's model does not")
        raise DataError(f"--checkpoint {config.checkpoint!r} does not fit this recipe's model with the "
                        f"tokenizer's {len(tokenizer)} tokens: {what}. Export with the run's recipe options "
                        f"(--join TOKEN) and tokenizer")
    model.load_state_dict(weights)
    out = make_dir(config.out, "--out")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "dedloc.json"), "w") as f:
        json.dump({"checkpoint": os.path.abspath(config.checkpoint), "tensors": len(weights)}, f, indent=2)
    return {"out": str(out), "tensors": len(weights), "parameters": sum(p.numel() for p in model.parameters())}


__all__ = ["ExportConfig", "export"]
