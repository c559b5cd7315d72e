"""A run's manifest: what a volunteer needs to join, in one token (`dedloc run manifest`, `dedloc train --join`).

The organiser writes it once: the run id, the recipe with its overrides (everything the peers must
agree on), the tokenizer, the data sources, the initial peers and, for an invite-only run, the
owner's key. It travels as a file (JSON) or as one pasteable token, ``dlj1.`` followed by the
compressed JSON in URL-safe base64. ``dedloc train --join TOKEN_OR_FILE`` takes its values as
defaults; a run-wide recipe value given otherwise on the command line is refused by name, before
the peer starts (a volunteer who forgot ``--recipe albert-mlm`` downloaded the whole state before
``StateError: the state does not fit this model``). A volunteer's own choices stay its own:
``micro_batch`` and ``precision`` (fit them to the device), and every peer and network option.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

from dedloc.errors import ConfigError
from dedloc.recipes.mlm import RECIPES, MLMRecipe

PER_PEER = ("micro_batch", "precision")
"""Recipe fields each peer chooses for its device; every other field is run-wide."""
PREFIX = "dlj1."
MAX_TOKEN = 64 << 10
"""Characters in a token (and bytes in a manifest file) at most."""
MAX_JSON = 256 << 10
"""Bytes a token decompresses to at most (a small token cannot expand into gigabytes)."""


def run_wide(recipe: MLMRecipe) -> dict[str, Any]:
    """The recipe's fields every peer of a run must share."""
    return {k: v for k, v in dataclasses.asdict(recipe).items() if k not in PER_PEER}


def recipe_hash(recipe: MLMRecipe) -> str:
    """A short hash of ``run_wide(recipe)``: equal exactly when two peers' recipes agree."""
    return hashlib.sha256(json.dumps(run_wide(recipe), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Manifest:
    run_id: str
    recipe: str
    """The named recipe (``RECIPES``) ..."""
    overrides: dict[str, Any]
    """... and its run-wide fields that this run sets otherwise."""
    tokenizer: str = ""
    data: tuple[str, ...] = ()
    initial_peers: tuple[str, ...] = ()
    owner: str = ""
    """The run owner's public key (invite-only runs; each volunteer still needs its own --invite)."""

    @classmethod
    def of(cls, run_id: str, recipe_name: str, recipe: MLMRecipe, **fields: Any) -> "Manifest":
        """The manifest of a run training ``recipe`` (the recipe ``recipe_name`` with some fields changed)."""
        if recipe_name not in RECIPES:
            raise ConfigError(f"unknown recipe {recipe_name!r} (known: {', '.join(RECIPES)})")
        base = run_wide(RECIPES[recipe_name])
        overrides = {k: v for k, v in run_wide(recipe.validate()).items() if base[k] != v}
        return cls(run_id, recipe_name, overrides, **fields)

    def build_recipe(self) -> MLMRecipe:
        return dataclasses.replace(RECIPES[self.recipe], **self.overrides).validate()

    @property
    def hash(self) -> str:
        return recipe_hash(self.build_recipe())

    def check(self, run_id: str, recipe_name: str, recipe: MLMRecipe) -> None:
        """ConfigError naming each run-wide value that ``run_id``, ``recipe_name`` and ``recipe`` (this
        peer's, after its command line) change from the manifest's."""
        wanted = run_wide(self.build_recipe())
        differs = [f"--{k.replace('_', '-')} {v} (the run's: {wanted[k]})" for k, v in run_wide(recipe).items()
                   if wanted[k] != v]
        if recipe_name != self.recipe:
            differs.insert(0, f"--recipe {recipe_name} (the run's: {self.recipe})")
        if run_id != self.run_id:
            differs.insert(0, f"--run-id {run_id} (the run's: {self.run_id})")
        if differs:
            raise ConfigError(f"--join: {'; '.join(differs)}: these are run-wide and come from the run's manifest "
                              f"(leave them out; only {', '.join('--' + p.replace('_', '-') for p in PER_PEER)} "
                              f"and this peer's own options may differ)")

    # ---- wire ------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"v": 1, **dataclasses.asdict(self), "recipe_hash": self.hash}, sort_keys=True)

    def token(self) -> str:
        return PREFIX + base64.urlsafe_b64encode(zlib.compress(self.to_json().encode(), 9)).rstrip(b"=").decode()

    @classmethod
    def read(cls, text: str) -> "Manifest":
        """The manifest in ``text``: a token, or the path of a manifest file (JSON, or a token). ConfigError
        naming what is wrong."""
        if not text.startswith(PREFIX):
            try:
                if os.path.getsize(text) > MAX_TOKEN:
                    raise ConfigError(f"--join {text}: larger than a manifest ({MAX_TOKEN} bytes at most)")
                with open(text) as f:
                    content = f.read().strip()
            except OSError as e:
                raise ConfigError(f"--join {text[:40]}: neither a manifest token (they start with {PREFIX!r}) nor a "
                                  f"readable file ({e.strerror or e})") from None
            return cls._decode(content if content.startswith(PREFIX) else None, content, text)
        return cls._decode(text, None, "the token")

    @classmethod
    def _decode(cls, token: str | None, raw: str | None, where: str) -> "Manifest":
        if token is not None:
            if len(token) > MAX_TOKEN:
                raise ConfigError(f"--join: {where} is longer than a manifest token ({MAX_TOKEN} characters at most)")
            body = token[len(PREFIX):]
            try:
                packed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
                inflate = zlib.decompressobj()
                raw = inflate.decompress(packed, MAX_JSON).decode()
                if inflate.unconsumed_tail or not inflate.eof:
                    raise ValueError("cut short, or too large")
            except (ValueError, binascii.Error, zlib.error, UnicodeDecodeError) as e:
                raise ConfigError(f"--join: {where} is not a whole manifest token ({e}; was all of it copied?)") from None
        try:
            obj = json.loads(raw or "")
            if obj.pop("v") != 1:
                raise ValueError("an unknown version: a newer dedloc made it")
            claimed = obj.pop("recipe_hash")
            manifest = cls(run_id=str(obj["run_id"]), recipe=str(obj["recipe"]), overrides=dict(obj["overrides"]),
                           tokenizer=str(obj.get("tokenizer", "")), data=tuple(map(str, obj.get("data", ()))),
                           initial_peers=tuple(map(str, obj.get("initial_peers", ()))), owner=str(obj.get("owner", "")))
            if manifest.recipe not in RECIPES:
                raise ValueError(f"unknown recipe {manifest.recipe!r} (this dedloc knows {', '.join(RECIPES)}: "
                                 f"a newer dedloc made it?)")
            unknown = set(manifest.overrides) - set(run_wide(RECIPES[manifest.recipe]))
            if unknown:
                raise ValueError(f"recipe fields this dedloc does not know: {', '.join(sorted(unknown))}")
            if manifest.hash != claimed:
                raise ValueError("its recipe hash does not match its recipe (edited by hand?)")
        except (ValueError, KeyError, TypeError, AttributeError, ConfigError) as e:
            raise ConfigError(f"--join: {where} is not a valid manifest: {e}") from None
        return manifest


__all__ = ["Manifest", "PER_PEER", "PREFIX", "run_wide", "recipe_hash"]
