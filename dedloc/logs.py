"""Logging set-up: one line per event at INFO, details at DEBUG; hivemind's chatter kept quiet."""

from __future__ import annotations

import logging
import os
import time


def configure(level: str = "INFO") -> None:
    level = os.environ.get("DEDLOC_LOG_LEVEL", level).upper()
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    root = logging.getLogger("dedloc")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [pid {os.getpid()}] %(name)s: %(message)s",
                                               "%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)
    logging.getLogger("hivemind").setLevel(logging.WARNING if level != "DEBUG" else logging.INFO)


class PerPeerWarnings:
    """Warnings about what a remote peer sent, at most one per peer per ``interval`` seconds at
    WARNING (the rest at DEBUG): a peer that floods requests cannot flood the log. Remembers at
    most ``capacity`` peers (the oldest are forgotten)."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, capacity: int = 1024):
        self.logger, self.interval, self.capacity = logger, interval, capacity
        self._last: dict[str, float] = {}

    def warn(self, peer: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` at ``level`` if this peer had none within the interval, else at DEBUG."""
        now = time.monotonic()
        if now - self._last.get(peer, -self.interval) >= self.interval:
            self._last.pop(peer, None)
            self._last[peer] = now
            while len(self._last) > self.capacity:
                self._last.pop(next(iter(self._last)))
            self.logger.log(level, message + f" (more from this peer within {self.interval:.0f} s: at DEBUG)")
        else:
            self.logger.debug(message)
