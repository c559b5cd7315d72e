"""Peers behind emulated home routers, on one machine: a public segment and NAT'd hosts.

Layout (every name under a unique prefix, removed by ``close()``, also after a failed build):
- a "switch" namespace holds the public bridge. Its range, 100.200.0.0/24, looks public to
  libp2p. AutoNAT and hole punching ignore RFC 1918 and 100.64/10 addresses, so a private
  range would not do;
- ``public(i)`` hosts sit on the bridge at ``public_ip(i)``;
- each NAT'd host ``private(j)`` sits alone on its LAN (192.168.<j+1>.2) behind router ``j``.
  The router has ``router_ip(j)`` on the bridge, MASQUERADE towards it and a stateful filter:
  it forwards replies (ESTABLISHED, RELATED) inbound and drops every other inbound packet.
  ``Nat(random_ports=True)`` adds ``--random-fully``: each outbound flow gets a random
  public port, so a punched hole does not match what the peer saw (an unpunchable NAT).

Needs root, ``ip`` and ``iptables`` (:func:`available` says why not). Killing a namespace also
kills what runs in it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from dedloc.config import PUBLIC_HOST_MADDRS
from dedloc.net.links import relayed
from dedloc.testing import netem
from dedloc.testing.netem import _run

PUBLIC_NET = "100.200.0"


@dataclass(frozen=True)
class Nat:
    """One home router."""

    random_ports: bool = False
    """``MASQUERADE --random-fully``: a new random source port per flow (hole punching fails)."""


def available() -> tuple[bool, str]:
    """(usable, reason if not)."""
    ok, why = netem.available()
    if not ok:
        return ok, why
    if shutil.which("iptables") is None:
        return False, "`iptables` is not installed (apt-get install -y iptables)"
    return True, ""


class NatNetwork(netem.Namespaces):
    """``NatNetwork(public=2, nats=[Nat(), Nat()])``: 2 public hosts and 2 NAT'd hosts."""

    def __init__(self, public: int, nats: list[Nat], prefix: str | None = None):
        super().__init__(prefix or f"dn{os.getpid() % 100000}")
        self.n_public, self.nats = public, list(nats)
        self._links = 0
        self._build_or_close()

    # ---- names and addresses ---------------------------------------------------------------------
    def public(self, i: int) -> str:
        return f"{self.prefix}u{i}"

    def private(self, j: int) -> str:
        return f"{self.prefix}h{j}"

    def router(self, j: int) -> str:
        return f"{self.prefix}r{j}"

    @staticmethod
    def public_ip(i: int) -> str:
        return f"{PUBLIC_NET}.{10 + i}"

    @staticmethod
    def router_ip(j: int) -> str:
        return f"{PUBLIC_NET}.{100 + j}"

    @staticmethod
    def private_ip(j: int) -> str:
        return f"192.168.{j + 1}.2"

    def exec_args(self, namespace: str) -> list[str]:
        """Prefix for a command that must run inside ``namespace`` (``public(i)`` or ``private(j)``)."""
        return ["ip", "netns", "exec", namespace]

    # ---- building --------------------------------------------------------------------------------
    def _ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _veth(self, ns_a: str, ns_b: str) -> tuple[str, str]:
        """A veth pair with one end in each namespace; returns the two device names."""
        a, b = f"{self.prefix}x{self._links}", f"{self.prefix}y{self._links}"
        self._links += 1
        _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        _run("ip", "link", "set", a, "netns", ns_a)
        _run("ip", "link", "set", b, "netns", ns_b)
        return a, b

    def _on_bridge(self, ns: str, ip: str) -> str:
        dev, port = self._veth(ns, self.switch)
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", port, "up")
        return dev

    def _build(self) -> None:
        self._ns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n_public):
            self._ns(self.public(i))
            self._on_bridge(self.public(i), self.public_ip(i))
        for j, nat in enumerate(self.nats):
            rtr, host = self.router(j), self.private(j)
            self._ns(rtr)
            self._ns(host)
            wan = self._on_bridge(rtr, self.router_ip(j))
            lan, hdev = self._veth(rtr, host)
            _run("ip", "-n", rtr, "addr", "add", f"192.168.{j + 1}.1/24", "dev", lan)
            _run("ip", "-n", rtr, "link", "set", lan, "up")
            _run("ip", "-n", host, "addr", "add", f"{self.private_ip(j)}/24", "dev", hdev)
            _run("ip", "-n", host, "link", "set", hdev, "up")
            _run("ip", "-n", host, "route", "add", "default", "via", f"192.168.{j + 1}.1")
            ipt = ["ip", "netns", "exec", rtr, "iptables"]
            _run("ip", "netns", "exec", rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", wan, "-j", "MASQUERADE",
                 *(["--random-fully"] if nat.random_ports else []))
            _run(*ipt, "-A", "FORWARD", "-i", wan, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                 "-j", "ACCEPT")
            _run(*ipt, "-A", "FORWARD", "-i", wan, "-j", "DROP")
            _run(*ipt, "-A", "INPUT", "-i", wan, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                 "-j", "ACCEPT")
            _run(*ipt, "-A", "INPUT", "-i", wan, "-j", "DROP")


def public_maddrs(maddrs: list[str]) -> list[str]:
    """The addresses among ``maddrs`` on the public segment, not through a relay."""
    return [a for a in maddrs if f"/ip4/{PUBLIC_NET}." in a and not relayed(a)]


def start_run(net: NatNetwork, logdir: str, run_id: str, averaging: dict, *, observers: int = 3,
              nat_listen: list[str] | None = None, slot_timeout: float = 60.0):
    """Driven peers for a run on ``net``: a relaying peer in ``public(0)`` (as a backbone relays),
    ``observers`` public trainers (libp2p trusts a NAT'd peer's public address once 4 peers saw it),
    and one default-config trainer per NAT'd host (listening on ``nat_listen`` if given). Returns
    (peers, start answers) once every NAT'd peer holds a slot on the relay (AssertionError after
    ``slot_timeout`` seconds). The caller closes the peers."""
    import time

    from dedloc.testing.peer_driver import DrivenPeer

    peers = [DrivenPeer(net.exec_args(net.public(i)), i, logdir) for i in range(1 + observers)] + \
            [DrivenPeer(net.exec_args(net.private(j)), 1 + observers + j, logdir) for j in range(len(net.nats))]
    try:
        relay = peers[0].call(op="start", averaging=averaging, peer=dict(
            run_id=run_id, host_maddrs=list(PUBLIC_HOST_MADDRS), relay_service=True))
        relay_maddrs = public_maddrs(relay["maddrs"])
        for p in peers[1:1 + observers]:
            p.send(op="start", averaging=averaging, peer=dict(run_id=run_id, initial_peers=relay_maddrs))
        infos = [relay] + [p.receive(120) for p in peers[1:1 + observers]]
        initial = relay_maddrs + [a for info in infos[1:] for a in public_maddrs(info["maddrs"])]
        extra = {"host_maddrs": nat_listen} if nat_listen else {}
        for p in peers[1 + observers:]:  # default config: nothing tells them they are behind NAT
            p.send(op="start", averaging=averaging,
                   peer=dict(run_id=run_id, initial_peers=initial, relays=relay_maddrs, **extra))
        infos += [p.receive(120) for p in peers[1 + observers:]]
        for p in peers[1 + observers:]:  # reachable once it holds a relay slot (a circuit address)
            deadline = time.monotonic() + slot_timeout
            while not any(map(relayed, p.call(op="maddrs"))):
                assert time.monotonic() < deadline, f"peer {p.index} got no relay slot within {slot_timeout:.0f} s"
                time.sleep(0.5)  # the daemon announces no event for a new address
    except BaseException:
        for p in peers:
            p.close()
        raise
    return peers, infos


__all__ = ["Nat", "NatNetwork", "available", "PUBLIC_NET", "public_maddrs", "start_run"]
