"""Checkpoints on disk: atomic writes, the newest few kept, torn or foreign files skipped.

A checkpoint is a state blob (state/snapshot.py) in ``state-<step>.pt``. It is written to a
temporary file in the same directory, fsynced, renamed over the final name and the directory
fsynced: after a crash at any instant the final name holds either nothing or a whole state.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from dedloc.files import make_dir
from dedloc.errors import DataError, ProtocolError
from dedloc.files import write_atomically
from dedloc.state import snapshot

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^state-(\d+)\.pt$")


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike, keep: int = 3, writer: bool = True):
        """``writer``: this store writes checkpoints (a backbone: the directory is made, and checked
        writable); else it only reads them (fine-tuning from a read-only copy)."""
        self.dir = Path(directory)
        self.keep = keep
        if writer:
            self.dir = make_dir(directory, "--checkpoint-dir")
            for stale in self.dir.glob(".state-*.tmp"):  # left by a crash mid-write (files.write_atomically)
                stale.unlink(missing_ok=True)

    def steps(self) -> list[int]:
        """Steps of the checkpoints present, newest first."""
        return sorted((int(m.group(1)) for f in self.dir.iterdir() if (m := _NAME.match(f.name))), reverse=True)

    def path(self, step: int) -> Path:
        return self.dir / f"state-{step:08d}.pt"

    def write(self, step: int, blob: bytes) -> Path:
        final = self.path(step)
        write_atomically(final, blob)
        for old in self.steps()[self.keep:]:
            self.path(old).unlink(missing_ok=True)
        return final

    def latest(self) -> tuple[int, bytes] | None:
        """The newest checkpoint that decodes as a state, or None; unreadable ones are logged and skipped."""
        for step in self.steps():
            try:
                blob = self.path(step).read_bytes()
                state_step = snapshot.peek_step(blob)
            except (OSError, ProtocolError) as e:
                logger.warning(f"skipping unreadable checkpoint {self.path(step)}: {e}")
                continue
            if state_step != step:
                logger.warning(f"skipping checkpoint {self.path(step)}: it holds step {state_step}")
                continue
            return step, blob
        return None


def model_weights(path: str, what: str = "--checkpoint") -> dict:
    """The model weights in a backbone checkpoint ``path`` (a file, or the newest in a directory),
    for fine-tuning and export; DataError naming ``what`` and the path if there are none."""
    if os.path.isdir(path):
        found = CheckpointStore(path, writer=False).latest()
        if found is None:
            raise DataError(f"{what} {path!r}: no checkpoint in this directory")
        blob = found[1]
    elif os.path.isfile(path):
        with open(path, "rb") as f:
            blob = f.read()
    else:
        raise DataError(f"{what} {path!r}: no such file or directory")
    try:
        state = snapshot.decode(blob)
    except ProtocolError as e:
        raise DataError(f"{what} {path!r}: not a dedloc checkpoint: {e}") from None
    if "model" not in state:
        raise DataError(f"{what} {path!r}: holds no model weights")
    return state["model"]
