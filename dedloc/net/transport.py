"""The transport seam: how a peer opens streams to another peer and serves them.

A stream is an asyncio ``(reader, writer)`` pair carrying one request of one protocol; whoever
writes last waits (bounded) for the other side to close first (docs/wire.md, "Closing"). What
travels on it (frames, credits, messages) is the same on every transport.

Implementations:
- :class:`dedloc.net.serve.Streams`: libp2p streams through the p2p daemon. Reaches every member
  (relayed, hole-punched), checks membership on every stream. The control plane, and the data
  plane's fallback.
- :class:`dedloc.net.tcp.RoundConnections`: direct TCP connections for one round's streams, with
  a libp2p fallback per pair (net/tcp.py).
- :class:`LocalPairs` (here): in-process socket pairs, for tests of the round protocols.

Every implementation serves an incoming stream through :func:`serve_stream` (admission, handler,
close rule, the error ladder), so they cannot drift apart.

Failure behaviour, for every implementation: ``open`` raises ConnectionError if the peer cannot be
reached or does not serve the protocol (PeerSilent if it took the stream but never answered its
hello: a frozen peer), or, for libp2p, Unauthorized / ProtocolError with the peer's reason if it
refuses; callers bound it with their own deadline. A handler that fails ends its stream (the
opener reads its end) and the protocol goes on being served. tests/test_transports.py checks
these on every implementation.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from dedloc.errors import ProtocolError
from dedloc.logs import PerPeerWarnings
from dedloc.net.messages import wait_peer_closed
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
_warnings = PerPeerWarnings(logger)
StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Handler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]
"""``handler(info, reader, writer)``: ``info.peer_id`` is the authenticated remote peer (its
``to_base58()``). Returns True if it wrote last (the transport then waits for the peer to close)."""


class Transport(ABC):
    """Opens streams to peers for a protocol, and serves protocols."""

    @abstractmethod
    async def open(self, peer_id: str, protocol: str) -> StreamPair:
        """A stream to ``peer_id`` for ``protocol`` (see the module doc for failures)."""

    @abstractmethod
    async def serve(self, protocol: str, handler: Handler) -> None:
        """Hand every incoming stream of ``protocol`` to ``handler``."""


class PeerSilent(ConnectionError):
    """The peer's side took the stream (its libp2p daemon, its kernel) but the peer never answered
    the stream's hello in time: it is frozen (SIGSTOP, a sleeping laptop) or stalled. Each try costs
    that wait, so a round asks such a member nothing more (RoundConnections)."""


class Refused(Exception):
    """An incoming stream that its transport's admission refused: ``answer()`` tells the peer why
    (run after the refusal is logged)."""

    def __init__(self, peer: str, reason: str, answer: Callable[[], Awaitable[None]] | None = None):
        super().__init__(reason)
        self.peer, self.answer = peer, answer


Admit = Callable[[], Awaitable[tuple[Any, Callable[[], None]]]]
"""A transport's admission of one incoming stream: reads its hello and checks membership and
limits; returns (the handler's ``info``, a callback that releases the peer's budget), or raises
Refused (or ProtocolError, ConnectionError: the peer sent nonsense or went away)."""


async def serve_stream(what: str, admit: Admit, handler: Handler, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, close_wait: float, warnings: PerPeerWarnings,
                       log: logging.Logger) -> None:
    """Serve one incoming stream the one way every transport does: admission, then the handler,
    then the close rule (if the handler wrote last, wait, bounded, for the peer to close first).

    A refusal or a protocol error is a WARNING naming the peer (rate-limited per peer), a peer that
    went away is DEBUG, anything else is logged with its traceback; none escapes. The stream is
    always closed and the peer's budget released."""
    release: Callable[[], None] | None = None
    peer, wrote_last = "an unnamed peer", False
    try:
        info, release = await admit()
        peer = info.peer_id.to_base58()
        wrote_last = bool(await handler(info, reader, writer))
    except Refused as e:
        warnings.warn(f"{e.peer} {what}", f"refused a {what} stream from {e.peer}: {e}")
        if e.answer is not None:
            try:
                await e.answer()
            except (ConnectionError, OSError, asyncio.TimeoutError):
                pass
    except ProtocolError as e:
        warnings.warn(f"{peer} {what}", f"rejected a {what} stream from {peer}: {e}")
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, ssl.SSLError) as e:
        log.debug(f"{what} stream from {peer} ended early: {e!r}")
    except Exception:
        log.exception(f"failed to serve a {what} stream from {peer}")
    finally:
        if release is not None:
            release()
        if wrote_last:
            await wait_peer_closed(reader, close_wait)
        writer.close()


@dataclass(frozen=True)
class _LocalId:
    name: str

    def to_base58(self) -> str:
        return self.name


@dataclass(frozen=True)
class _LocalInfo:
    peer_id: _LocalId
    addr: Any = None


class LocalPairs:
    """Peers in one process, connected by Unix socket pairs: ``pairs.transport(name)`` is peer
    ``name``'s Transport. Each stream's server side runs as a task this object owns; ``close()``
    waits for (bounded) and then cancels them."""

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], Handler] = {}
        self._tasks = Tasks("local streams")

    def transport(self, name: str) -> Transport:
        return _LocalTransport(self, name)

    async def _open(self, caller: str, peer_id: str, protocol: str) -> StreamPair:
        handler = self._handlers.get((peer_id, protocol))
        if handler is None:
            raise ConnectionError(f"{peer_id} serves no {protocol}")
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        self._tasks.spawn(self._serve(handler, caller, *await asyncio.open_connection(sock=b)), name="dedloc-local-serve")
        return reader, writer

    @staticmethod
    async def _serve(handler: Handler, caller: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        async def admit() -> tuple[Any, Callable[[], None]]:
            return _LocalInfo(_LocalId(caller)), lambda: None

        await serve_stream("local", admit, handler, reader, writer, 30.0, _warnings, logger)

    async def close(self, timeout: float = 30.0) -> None:
        """Let the streams being served finish (bounded), then cancel what is left."""
        await self._tasks.wait(timeout)
        await self._tasks.close()


class _LocalTransport(Transport):
    def __init__(self, pairs: LocalPairs, name: str):
        self.pairs, self.name = pairs, name

    async def open(self, peer_id: str, protocol: str) -> StreamPair:
        return await self.pairs._open(self.name, peer_id, protocol)

    async def serve(self, protocol: str, handler: Handler) -> None:
        self.pairs._handlers[(self.name, protocol)] = handler


__all__ = ["Transport", "LocalPairs", "StreamPair", "Handler", "PeerSilent", "Refused", "serve_stream"]
