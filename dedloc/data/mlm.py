"""Masked-language-modelling micro-batches made on the fly, in DataLoader workers.

Each worker walks its part of the peer's stream (:class:`~dedloc.data.stream.PeerStream`),
tokenizes texts in chunks, packs the tokens into ``[CLS] ... [SEP]`` blocks of ``seq_len``
(texts separated by ``[SEP]``, no padding), masks them (BERT's 80/10/10 rule,
``DataCollatorForLanguageModeling``) and yields micro-batches. Each micro-batch carries the
position its worker had reached after reading the texts in it, so the training loop can save
where it stands (:class:`~dedloc.data.position.DataPosition`) without reaching into the workers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from dedloc.data.sources import check_weights
from dedloc.errors import ConfigError

TEXTS_PER_CHUNK = 64


@dataclass
class DataConfig:
    """Where a peer's training text comes from and how it is read."""

    data: tuple[str, ...] = ()
    """Text sources, interleaved: files or globs (.txt, .jsonl, .json, .csv, .parquet, compressed
    too) or NAME[:CONFIG] of a dataset on the Hugging Face hub."""
    data_weights: tuple[float, ...] = ()
    """Sampling weight of each source, in order (empty: take them in turn)."""
    text_column: str = "text"
    """The column holding the text, in json/csv/parquet and hub sources."""
    shuffle_buffer: int = 10_000
    """Examples held in the shuffle buffer (more: better mixed, more memory)."""
    data_workers: int = 1
    """DataLoader worker processes tokenizing and masking ahead of the model (0: in the training process)."""
    data_seed: int = 0
    """Mixed with the peer id into this peer's data order."""

    def validate(self) -> "DataConfig":
        if self.shuffle_buffer < 1:
            raise ConfigError("invalid config: shuffle_buffer must be >= 1")
        if not 0 <= self.data_workers <= 64:
            raise ConfigError("invalid config: data_workers must be in [0, 64]")
        check_weights(self.data, self.data_weights)  # here, not first in a DataLoader worker after joining
        return self


@dataclass
class BatchSpec:
    """What a micro-batch is: filled in from the recipe and the tokenizer."""

    tokenizer: str
    seq_len: int
    micro_batch: int
    mlm_probability: float = 0.15
    seed: int = 0
    """This peer's data seed (``peer_seed``)."""
    positions: dict[int, Any] = field(default_factory=dict)
    """Worker index -> the position to resume from."""


class MLMBatches(torch.utils.data.IterableDataset):
    """Endless MLM micro-batches: ``{"input_ids", "labels", "position"}`` (position: worker, JSON)."""

    def __init__(self, data: DataConfig, spec: BatchSpec):
        super().__init__()
        self.data, self.spec = data, spec

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from transformers import DataCollatorForLanguageModeling

        from dedloc.data.stream import PeerStream
        from dedloc.data.tokenizer import load_tokenizer

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        spec = self.spec
        tokenizer = load_tokenizer(spec.tokenizer)
        collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=spec.mlm_probability,
                                                  return_tensors="pt")
        stream = PeerStream(self.data.data, spec.seed, text_column=self.data.text_column,
                            weights=self.data.data_weights, shuffle_buffer=self.data.shuffle_buffer,
                            worker=worker, workers=workers, position=spec.positions.get(worker))
        body = spec.seq_len - 2
        tokens: list[int] = []
        blocks: list[list[int]] = []
        texts = iter(stream)
        while True:
            chunk = [next(texts) for _ in range(TEXTS_PER_CHUNK)]
            position = json.dumps(stream.position())
            for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
                if ids:
                    tokens.extend(ids)
                    tokens.append(tokenizer.sep_token_id)
            while len(tokens) >= body:
                blocks.append([tokenizer.cls_token_id] + tokens[:body] + [tokenizer.sep_token_id])
                del tokens[:body]
            while len(blocks) >= spec.micro_batch:
                batch = collate([{"input_ids": b} for b in blocks[:spec.micro_batch]])
                del blocks[:spec.micro_batch]
                yield {"input_ids": batch["input_ids"], "labels": batch["labels"], "position": (worker, position)}


def loader(data: DataConfig, spec: BatchSpec, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """The DataLoader over :class:`MLMBatches`: ``data_workers`` processes, each a few batches ahead.

    Workers are spawned, not forked: the training process already runs the peer's threads."""
    workers = data.data_workers
    return torch.utils.data.DataLoader(MLMBatches(data, spec), batch_size=None, num_workers=workers,
                                       prefetch_factor=4 if workers else None, pin_memory=pin_memory,
                                       multiprocessing_context="spawn" if workers else None)
