"""``dedloc doctor``: what a peer started here would find, without training or publishing anything.

Like ``accelerate env``, for a volunteer to paste into a question and for an organiser to check a
machine before its backbone starts. Each check is one line, ``ok``, ``FAIL`` or ``note``; the
command exits 1 if any failed. The checks, in order:

- versions: dedloc, Python (3.11 or later), torch, hivemind (the pinned release), transformers;
- the device ``--device auto`` picks, the CUDA devices and their memory, and the precision;
- the state directory: can be created and written, and no other dedloc process holds it;
- the run (with ``--join``): its id, recipe and settings hash, the tokenizer and each data source
  readable from here;
- each initial peer: a plain TCP connection to its address from here (answers, refused, timed out);
- unless ``--no-network``: this machine's reachability as a peer would find it (the p2p layer alone
  starts on ``--host-maddrs`` and the initial peers dial back, net/reachability.py); then it stops.
  It joins no round and publishes no record; it uses the state directory's identity if there is one
  (an invite-only run's initial peers answer only invited peers), else a throwaway one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Iterator

PINNED_HIVEMIND = "1.1.12"
MIN_PYTHON = (3, 11)
DIAL_TIMEOUT = 3.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """``ok``, ``FAIL`` or ``note`` (information, nothing to fix)."""
    detail: str

    def line(self) -> str:
        return f"{self.status:>4}  {self.name}: {self.detail}"


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def versions() -> str:
    """dedloc's version with the versions peers must share (``dedloc --version`` prints it)."""
    return (f"{installed('dedloc')} (hivemind {installed('hivemind')}, torch {installed('torch')}, "
            f"Python {sys.version.split()[0]})")


def check_versions(python: tuple[int, ...] = tuple(sys.version_info[:3])) -> Iterator[Check]:
    py = ".".join(map(str, python))
    yield Check("python", "ok" if python[:2] >= MIN_PYTHON else "FAIL",
                py if python[:2] >= MIN_PYTHON else f"{py}: dedloc needs Python {'.'.join(map(str, MIN_PYTHON))} or later")
    yield Check("dedloc", "ok", installed("dedloc"))
    hm = installed("hivemind")
    yield Check("hivemind", "ok" if hm == PINNED_HIVEMIND else "FAIL",
                hm if hm == PINNED_HIVEMIND else f"{hm}: the run's peers use hivemind {PINNED_HIVEMIND} "
                                                 f"(pip install hivemind=={PINNED_HIVEMIND})")
    for name in ("torch", "transformers"):
        v = installed(name)
        yield Check(name, "FAIL" if v == "not installed" else "ok", v)


def check_device(device: str, precision: str) -> Iterator[Check]:
    import torch

    from dedloc.errors import ConfigError
    from dedloc.roles.trainer import pick_device, pick_precision

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            yield Check(f"cuda:{i}", "note", f"{p.name}, {p.total_memory / 2**30:.1f} GiB")
    else:
        yield Check("cuda", "note", f"not available (torch {torch.__version__}"
                                    f"{', a CPU-only build' if torch.version.cuda is None else ''})")
    try:
        picked = pick_device(device)
        yield Check("device", "ok", f"--device {device} trains on {picked}, precision "
                                    f"{pick_precision(precision, picked)}")
    except ConfigError as e:
        yield Check("device", "FAIL", str(e))


def check_state_dir(path: str) -> Iterator[Check]:
    """Whether a peer could keep its identity and data position in ``path`` (nothing is created)."""
    from dedloc.errors import ConfigError
    from dedloc.files import hold_dir

    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        ok = os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)
        yield Check("state dir", "ok" if ok else "FAIL", f"{path} will be created" if ok else
                    f"{path} cannot be created: {parent} is not a writable directory")
        return
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        yield Check("state dir", "FAIL", f"{path} is not a writable directory")
        return
    try:
        hold_dir(path, "--state-dir").close()
    except ConfigError as e:
        yield Check("state dir", "FAIL", str(e))
        return
    key = os.path.join(path, "identity.key")
    yield Check("state dir", "ok", f"{path} is writable; " + (f"its identity {key} is kept" if os.path.exists(key)
                                                              else "a new identity will be made there"))


def dial(host: str, port: int, timeout: float = DIAL_TIMEOUT) -> str:
    """One plain TCP connection attempt: ``answers``, or why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "answers"
    except socket.timeout:
        return f"timed out after {timeout:.0f} s (a firewall, or nothing at that address)"
    except ConnectionRefusedError:
        return "refused (nothing listens on that port)"
    except OSError as e:
        return f"unreachable ({e.strerror or e})"


def tcp_target(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a ``/ip4|ip6|dns*/HOST/tcp/PORT/...`` multiaddr, None if it has no TCP part."""
    parts = maddr.strip("/").split("/")
    if len(parts) >= 4 and parts[0] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[2] == "tcp" and parts[3].isdigit():
        return parts[1], int(parts[3])
    return None


def check_initial_peers(initial_peers: tuple[str, ...]) -> Iterator[Check]:
    if not initial_peers:
        yield Check("initial peers", "note", "none: a peer started so begins a run alone (a volunteer needs the "
                                            "run's --initial-peers or --join)")
        return
    for addr in initial_peers:
        target = tcp_target(addr)
        if target is None:
            yield Check("initial peer", "note", f"{addr}: no TCP address to try (QUIC or relayed)")
            continue
        said = dial(*target)
        yield Check("initial peer", "ok" if said == "answers" else "FAIL", f"{addr}: {said}")


def check_run(manifest) -> Iterator[Check]:
    from dedloc.data.sources import first_text
    from dedloc.data.tokenizer import load_tokenizer
    from dedloc.errors import DedlocError

    yield Check("run", "ok", f"{manifest.run_id!r}: recipe {manifest.recipe}"
                             f"{' with ' + ', '.join(f'{k}={v}' for k, v in manifest.overrides.items()) if manifest.overrides else ''}"
                             f", settings hash {manifest.hash}")
    if manifest.tokenizer:
        try:
            tok = load_tokenizer(manifest.tokenizer)
            yield Check("tokenizer", "ok", f"{manifest.tokenizer}: {len(tok)} tokens")
        except (DedlocError, OSError) as e:
            yield Check("tokenizer", "FAIL", str(e))
    for spec in manifest.data:
        try:
            first_text(spec, "text")
            yield Check("data", "ok", f"{spec}: readable")
        except (DedlocError, OSError) as e:
            yield Check("data", "FAIL", str(e))


def check_network(peer_config) -> Iterator[Check]:
    """Start the p2p layer alone (no round, no record), read its reachability verdict, stop it."""
    from dedloc.errors import DedlocError
    from dedloc.net.node import Node

    async def probe():
        node = await Node.create(peer_config)
        try:
            return node.reachability, [str(a) for a in await node.visible_maddrs()]
        finally:
            await node.shutdown()

    try:
        verdict, maddrs = asyncio.run(probe())
    except DedlocError as e:
        yield Check("network", "FAIL", f"the p2p layer did not start: {e}")
        return
    yield Check("listens on", "note", " ".join(maddrs) or "nothing (client mode)")
    if not peer_config.initial_peers and not peer_config.client_mode and peer_config.reachability == "auto":
        yield Check("reachable", "note", "no initial peer to dial back: whether others can connect here is "
                                         "checked against a running peer's address (--initial-peers)")
        return
    yield Check("reachable", "ok" if verdict.public else "note",
                f"{'public' if verdict.public else 'private'}: {verdict.how}" +
                ("" if verdict.public else " (it trains through relays and hole punching; a backbone must be public)"))


def diagnose(peer_config, state_dir: str, device: str, precision: str, manifest=None,
             network: bool = True) -> Iterator[Check]:
    yield from check_versions()
    yield from check_device(device, precision)
    yield from check_state_dir(state_dir)
    if manifest is not None:
        yield from check_run(manifest)
    yield from check_initial_peers(peer_config.initial_peers)
    if network:
        yield from check_network(peer_config)


__all__ = ["Check", "diagnose", "versions", "dial", "tcp_target", "PINNED_HIVEMIND"]
