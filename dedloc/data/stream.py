"""This peer's endless, shuffled, resumable walk through the interleaved sources.

Every peer reads the whole corpus, in its own order: the order of the sources' shards (files,
or the hub's parquet shards) and a shuffle buffer are seeded by :func:`peer_seed` of its peer id,
so two peers see different samples at any moment while a restarted peer, keeping its identity,
walks the same order again. Each pass over the data is an epoch; the next one is reshuffled
(``set_epoch``). With several DataLoader workers, worker ``w`` of ``W`` reads its own part
(``split_dataset_by_node``: whole shards when they divide evenly, else every W-th example).

A position (:meth:`PeerStream.position`) is the epoch plus the ``datasets`` state (shard and
offset of every source). Restored, the walk continues after it; the examples that were waiting in
the shuffle buffer are dropped, not replayed (up to ``shuffle_buffer`` of them: on a corpus
smaller than the buffer, the rest of the epoch).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Sequence

from dedloc.errors import DataError
from dedloc.extras import require


def peer_seed(peer_id: str, run_seed: int = 0) -> int:
    """A 63-bit seed from a peer id (and the run's seed): stable across restarts, different per peer."""
    digest = hashlib.blake2b(f"{run_seed}:{peer_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class PeerStream:
    """Texts of one peer (one DataLoader worker of it), shuffled by its seed, across epochs."""

    def __init__(self, specs: Sequence[str], seed: int, *, text_column: str = "text", weights: Sequence[float] = (),
                 shuffle_buffer: int = 10_000, worker: int = 0, workers: int = 1,
                 position: dict[str, Any] | None = None):
        from dedloc.data.sources import open_sources

        split_dataset_by_node = require("datasets.distributed").split_dataset_by_node

        ds = open_sources(specs, text_column, weights, seed=seed % (1 << 32))
        if workers > 1:
            ds = split_dataset_by_node(ds, rank=worker, world_size=workers)
        self.dataset = ds.shuffle(seed=seed % (1 << 32), buffer_size=max(1, shuffle_buffer))
        self.epoch = 0
        self.resumed = position is not None
        if position is not None:
            try:
                self.epoch = int(position["epoch"])
                self.dataset.set_epoch(self.epoch)
                self.dataset.load_state_dict(position["state"])
            except Exception as e:
                raise DataError(f"cannot resume the data stream at the saved position: {type(e).__name__}: {e} "
                                "(delete the data position file to start the data over)") from None

    def __iter__(self) -> Iterator[str]:
        while True:
            self.dataset.set_epoch(self.epoch)
            seen = False
            for example in self.dataset:
                seen = True
                yield example["text"]
            if not seen and not self.resumed:
                raise DataError("the training data holds no examples")
            self.resumed = False  # a resumed pass may be empty: it stopped at the end of an epoch
            self.epoch += 1

    def position(self) -> dict[str, Any]:
        """Where the walk is now (after the last text yielded): JSON-serialisable."""
        return {"epoch": self.epoch, "state": self.dataset.state_dict()}
