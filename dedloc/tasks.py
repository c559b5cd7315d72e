"""The one way an object owns background tasks: spawned through its :class:`Tasks`, cancelled and
awaited by ``close()``, so nothing outlives its owner and no exception goes unseen.

Not ``asyncio.TaskGroup``: an owner's tasks live as long as the object (a service's loops, a
connection's server), not one ``async with`` block, and one failing must not cancel the others.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

logger = logging.getLogger(__name__)


class Tasks:
    def __init__(self, owner: str):
        self.owner = owner
        self._running: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        """Run ``coro`` as a task this owner holds until it ends."""
        task = asyncio.create_task(coro, name=name)
        self._running.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            logger.warning(f"{self.owner}: background task {task.get_name()} failed: {type(e).__name__}: {e}")

    def __len__(self) -> int:
        return len(self._running)

    def cancel(self) -> None:
        """Cancel every task still running (from synchronous code; ``close()`` also waits)."""
        for task in list(self._running):
            task.cancel()

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until every task running now has ended, or ``timeout`` seconds (their errors are
        logged, not raised)."""
        if timeout is None:
            await asyncio.gather(*self._running, return_exceptions=True)
        elif self._running:
            await asyncio.wait(set(self._running), timeout=timeout)

    async def close(self) -> None:
        """Cancel every task still running and wait until they have ended."""
        self.cancel()
        await self.wait()


__all__ = ["Tasks"]
