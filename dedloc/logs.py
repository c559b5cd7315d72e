"""Logging set-up: one line per event at INFO, details at DEBUG; hivemind's chatter kept quiet."""

from __future__ import annotations

import logging
import os


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
