"""A service with no network, for the tests of the process boundary itself (net/runtime.py):
its one call raises whichever error it is asked to, so a test sees what arrives on the other side."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from dedloc import errors
from dedloc.net.runtime import RemoteAPI

RAISED = {"timeout": lambda m: TimeoutError(m), "value": lambda m: ValueError(m),
          "state": lambda m: errors.StateError(m, peers=("donor-a", "donor-b")),
          "config": lambda m: errors.ConfigError(m)}


class BoundaryAPI(RemoteAPI, api=True):
    @abstractmethod
    async def info(self) -> dict[str, Any]:
        """What the service reports when it starts."""

    @abstractmethod
    async def echo(self, value: Any, *, twice: bool = False) -> Any:
        """``value`` (in a list of two, ``twice``)."""

    @abstractmethod
    async def fail(self, kind: str, message: str) -> None:
        """Raise the error ``RAISED[kind]`` with ``message``."""


class BoundaryService(BoundaryAPI):
    async def info(self) -> dict[str, Any]:
        return {}

    async def echo(self, value: Any, *, twice: bool = False) -> Any:
        return [value, value] if twice else value

    async def fail(self, kind: str, message: str) -> None:
        raise RAISED[kind](message)

    async def shutdown(self, drain: bool = True) -> None:
        pass


async def create() -> BoundaryService:
    return BoundaryService()
