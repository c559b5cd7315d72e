import asyncio
import concurrent.futures as cf
import contextlib
import fcntl
import os
import threading
import time
import uuid

import pytest

from dedloc.config import AveragingConfig, PeerConfig
from dedloc.peer import Peer, start_peers
from dedloc.testing.procs import sessions_alive


@contextlib.contextmanager
def bare_node(config, setup):
    """Run a bare engine Node (a peer that speaks the wire protocol its own way: hostile, silent or
    stalling) in a thread: ``await setup(node, finished)`` once it is up, where ``finished`` is a
    threading.Event set when the test is done with it. Yields its peer id; stops it on exit."""
    from dedloc.net.node import Node

    up, finished, ids = threading.Event(), threading.Event(), []

    async def main():
        node = await Node.create(config)
        try:
            await setup(node, finished)
            ids.append(node.peer_id.to_base58())
            up.set()
            await asyncio.to_thread(finished.wait, 300)
        finally:
            await node.shutdown()

    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(asyncio.run, main())
        try:
            while not up.wait(0.1):
                if fut.done():
                    fut.result()  # it failed to start: raise why
            yield ids[0]
        finally:
            finished.set()
            fut.result(timeout=60)


@pytest.fixture(scope="session")
def _machine_locks(tmp_path_factory):
    """Two lock files shared by this run's pytest-xdist workers (in pytest's own temporary root,
    which it rotates)."""
    root = tmp_path_factory.getbasetemp().parent
    return root / "turnstile.lock", root / "machine.lock"


@pytest.fixture(autouse=True)
def _share_the_machine(request, _machine_locks):
    """On pytest-xdist workers, a test marked ``alone`` (it loads both cores, or its outcome depends
    on timing that a second test's load upsets) runs with no other test alongside; the others run
    side by side. A readers-writer lock over two files: the turnstile makes a waiting ``alone``
    test hold off new ones, so it is not starved. Without xdist it does nothing."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    turnstile_path, machine_path = _machine_locks
    with open(turnstile_path, "a") as turnstile, open(machine_path, "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


def run_id() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def make_peers():
    """make_peers(n, clients=(indices), averaging=AveragingConfig) -> started peers, closed at teardown."""
    created: list[Peer] = []

    def make(n: int, clients=(), averaging: AveragingConfig | list[AveragingConfig] | None = None,
             per_peer: list[dict] | None = None, **peer_kwargs) -> list[Peer]:
        """``averaging``: one config or one per peer; ``per_peer``: PeerConfig fields for each peer."""
        rid = run_id()
        configs = [PeerConfig(run_id=rid, client_mode=i in clients, **peer_kwargs, **(per_peer[i] if per_peer else {}))
                   for i in range(n)]
        peers = start_peers(configs, averaging or AveragingConfig(matchmaking_time=3, averaging_timeout=20))
        created.extend(peers)
        return peers

    yield make
    pids = [p.runtime.pid for p in created]
    with cf.ThreadPoolExecutor(max(1, len(created))) as pool:  # peers leave at once, as after a run
        list(pool.map(lambda p: p.close(), created))
    deadline = time.monotonic() + 10  # SIGKILLed processes take a moment to finish exiting
    while sessions_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions_alive(pids) == [], "a runtime or p2p daemon outlived close()"


def wait_for(what: str, cond, timeout: float, every: float = 0.1) -> None:
    """Poll ``cond()`` every ``every`` s until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
