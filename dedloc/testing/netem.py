"""Shaped test networks on one machine: one Linux network namespace per peer, caps per direction.

Each peer namespace holds one end of a veth pair; the other end sits on a bridge in a
"switch" namespace. ``tbf`` on the peer's end caps its upload, ``tbf`` on the switch's end caps
its download (netem is absent on this kernel, so there is no delay or loss emulation). Needs
root and ``ip``/``tc``; :func:`available` says whether this machine can do it and why not.

Every namespace and link is created under a unique prefix and removed by ``close()`` (also on
failure while building, and from ``with`` blocks); killing a namespace also kills what runs in it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass


def _run(*cmd: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def available() -> tuple[bool, str]:
    """(usable, reason if not)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed"
    probe = f"dlprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except RuntimeError as e:
        return False, f"cannot create a network namespace: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def exit_on_signals() -> None:
    """Make SIGTERM and SIGINT end the process through its ``finally`` blocks (so namespaces are
    removed), and ignore any further such signal meanwhile: ``timeout`` or a shell's ``pkill`` often
    sends a second one, which would otherwise cut the clean-up short and leave namespaces behind."""

    def handler(signum: int, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def remove_namespaces(names: list[str]) -> None:
    """Kill what runs in each namespace (newest first), then delete it; missing ones are skipped."""
    for ns in reversed(names):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass(frozen=True)
class Link:
    """A peer's caps in Mbit/s (None: uncapped)."""

    upload_mbit: float | None = None
    download_mbit: float | None = None


def _tbf(netns: str, dev: str, mbit: float) -> None:
    # burst: enough for the rate at a 4 ms timer (min 64 KB); latency bounds the queue
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.004))
    _run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
         "burst", str(burst), "latency", "100ms")


class Namespaces:
    """Network namespaces made under one prefix by a subclass's ``_build``; ``close()`` (also from a
    ``with`` block, and on a failed build) kills what runs in them and deletes them."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.switch = f"{self.prefix}sw"
        self._made: list[str] = []

    def _build(self) -> None:
        raise NotImplementedError

    def _build_or_close(self) -> None:
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them (idempotent)."""
        remove_namespaces(self._made)
        self._made.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Network(Namespaces):
    """``Network(links)``: namespace ``ns(i)`` for each link, all on one bridge, addresses ``ip(i)``."""

    def __init__(self, links: list[Link], prefix: str | None = None):
        super().__init__(prefix or f"dl{os.getpid() % 100000}")
        self.links = links
        self._subnet = 10 + os.getpid() % 200
        self._split: set[int] = set()
        self._second_bridge = False
        self._build_or_close()

    def ns(self, i: int) -> str:
        return f"{self.prefix}p{i}"

    def ip(self, i: int) -> str:
        return f"10.{self._subnet}.{(i + 10) // 250}.{(i + 10) % 250 + 1}"

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ["ip", "-n", self.switch]
        _run(*sw, "link", "add", "br0", "type", "bridge")
        _run(*sw, "link", "set", "br0", "up")
        _run(*sw, "link", "set", "lo", "up")
        for i, link in enumerate(self.links):
            ns, a, b = self.ns(i), f"{self.prefix}a{i}", f"{self.prefix}b{i}"
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _run("ip", "link", "set", a, "netns", ns)
            _run("ip", "link", "set", b, "netns", self.switch)
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/16", "dev", a)
            _run("ip", "-n", ns, "link", "set", a, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(*sw, "link", "set", b, "master", "br0")
            _run(*sw, "link", "set", b, "up")
            if link.upload_mbit:
                _tbf(ns, a, link.upload_mbit)
            if link.download_mbit:
                _tbf(self.switch, b, link.download_mbit)

    def exec_args(self, i: int) -> list[str]:
        """Prefix for a command that must run inside peer ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def split(self, side: list[int]) -> None:
        """Partition the network: the peers in ``side`` reach each other and no one else (their ports
        move to a second bridge); ``heal()`` joins the halves again."""
        sw = ["ip", "-n", self.switch]
        if not self._second_bridge:  # made once: a heal leaves it empty for the next split
            _run(*sw, "link", "add", "br1", "type", "bridge")
            _run(*sw, "link", "set", "br1", "up")
            self._second_bridge = True
        for i in side:
            _run(*sw, "link", "set", f"{self.prefix}b{i}", "master", "br1")
            self._split.add(i)

    def heal(self) -> None:
        for i in sorted(self._split):
            _run("ip", "-n", self.switch, "link", "set", f"{self.prefix}b{i}", "master", "br0")
        self._split.clear()
