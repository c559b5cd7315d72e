"""Joining, identity, and leaving cleanly (close, Ctrl+C, a killed training process)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dedloc.testing.procs import children, sessions_alive, stale_sockets
from dedloc import JoinError, Peer, PeerConfig
from dedloc.errors import BootstrapError


def hivemind_files() -> set[str]:
    """The p2p daemons' socket files in /tmp (tests compare them before and after: of the new ones,
    none may be stale; live ones belong to tests running alongside, under pytest-xdist)."""
    return {os.path.join("/tmp", f) for f in os.listdir("/tmp") if f.startswith("hivemind-")}


def test_identity_persists_across_restarts(tmp_path):
    path = str(tmp_path / "peer.key")
    with Peer(PeerConfig(run_id="ident", identity_path=path)) as a:
        first = a.peer_id
    with Peer(PeerConfig(run_id="ident", identity_path=path)) as b:
        assert b.peer_id == first
    assert first.startswith("12D3KooW")  # Ed25519: the public key is in the id itself
    assert os.stat(path).st_mode & 0o777 == 0o600  # the private key is its owner's alone


def test_unreachable_initial_peer_is_a_clear_error():
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLrqEJY5XQxXrfrsJsV9T57JFrx9DEkqjut99TdPL7ndm"
    before, kids = hivemind_files(), set(children(os.getpid()))
    t0 = time.monotonic()
    # it tries again while its bootstrap may be restarting (join_timeout), then names it
    with pytest.raises(BootstrapError, match=r"could not join.*127.0.0.1/tcp/9.*kept trying for 6 s"):
        Peer(PeerConfig(run_id="x", initial_peers=(dead,), startup_timeout=15, join_timeout=6))
    assert time.monotonic() - t0 < 40
    assert set(children(os.getpid())) - kids == set(), "a failed try's background process is still running"
    assert stale_sockets(hivemind_files() - before) == []
    with pytest.raises(JoinError, match="not a full multiaddr"):
        Peer(PeerConfig(run_id="x", initial_peers=("/ip4/127.0.0.1/tcp/9",)))


SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from dedloc import Peer, PeerConfig
    # Ctrl+C raises KeyboardInterrupt, as in a terminal, even if the test runner was started as a
    # background job (which starts with SIGINT ignored, and children inherit that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    peer = Peer(PeerConfig(run_id="sig"))
    print(peer.runtime.pid, flush=True)
    while True:
        time.sleep(0.1)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_or_killed_training_process_leaves_nothing(sig):
    before = hivemind_files()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    runtime_pid = int(proc.stdout.readline())
    assert sessions_alive([runtime_pid]), "the runtime and its daemon should be running"
    proc.send_signal(sig)
    proc.wait(30)
    deadline = time.monotonic() + 30  # after SIGKILL the runtime notices the closed socket and shuts down
    while sessions_alive([runtime_pid]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions_alive([runtime_pid]) == []
    assert stale_sockets(hivemind_files() - before) == []


def test_killed_runtime_leaves_no_socket_files():
    """A runtime killed by its owner (a crash, a stop that timed out) takes its daemon with it; the
    daemon's Unix sockets, which only a clean shutdown removes, are removed by the owner."""
    peer = Peer(PeerConfig(run_id="kill"))
    try:
        paths = peer.runtime.info["leftovers"]
        assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
        pid = peer.runtime.pid
        peer.runtime.kill()
        deadline = time.monotonic() + 10  # a SIGKILLed process takes a moment to finish exiting
        while sessions_alive([pid]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sessions_alive([pid]) == []
        assert [p for p in paths if os.path.exists(p)] == []
    finally:
        peer.close()


def test_calls_across_the_process_boundary_are_checked_against_one_declaration_and_errors_keep_their_type():
    from dedloc.errors import ConfigError, DedlocError, PeerTimeoutError, StateError
    from dedloc.net.runtime import Runtime
    from dedloc.peer_api import PeerAPI
    from dedloc.testing.boundary import BoundaryAPI

    rt = Runtime("dedloc.testing.boundary:create", (), api=BoundaryAPI, startup_timeout=30)
    try:
        assert rt.call(BoundaryAPI.echo, {"a": 1}) == {"a": 1}
        assert rt.call(BoundaryAPI.echo, 3, twice=True) == [3, 3]
        # a wrong argument, or a method the service does not declare, is refused before anything is sent
        with pytest.raises(TypeError, match=r"BoundaryAPI.echo: .*unexpected keyword argument 'thrice'"):
            rt.call(BoundaryAPI.echo, 3, thrice=True)
        with pytest.raises(TypeError, match=r"BoundaryAPI.fail: missing a required argument: 'message'"):
            rt.call(BoundaryAPI.fail, "value")
        with pytest.raises(TypeError, match=r"PeerAPI.ping.* is not a method of BoundaryAPI"):
            rt.call(PeerAPI.ping)
        # errors arrive with their type (a timeout is both a TimeoutError and a DedlocError), and their peers
        with pytest.raises(PeerTimeoutError, match="waited too long") as e:
            rt.call(BoundaryAPI.fail, "timeout", "waited too long")
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, DedlocError)
        with pytest.raises(StateError, match="no donor") as e:
            rt.call(BoundaryAPI.fail, "state", "no donor")
        assert e.value.peers == ("donor-a", "donor-b")
        with pytest.raises(ConfigError):
            rt.call(BoundaryAPI.fail, "config", "bad value")
        with pytest.raises(DedlocError, match=r"^ValueError: odd$"):
            rt.call(BoundaryAPI.fail, "value", "odd")
        assert rt.alive  # none of it broke the runtime
    finally:
        rt.close()
    assert not rt.alive
