"""Where a peer's data stream stands, saved so that a restarted peer does not replay its samples.

The file (JSON, replaced atomically) holds the position of every DataLoader worker and the
caller's key of what it is a position in (the trainer's: sources, weights, text column, seed,
worker count, tokenizer and sequence length). A key that no longer matches (other data, another worker count) means starting the data
over, which is logged; a file that cannot be parsed is an error naming it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from dedloc.errors import DataError
from dedloc.files import write_atomically

logger = logging.getLogger(__name__)


class DataPosition:
    def __init__(self, path: str, key: dict[str, Any]):
        self.path, self.key = path, key
        self.positions: dict[int, Any] = {}
        """Worker -> its position (JSON) after the last micro-batch the training loop took."""
        self.samples = 0
        """Samples taken from the stream since the start (across restarts)."""

    def load(self) -> dict[int, Any]:
        """The saved positions, or {} when there are none (or they belong to other data)."""
        if not os.path.exists(self.path):
            return {}
        try:
            with open(self.path) as f:
                saved = json.load(f)
            positions = {int(w): str(p) for w, p in saved["positions"].items()}
            parsed = {w: json.loads(p) for w, p in positions.items()}
            samples = int(saved.get("samples", 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"data position file {self.path} is unreadable ({type(e).__name__}: {e}); "
                            "delete it to start the data over") from None
        if saved.get("key") != self.key:
            logger.warning(f"the data position in {self.path} is for other data or another worker count; "
                           "starting the data over")
            return {}
        self.positions, self.samples = positions, samples
        logger.info(f"resuming the data stream after {samples} samples ({self.path})")
        return parsed

    def took(self, batch: dict[str, Any], samples: int) -> None:
        """The training loop took ``batch`` (a micro-batch from :class:`~dedloc.data.mlm.MLMBatches`)."""
        worker, position = batch["position"]
        self.positions[int(worker)] = position
        self.samples += samples

    def save(self) -> None:
        write_atomically(self.path, json.dumps({"key": self.key, "samples": self.samples,
                                                "positions": self.positions}))
