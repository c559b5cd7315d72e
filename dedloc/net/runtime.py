"""A background process that owns a peer's networking, so the training thread's GIL never stalls it.

The background process is started as ``python -m dedloc.net.child`` (so the user's script is
never re-imported, guard or no guard) and talks to the training process over a socket pair:
``call(API.method, ...)`` runs ``await service.method(...)`` there and returns the result (only the
methods the service's :class:`RemoteAPI` declares; errors keep their type). Tensors
live in named shared memory (:class:`SharedBuffer`) and are used in place by both sides.

Guarantees:
- the background process runs its own event loop and interpreter: a training thread that holds
  the GIL for seconds does not delay RPCs served by this peer;
- ``close()`` (also run at exit, and on Ctrl+C through KeyboardInterrupt) stops the service,
  which terminates the p2p daemon; if the process does not exit in time, its whole process group
  (it and the daemon) is killed, so no daemon or socket file is left behind;
- if the training process dies, the background process sees the pipe close and shuts down at
  once, without serving what others still read from it (the peer is gone; a restart under the
  same identity must not meet the old process still answering for it);
- a call on a closed or crashed runtime raises RuntimeClosedError, never hangs.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import concurrent.futures
import functools
import importlib
import inspect
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Awaitable, Callable, ClassVar, Concatenate, ParamSpec, TypeVar

import torch

from dedloc import errors
from dedloc.errors import DedlocError, JoinError, RuntimeClosedError
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
_live: "weakref.WeakSet[Runtime]" = weakref.WeakSet()
_ORPHANED = object()
"""Inbox marker: the training process closed the pipe without asking to shut down (it died)."""


def _close_all() -> None:
    for rt in list(_live):
        rt.close()


atexit.register(_close_all)


P = ParamSpec("P")
R = TypeVar("R")


class RemoteAPI(abc.ABC):
    """The declaration of what a runtime's service offers, and its check.

    An API class (``class PeerAPI(RemoteAPI, api=True)``) declares async methods as abstract; a
    service implementing it (``class PeerService(PeerAPI)``) must define each with the same
    parameters, or its class statement raises TypeError (at import, not in a run). Only declared
    methods can be called across the boundary; the caller names them by the declaration
    (``runtime.call(PeerAPI.info)``), so a renamed method fails where it is used."""

    declared: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, api: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._is_api = api
        declaration = {name: f for base in reversed(cls.__mro__) if base.__dict__.get("_is_api", False)
                       for name, f in vars(base).items() if getattr(f, "__isabstractmethod__", False)}
        cls.declared = frozenset(declaration)
        if api:
            return
        for name, declared in declaration.items():
            impl, where = getattr(cls, name), ".".join(declared.__qualname__.split(".")[-2:])
            if getattr(impl, "__isabstractmethod__", False):
                raise TypeError(f"{cls.__name__} does not implement {where}")
            if _parameters(impl) != _parameters(declared):
                raise TypeError(f"{cls.__name__}.{name}{inspect.signature(impl)} differs from its declaration "
                                f"{where}{inspect.signature(declared)}")


def _parameters(f: Callable) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]


@functools.cache
def _signature(f: Callable) -> inspect.Signature:
    return inspect.signature(f)


class Runtime:
    """Handle on one background process running ``factory(*args)`` (an async service)."""

    def __init__(self, factory: str, args: tuple, *, api: type[RemoteAPI], startup_timeout: float,
                 name: str = "dedloc-runtime", log_level: str = "INFO"):
        self.api = api
        """What ``factory``'s service implements: the only methods ``call`` accepts."""
        self.info: dict[str, Any] = {}
        """What the service reported when it started (peer id, addresses, files to remove if killed)."""
        parent_sock, child_sock = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "dedloc.net.child", str(child_sock.fileno())],
            pass_fds=[child_sock.fileno()], start_new_session=True, stdin=subprocess.DEVNULL)
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._conn.send((factory, args, log_level))
        self._closed = False
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        try:
            if not self._conn.poll(startup_timeout + 15):
                raise JoinError(f"the peer did not start within {startup_timeout + 15:.0f} s")
            kind, *payload = self._conn.recv()
        except (EOFError, OSError):
            self._kill()
            raise JoinError("the peer's background process died while starting") from None
        except JoinError:
            self._kill()
            raise
        if kind != "ready":
            self._wait(10)
            self._kill()
            raise errors.from_wire(*payload)
        self.info = payload[0]
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)
        self._reader.start()
        _live.add(self)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def _wait(self, timeout: float) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def call_async(self, method: Callable[Concatenate[Any, P], Awaitable[R]], /, *args: P.args,
                   **kwargs: P.kwargs) -> "concurrent.futures.Future[R]":
        """Run ``method`` (a method of ``api``, as declared there) with these arguments in the service;
        a future of its result or of its error (with its type: ``errors.from_wire``). Arguments that
        do not fit the declaration raise TypeError here, before anything is sent."""
        name = getattr(method, "__name__", None)
        if name not in self.api.declared or getattr(self.api, name) is not method:
            raise TypeError(f"{getattr(method, '__qualname__', method)!r} is not a method of {self.api.__qualname__}")
        try:
            _signature(method).bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{method.__qualname__}: {e}") from None
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeClosedError("the peer is closed")
            rid = next(self._ids)
            self._futures[rid] = fut
            try:
                self._conn.send((rid, name, args, kwargs))
            except (OSError, BrokenPipeError):
                self._futures.pop(rid, None)
                raise RuntimeClosedError("the peer's background process is gone") from None
        return fut

    def call(self, method: Callable[Concatenate[Any, P], Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """:meth:`call_async`, waiting for the result (``call_async(...).result(timeout)`` to bound the wait)."""
        return self.call_async(method, *args, **kwargs).result()

    def _read_loop(self) -> None:
        while True:
            try:
                kind, rid, *payload = self._conn.recv()
            except (EOFError, OSError):
                break
            fut = self._futures.pop(rid, None)
            if fut is None:
                continue
            if kind == "result":
                fut.set_result(payload[0])
            else:
                fut.set_exception(errors.from_wire(*payload))
        with self._lock:
            pending, self._futures = self._futures, {}
        for fut in pending.values():
            fut.set_exception(RuntimeClosedError("the peer's background process exited"))

    def close(self, timeout: float = 15.0) -> None:
        """Stop the service and the daemon; kill the process group if it does not exit in time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.send((-1, "__shutdown__", (), {}))
            except (OSError, BrokenPipeError):
                pass
        self._wait(timeout)
        self._kill()
        self._wait(5)
        self._conn.close()
        _live.discard(self)

    def kill(self) -> None:
        """Kill the background process and its daemon at once, as a crash would (for tests)."""
        with self._lock:
            self._closed = True
        self._kill()
        self._wait(5)

    def _kill(self) -> None:
        """Kill the process group, then remove the files it would have removed on a clean exit
        (``info["leftovers"]``: the p2p daemon's sockets)."""
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError):
            pass
        for path in self.info.get("leftovers", ()):
            try:
                os.remove(path)
            except OSError:
                pass


class SharedBuffer:
    """A float32 vector in named shared memory, usable as a tensor by both processes.

    The creating side owns it and unlinks it on ``close()``; the other side only attaches.
    """

    def __init__(self, numel: int, name: str | None = None):
        self.numel = numel
        self.owner = name is None
        self._shm = SharedMemory(name=name, create=self.owner, size=max(4, numel * 4))
        if not self.owner:  # Python < 3.13 tracks attached segments too and would unlink them at exit
            try:
                resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            except Exception:
                pass
        self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.float32, count=numel)

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        del self.tensor
        try:
            self._shm.close()
        except BufferError:
            return
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


def _child_main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process decides when we stop
    conn = Connection(fd)
    factory, args, log_level = conn.recv()
    from dedloc.logs import configure

    configure(log_level)
    import torch

    # its tensor work (reductions, checks, copies) is memory-bound and runs beside the training
    # process: extra intra-op threads only spin. Measured, 4 peers on 2 cores, a 64M round's CPU
    # over all peers: 4.9 -> 2.4 s on plaintext direct connections, 16.7 -> 5.2 s over TLS.
    torch.set_num_threads(1)
    try:
        asyncio.run(_serve(conn, factory, args))
    finally:
        conn.close()


async def _serve(conn, factory: str, args: tuple) -> None:
    """Serve calls until asked to shut down; the service's ``shutdown(drain)`` drains unless orphaned."""
    module, _, attr = factory.partition(":")
    try:
        service = await getattr(importlib.import_module(module), attr)(*args)
    except Exception as e:
        conn.send(("failed", *errors.to_wire(e)))
        return
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def on_readable() -> None:
        try:
            while conn.poll():
                inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            inbox.put_nowait(_ORPHANED)

    loop.add_reader(conn.fileno(), on_readable)
    loop.add_signal_handler(signal.SIGTERM, inbox.put_nowait, None)
    conn.send(("ready", await service.info()))
    tasks = Tasks("runtime")

    async def handle(rid: int, method: str, a: tuple, kw: dict) -> None:
        try:
            if method not in service.declared:
                raise DedlocError(f"unknown method {method!r}")
            result = await getattr(service, method)(*a, **kw)
            reply = ("result", rid, result)
        except Exception as e:
            reply = ("error", rid, *errors.to_wire(e))
        try:
            conn.send(reply)
        except (OSError, BrokenPipeError):
            pass

    orphaned = False
    try:
        while True:
            msg = await inbox.get()
            if msg is _ORPHANED:
                orphaned = True
                logger.info("the training process is gone: leaving without draining")
                break
            if msg is None or msg[1] == "__shutdown__":
                break
            tasks.spawn(handle(*msg), name=f"dedloc-call-{msg[1]}")
    finally:
        await tasks.close()
        await service.shutdown(drain=not orphaned)

