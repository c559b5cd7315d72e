"""Logging set-up: one line per event at INFO, details at DEBUG; hivemind's chatter kept quiet."""

from __future__ import annotations

import logging
import os
import time


def configure(level: str = "INFO") -> None:
    """Log at ``level`` (``DEDLOC_LOG_LEVEL`` overrides it); the loggers named in ``DEDLOC_DEBUG``
    (comma-separated, e.g. ``dedloc.averaging.matchmaking``) log at DEBUG whatever the level: the
    details of one layer in a long soak, without every layer's."""
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
    for name in filter(None, (n.strip() for n in os.environ.get("DEDLOC_DEBUG", "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)
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


class OncePerStep:
    """Events logged at INFO the first time they happen in a step, at DEBUG after: under churn a
    peer can meet the same condition (step down, retry, stay held back) dozens of times in one
    step. Remembers the newest ``keep`` steps."""

    def __init__(self, logger: logging.Logger, keep: int = 64):
        self.logger, self.keep = logger, keep
        self._seen: dict[int, set[str]] = {}

    def log(self, step: int, event: str, message: str) -> None:
        """Log ``message`` at INFO if ``event`` is new in ``step``, else at DEBUG."""
        seen = self._seen.setdefault(step, set())
        self.logger.log(logging.DEBUG if event in seen else logging.INFO, message)
        seen.add(event)
        while len(self._seen) > self.keep:
            self._seen.pop(min(self._seen))

    def seen(self, step: int, event: str) -> bool:
        """Whether ``event`` happened in ``step`` (and was not forgotten since)."""
        return event in self._seen.get(step, ())

    def forget(self, step: int, event: str) -> None:
        """The condition behind ``event`` ended: its next occurrence in ``step`` is news again."""
        self._seen.get(step, set()).discard(event)
