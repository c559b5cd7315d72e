"""Files that a crash never leaves torn: checkpoints, the run memory, the ledger, data positions, revocations."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that after a crash at any instant ``path`` holds either its old
    content or all of ``data``: a temporary file in the same directory, fsynced, renamed over
    ``path``, then the directory fsynced."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


__all__ = ["write_atomically"]
