"""Processes as /proc lists them, for tests and benchmarks that must prove nothing was left behind.

Only reads /proc (Linux). Zombies (exited, waiting to be reaped) count as gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any, Iterable


def processes() -> list[tuple[int, int, int, str]]:
    """(pid, parent pid, session id, state letter) of every process that has not exited."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
            except (OSError, IndexError):
                continue  # it exited meanwhile
            if fields[0] != "Z":
                out.append((int(entry), int(fields[1]), int(fields[3]), fields[0]))
    return out


def sessions_alive(sids: Iterable[int]) -> list[str]:
    """``"pid state command"`` of each process still in one of the sessions ``sids`` (a runtime and
    its p2p daemon share the runtime's session)."""
    sids = set(sids)
    alive = []
    for pid, _, sid, state in processes():
        if sid in sids:
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    alive.append(f"{pid} {state} {f.read().replace(chr(0), ' ')[:60]}")
            except OSError:
                pass
    return alive


def stale_sockets(paths: Iterable[str]) -> list[str]:
    """Those of the Unix socket files ``paths`` that nothing listens on (a connect is refused): what
    a p2p daemon killed before its clean shutdown leaves behind. Files that are gone do not count,
    nor do live sockets (another test's peers, running at the same time, own those)."""
    stale = []
    for path in paths:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(5)
        try:
            probe.connect(path)
        except (FileNotFoundError, TimeoutError):  # gone, or listening but slow to accept: not stale
            continue
        except OSError:  # refused: bound by nothing (or not a socket at all)
            stale.append(path)
        finally:
            probe.close()
    return sorted(stale)


def children(pid: int) -> list[int]:
    return [p for p, parent, _, _ in processes() if parent == pid]


def session_pids(sid: int) -> list[int]:
    return [p for p, _, s, _ in processes() if s == sid]


def cli_command(*args: str) -> list[str]:
    """The command line running ``dedloc ARGS`` with this interpreter."""
    return [sys.executable, "-m", "dedloc.cli", *args]


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python then installs its KeyboardInterrupt handler


def spawn_cli(*args: str, **popen: Any) -> subprocess.Popen:
    """``dedloc ARGS`` in a new session, answering SIGINT as a terminal's Ctrl+C would even when this
    process was started with SIGINT ignored (a background job), which children otherwise inherit."""
    return subprocess.Popen(cli_command(*args), start_new_session=True, preexec_fn=_interruptible, **popen)


__all__ = ["processes", "sessions_alive", "children", "session_pids", "cli_command", "spawn_cli"]
