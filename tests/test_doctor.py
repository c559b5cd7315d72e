"""`dedloc doctor`, without a network: each check names what it found and the fix; nothing is created."""

import os
import socket

from dedloc.cli import main
from dedloc.files import hold_dir
from dedloc.roles.doctor import check_state_dir, check_versions, dial, tcp_target

PEER = "12D3KooWJX6ZnqhDUdWPKNYsNhKGWD8JYFE9hWNoqZFWGRuhp3UH"


def test_an_initial_peer_that_answers_and_one_that_refuses_are_told_apart(tmp_path, capsys):
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections to it are refused
    try:
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        assert dial("127.0.0.1", up) == "answers" and dial("127.0.0.1", down).startswith("refused")
        state = tmp_path / "not-yet" / "state"
        rc = main(["doctor", "--no-network", "--state-dir", str(state), "--initial-peers",
                   f"/ip4/127.0.0.1/tcp/{up}/p2p/{PEER}", f"/ip4/127.0.0.1/tcp/{down}/p2p/{PEER}"])
    finally:
        listening.close()
        closed.close()
    out = capsys.readouterr().out
    assert rc == 1, out
    assert f"  ok  initial peer: /ip4/127.0.0.1/tcp/{up}/p2p/{PEER}: answers" in out
    assert f"FAIL  initial peer: /ip4/127.0.0.1/tcp/{down}/p2p/{PEER}: refused" in out
    assert f"state dir: {state} will be created" in out and "1 check(s) failed" in out
    assert not (tmp_path / "not-yet").exists()  # it checks; it creates nothing


def test_a_state_dir_held_by_a_running_peer_or_in_the_way_fails_by_name(tmp_path):
    held = tmp_path / "held"
    held.mkdir()
    lock = hold_dir(held, "--state-dir")
    try:
        [check] = check_state_dir(str(held))
        assert check.status == "FAIL" and f"in use by another dedloc process (pid {os.getpid()})" in check.detail
    finally:
        lock.close()
    [check] = check_state_dir(str(held))
    assert check.status == "ok" and "a new identity will be made there" in check.detail
    (tmp_path / "file").write_text("x")
    [check] = check_state_dir(str(tmp_path / "file" / "state"))
    assert check.status == "FAIL" and "is not a writable directory" in check.detail


def test_an_old_python_fails_and_the_tcp_part_of_an_address_is_found():
    python = next(check_versions((3, 10, 4)))
    assert python.status == "FAIL" and "needs Python 3.11 or later" in python.detail
    assert next(check_versions((3, 12, 1))).status == "ok"
    assert tcp_target(f"/ip4/1.2.3.4/tcp/31337/p2p/{PEER}") == ("1.2.3.4", 31337)
    assert tcp_target(f"/dns4/bb.example.org/tcp/443/p2p/{PEER}") == ("bb.example.org", 443)
    assert tcp_target(f"/ip4/1.2.3.4/udp/31337/quic-v1/p2p/{PEER}") is None
