"""The libp2p daemon's open connections, and whether each goes through a relay."""

from __future__ import annotations

from typing import Any

from hivemind.p2p import P2P


def relayed(addr: Any) -> bool:
    """The multiaddr goes through a relay (a circuit address)."""
    return "/p2p-circuit" in str(addr)


async def connections(p2p: P2P) -> dict[str, list[str]]:
    """The daemon's open connections: peer id -> the remote address of each connection to it."""
    out: dict[str, list[str]] = {}
    for info in await p2p.list_peers():
        out.setdefault(info.peer_id.to_base58(), []).extend(map(str, info.addrs))
    return out


