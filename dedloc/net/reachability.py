"""Can other peers connect to this one? Found out by a dial-back probe, not declared.

A peer asks up to ``PROBERS`` of its initial peers to open a TCP connection back to it. Each
prober dials only the IP address that the request's own connection came from (the asking peer's
address as the internet sees it), on the TCP ports the peer says it listens on (at most
``MAX_PORTS``), and answers which ones accepted. A prober can thus be made to dial nobody but the
asker's own address, on a few ports: it is no tool for scanning or reflecting traffic at others.

Verdict: **public** if any prober reached a port, **private** if the probers that answered reached
none (a home router drops the unsolicited connection). If no prober answered, the peer's own
addresses decide (public if one is a global address). A peer with no initial peers starts the run,
and one that listens on loopback only is in a local run: both are public. The probe runs once at start;
it takes at most about ``DIAL_TIMEOUT`` plus one request's round trip per prober, run in parallel.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from dedloc.errors import ProtocolError
from dedloc.net import links
from dedloc.net.serve import Streams
from dedloc.records import short_id

logger = logging.getLogger(__name__)
VERSION = 1
PROBERS = 3
MAX_PORTS = 4
DIAL_TIMEOUT = 3.0
MAX_SERVED = 4
"""Dial-backs a peer runs at once; further requests wait their turn (bounded by the caller's deadline)."""


@dataclass(frozen=True)
class Reachability:
    public: bool
    how: str
    """One line for the log: who reached which address, or why not."""
    observed: str | None = None
    """This peer's IP address as a prober saw it (None: no prober answered)."""


def tcp_ports(maddrs: list[Multiaddr]) -> list[int]:
    """The TCP ports of the direct (not relayed) addresses among ``maddrs``, each once."""
    ports: list[int] = []
    for addr in maddrs:
        if links.relayed(addr):
            continue
        try:
            port = int(addr["tcp"])
        except Exception:
            continue
        if port not in ports:
            ports.append(port)
    return ports[:MAX_PORTS]


def observed_ip(addr: Multiaddr) -> str | None:
    """The IP address a direct connection comes from (None for a relayed one or a non-IP address)."""
    if links.relayed(addr):
        return None
    for proto in ("ip4", "ip6"):
        try:
            return str(ipaddress.ip_address(addr[proto]))
        except Exception:
            continue
    return None


class DialbackServer:
    """Answers dial-back requests: tries a TCP connection to the asker's observed address."""

    def __init__(self, streams: Streams, run_id: str):
        self.streams, self.proto = streams, f"dedloc.{run_id}.dialback"
        self._served = asyncio.Semaphore(MAX_SERVED)

    async def start(self) -> None:
        await self.streams.serve_requests(self.proto, self._on_request, stream_info=True)

    async def _on_request(self, info, request) -> dict:
        if not isinstance(request, dict) or request.get("v") != VERSION or not isinstance(request.get("ports"), list) \
                or not 0 < len(request["ports"]) <= MAX_PORTS \
                or not all(isinstance(p, int) and 0 < p < 65536 for p in request["ports"]):
            raise ProtocolError(f"malformed dial-back request (protocol {VERSION}, 1 to {MAX_PORTS} TCP ports)")
        ip = observed_ip(info.addr)
        if ip is None:
            return {"observed": None, "reached": []}
        async with self._served:
            reached = await asyncio.gather(*(self._dial(ip, port) for port in request["ports"]))
        logger.debug(f"dial-back for {info.peer_id} at {ip}: reached {[p for p, ok in zip(request['ports'], reached) if ok]}")
        return {"observed": ip, "reached": [p for p, ok in zip(request["ports"], reached) if ok]}

    @staticmethod
    async def _dial(ip: str, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True


def _ips(maddrs: list[Multiaddr]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    for addr in maddrs:
        ip = observed_ip(addr)
        if ip is not None:
            out.append(ipaddress.ip_address(ip))
    return out


async def probe(streams: Streams, run_id: str, probers: list[PeerID], listen: list[Multiaddr]) -> Reachability:
    """Ask up to ``PROBERS`` of ``probers`` to dial this peer back on the TCP ports of ``listen``
    (its listen addresses); never raises."""
    ips, ports = _ips(listen), tcp_ports(listen)
    if not probers:
        return Reachability(True, "no initial peer to ask: this peer starts the run")
    if ips and all(ip.is_loopback for ip in ips):  # a local run: only peers on this machine take part
        return Reachability(True, "listens on loopback only: reachable by the peers on this machine")
    if not ports:
        return Reachability(False, "listens on no TCP address, so no prober can dial it back")
    proto = f"dedloc.{run_id}.dialback"
    asked = probers[:PROBERS]

    async def ask(peer: PeerID):
        try:
            return await streams.call(peer, proto, {"v": VERSION, "ports": ports}, DIAL_TIMEOUT + 5.0)
        except Exception as e:
            return e

    answers = await asyncio.gather(*(ask(p) for p in asked))
    failures, observed = [], None
    for peer, answer in zip(asked, answers):
        if isinstance(answer, BaseException) or not isinstance(answer, dict):
            failures.append(f"{short_id(peer.to_base58())}: {type(answer).__name__}")
            continue
        ip = answer.get("observed") if isinstance(answer.get("observed"), str) else None
        observed = observed or ip
        reached = [p for p in answer.get("reached", []) if p in ports] if isinstance(answer.get("reached"), list) else []
        if ip is not None and reached:
            return Reachability(True, f"{short_id(peer.to_base58())} connected back to {ip}:{reached[0]}", ip)
    if observed is None:  # nobody could tell: judge by its own addresses
        public = any(ip.is_global for ip in ips)
        return Reachability(public, f"no prober answered ({', '.join(failures)}); it listens on "
                                    f"{'a public' if public else 'no public'} address")
    return Reachability(False, f"{len(asked) - len(failures)} peer(s) could not connect back to {observed} on TCP "
                               f"port(s) {ports}", observed)


__all__ = ["Reachability", "DialbackServer", "probe", "tcp_ports", "observed_ip", "PROBERS", "MAX_PORTS"]
