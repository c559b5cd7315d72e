"""Keeping an invite-only run's revocation list current on every peer.

The owner's revocation list is signed (auth/invitation.py), so any peer can carry it: each peer
applies the newest list it finds under the run's ``revoked`` key and republishes it under its own
subkey, so the list outlives the peer that published it first (usually the owner's backbone,
started with ``revocations`` pointing at the file `dedloc revoke` writes, re-read each interval).
A revoked peer is refused by every peer within about ``INTERVAL`` seconds of the list reaching it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from dedloc.auth.authorizer import Authorizer
from dedloc.errors import Unauthorized

logger = logging.getLogger(__name__)
INTERVAL = 30.0
TTL = 600.0


class RevocationSync:
    """One peer's keeper of the revocation list (see module docstring); ``refresh`` never raises."""

    def __init__(self, authorizer: Authorizer, key: str, me: str, path: str,
                 store: Callable[[str, str, Any, float], Awaitable[bool]],
                 get: Callable[[str], Awaitable[dict[str, tuple[Any, float]]]]):
        self.authorizer, self.key, self.me, self.path = authorizer, key, me, path
        self._store, self._get = store, get

    async def refresh(self) -> None:
        if self.path:
            try:
                with open(self.path) as f:
                    self._apply(f.read().strip(), f"file {self.path}")
            except OSError as e:
                logger.warning(f"cannot read the revocation list {self.path}: {e}")
        try:
            for writer, (text, _) in (await self._get(self.key)).items():
                self._apply(text, f"peer {writer}")
            held = self.authorizer.revocations()
            if held is not None:
                await self._store(self.key, self.me, held, TTL)
        except Exception as e:  # a DHT hiccup: the next refresh retries
            logger.debug(f"revocation list refresh failed: {e!r}")

    def _apply(self, text: Any, source: str) -> None:
        try:
            if not isinstance(text, str):
                raise Unauthorized("it is not text")
            self.authorizer.update_revocations(text)
        except Unauthorized as e:
            logger.warning(f"ignored a revocation list from {source}: {e}")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            await self.refresh()
