"""Files that a crash never leaves torn (checkpoints, the run memory, the ledger, data positions,
revocations), and the directories they go in."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

from dedloc.errors import ConfigError


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


def make_dir(path: str | os.PathLike, what: str) -> Path:
    """Create the directory ``path`` (and its parents) if missing, for ``what`` (the option that named
    it, e.g. ``--state-dir``). ConfigError naming both and the reason when it cannot be used: a file
    in the way, a parent that cannot be created, or no permission to write in it."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{what} {path}: a file that is not a directory is in the way") from None
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot create this directory ({e.strerror or e})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: this directory is not writable by this user")
    return p


def hold_dir(path: str | os.PathLike, what: str) -> IO[str]:
    """Hold the directory ``path`` for this process alone until the returned file is closed (or the
    process ends): two peers started from one directory shared one identity, seen by the others as
    one peer restarting over and over. ConfigError naming ``what`` and the holder's pid if another
    process holds it."""
    lock = open(Path(path) / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(f"{what} {path} is in use by another dedloc process (pid {holder}); give each peer on "
                          f"this machine its own") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


__all__ = ["write_atomically", "make_dir", "hold_dir"]
