"""Text sources, named on the command line (``--data``), opened as one streamed dataset.

A source is either local files or a dataset name:

- a path or glob (``corpus/*.jsonl``, ``wiki.txt``, ``shard-*.parquet``): the builder follows the
  extension (``.txt``: one text per line, whatever ``text_column`` says; ``.json``/``.jsonl``,
  ``.csv``, ``.parquet``: the text column; ``.gz``/``.bz2``/``.xz``/``.zst`` compression allowed);
- ``NAME[:CONFIG]``: a dataset on the Hugging Face hub (``wikimedia/wikipedia:20231101.bn``), or a
  local dataset directory, through the same ``load_dataset(NAME, CONFIG, streaming=True)`` call.

Several sources are interleaved (each example comes from source i with probability ``weights[i]``;
without weights, one after another in turn, the smaller ones repeated until the largest ends).
Nothing is read until iteration; ``first_text`` checks a source up front, so a wrong path or
column fails at start with its name rather than inside a DataLoader worker.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Sequence

from dedloc.errors import DataError
from dedloc.extras import require

BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
            ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


@dataclass(frozen=True)
class Source:
    spec: str
    """What the user wrote."""
    builder: str
    """A ``datasets`` builder (``json``, ``text``, ...) for files, else the dataset's name or directory."""
    files: tuple[str, ...] = ()
    config: str | None = None


def _builder_of(path: str) -> str | None:
    base = path.lower()
    for ext in COMPRESSED:
        if base.endswith(ext):
            base = base[: -len(ext)]
    return BUILDERS.get(os.path.splitext(base)[1])


def parse_source(spec: str) -> Source:
    """The source ``spec`` names; DataError if it names files that do not exist or cannot be read."""
    if not spec or not spec.strip():
        raise DataError("--data: an empty source name")
    if os.path.isdir(spec):
        return Source(spec, spec)
    builder = _builder_of(spec)
    if builder is not None or any(c in spec for c in "*?[") or os.path.exists(spec):
        files = tuple(sorted(glob.glob(spec, recursive=True))) if any(c in spec for c in "*?[") else (
            (spec,) if os.path.exists(spec) else ())
        files = tuple(f for f in files if os.path.isfile(f))
        if not files:
            raise DataError(f"--data {spec!r}: no such file")
        kinds = {_builder_of(f) for f in files}
        if None in kinds or len(kinds) != 1:
            raise DataError(f"--data {spec!r}: files must all be one of {sorted(BUILDERS)} "
                            f"(optionally compressed), got {sorted(os.path.basename(f) for f in files)[:5]}")
        return Source(spec, kinds.pop(), files)
    name, _, config = spec.partition(":")
    return Source(spec, name, (), config or None)


def load(source: Source, split: str = "train", streaming: bool = True, option: str = "--data") -> Any:
    """``datasets.load_dataset`` for ``source``: its files with their builder (one ``train`` split),
    or the dataset ``NAME[:CONFIG]``'s ``split``; DataError naming the source if it cannot be opened."""
    load_dataset = require("datasets").load_dataset
    try:
        if source.files:
            return load_dataset(source.builder, data_files=list(source.files), split="train", streaming=streaming)
        return load_dataset(source.builder, source.config, split=split, streaming=streaming)
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError...)
        raise DataError(f"{option} {source.spec!r}: cannot open it: {type(e).__name__}: {e}") from None


def open_source(source: Source, text_column: str = "text") -> Any:
    """One source as a streamed ``datasets.IterableDataset`` with a single ``text`` column."""
    ds = load(source)
    column, spec = "text" if source.builder == "text" else text_column, source.spec  # a .txt has one column

    def text_of(example: dict[str, Any]) -> dict[str, str]:
        if column not in example:
            raise DataError(f"--data {spec!r}: no column {column!r} (columns: {sorted(example)}); "
                            f"name the text column with --text-column")
        value = example[column]
        return {"text": value if isinstance(value, str) else "" if value is None else str(value)}

    names = ds.column_names
    return ds.map(text_of, remove_columns=[n for n in names] if names else None)


def check_weights(specs: Sequence[str], weights: Sequence[float]) -> None:
    """DataError unless ``weights`` is empty or gives each of ``specs`` a weight >= 0, not all 0."""
    if weights and len(weights) != len(specs):
        raise DataError(f"--data-weights: {len(weights)} weights for {len(specs)} sources")
    if weights and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise DataError("--data-weights: weights must be >= 0 and not all 0")


def open_sources(specs: Sequence[str], text_column: str = "text", weights: Sequence[float] = (),
                 seed: int = 0) -> Any:
    """All sources interleaved into one stream of ``{"text": ...}`` examples."""
    interleave_datasets = require("datasets").interleave_datasets
    if not specs:
        raise DataError("no training data: name at least one source with --data")
    check_weights(specs, weights)
    streams = [open_source(parse_source(s), text_column) for s in specs]
    if len(streams) == 1:
        return streams[0]
    probabilities = [w / sum(weights) for w in weights] if weights else None
    return interleave_datasets(streams, probabilities=probabilities, seed=seed, stopping_strategy="all_exhausted")


def first_text(spec: str, text_column: str = "text") -> str:
    """The first text of one source: opens and reads it, so that a bad source fails here, by name."""
    try:
        for example in open_source(parse_source(spec), text_column):
            return example["text"]
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"--data {spec!r}: cannot read it: {type(e).__name__}: {e}") from None
    raise DataError(f"--data {spec!r}: it holds no examples")
