"""Masked-language-model pretraining recipes (ALBERT, randomly initialised from a config).

A recipe fixes everything the peers of one run must agree on: the model's shape, the optimizer
and its schedule, the global batch, the sequence length and the precision on the wire. Every
field is a ``dedloc train`` option, with the recipe's value as its default.

- ``tiny-mlm``: the demo's model, trains on 2 CPU cores in minutes.
- ``albert-mlm``: sahajBERT's published setting (ALBERT-large, 32k Unigram vocabulary, LAMB at
  lr 0.00176 with 5000 warmup steps, sequence length 512, global batch 4096, fp16 on the wire).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from dedloc.config import COMPRESSIONS
from dedloc.errors import ConfigError
from dedloc.extras import require

OPTIMIZERS = ("lamb", "adamw")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")


@dataclass
class MLMRecipe:
    """An ALBERT masked-language-modelling recipe."""

    hidden_size: int = 128
    """Transformer width."""
    layers: int = 2
    """Transformer layers (ALBERT shares their weights)."""
    heads: int = 2
    """Attention heads."""
    embedding_size: int = 64
    """ALBERT's factorised embedding width."""
    intermediate_size: int = 512
    """Feed-forward width."""
    vocab_size: int = 3000
    """Vocabulary the tokenizer is trained to (`dedloc tokenizer`); the model takes the tokenizer's own size."""
    seq_len: int = 64
    """Tokens per example."""
    mlm_probability: float = 0.15
    """Share of tokens masked."""
    optimizer: str = field(default="adamw", metadata={"choices": OPTIMIZERS})
    """'lamb' (pytorch_optimizer's Lamb) or 'adamw'."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 6
    """Global steps of linear warmup."""
    total_steps: int = 60
    """Global steps of the schedule (linear decay to 0 after warmup)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not on biases and LayerNorm weights)."""
    clip_grad_norm: float | None = 1.0
    """Clip the averaged gradient to this global norm (None: no clipping)."""
    target_batch_size: int = 96
    """Samples per global step, summed over the whole collaboration."""
    micro_batch: int = 16
    """Samples per forward/backward on this peer (a per-peer choice: fit it to the device)."""
    precision: str = field(default="auto", metadata={"choices": PRECISIONS})
    """'auto' (fp16 with loss scaling on CUDA, fp32 elsewhere), 'fp32', 'fp16' (CUDA only) or 'bf16'."""
    wire: str = field(default="none", metadata={"choices": COMPRESSIONS})
    """Gradients on the wire: 'none' (fp32) or 'float16'."""
    delay_updates: bool = False
    """Delayed parameter updates: average in the background while the next step computes."""
    seed: int = 0
    """Seed of the initial model (every peer starts from the same one)."""

    def validate(self) -> "MLMRecipe":
        for name in ("hidden_size", "layers", "heads", "embedding_size", "intermediate_size", "warmup_steps",
                     "total_steps", "target_batch_size", "micro_batch"):
            if getattr(self, name) < (0 if name == "warmup_steps" else 1):
                raise ConfigError(f"invalid config: {name} must be >= {0 if name == 'warmup_steps' else 1}")
        if self.hidden_size % self.heads:
            raise ConfigError("invalid config: hidden_size must be a multiple of heads")
        if self.seq_len < 8:
            raise ConfigError("invalid config: seq_len must be >= 8")
        if self.vocab_size < 100:
            raise ConfigError("invalid config: vocab_size must be >= 100")
        if not 0 < self.mlm_probability < 1:
            raise ConfigError("invalid config: mlm_probability must be in (0, 1)")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ConfigError("invalid config: lr must be > 0 and weight_decay >= 0")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError("invalid config: clip_grad_norm must be > 0 or None")
        for name, allowed in (("optimizer", OPTIMIZERS), ("precision", PRECISIONS), ("wire", COMPRESSIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"invalid config: {name} must be one of {allowed}")
        return self

    # ---- building blocks -------------------------------------------------------------------------------
    def model_config(self, vocab_size: int):
        from transformers import AlbertConfig

        return AlbertConfig(vocab_size=vocab_size, embedding_size=self.embedding_size, hidden_size=self.hidden_size,
                            num_hidden_layers=self.layers, num_attention_heads=self.heads,
                            intermediate_size=self.intermediate_size, max_position_embeddings=max(64, self.seq_len))

    def build_model(self, vocab_size: int) -> torch.nn.Module:
        """The initial model: identical on every peer (seeded by ``seed``)."""
        from transformers import AlbertForMaskedLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return AlbertForMaskedLM(self.model_config(vocab_size))

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        decay = [p for n, p in model.named_parameters() if p.requires_grad and not _no_decay(n)]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and _no_decay(n)]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        if self.optimizer == "lamb":
            Lamb = require("pytorch_optimizer").Lamb
            return Lamb(groups, lr=self.lr, weight_decouple=True)
        return torch.optim.AdamW(groups, lr=self.lr)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        from transformers import get_linear_schedule_with_warmup

        return get_linear_schedule_with_warmup(optimizer, self.warmup_steps, max(self.total_steps, self.warmup_steps + 1))


def _no_decay(name: str) -> bool:
    return name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name


RECIPES: dict[str, MLMRecipe] = {
    "tiny-mlm": MLMRecipe(),
    "albert-mlm": MLMRecipe(hidden_size=1024, layers=24, heads=16, embedding_size=128, intermediate_size=4096,
                            vocab_size=32000, seq_len=512, optimizer="lamb", lr=0.00176, warmup_steps=5000,
                            total_steps=125_000, weight_decay=0.01, clip_grad_norm=4.0, target_batch_size=4096,
                            micro_batch=8, precision="auto", wire="float16"),
}


def get_recipe(name: str, **overrides: Any) -> MLMRecipe:
    """A copy of the recipe ``name`` with ``overrides`` applied, validated."""
    if name not in RECIPES:
        raise ConfigError(f"invalid config: unknown recipe {name!r} (known: {', '.join(RECIPES)})")
    return dataclasses.replace(RECIPES[name], **overrides).validate()
