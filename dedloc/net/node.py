"""The engine, wrapped once: a go-libp2p daemon (hivemind.p2p.P2P) and a DHT node (hivemind.dht).

Lives inside the runtime process (see runtime.py). Guarantees:
- the identity key persists in ``identity_path``, so a restarted peer keeps its peer ID;
- in client mode the daemon listens on no address: the peer only dials out;
- an unreachable initial peer raises :class:`JoinError` naming the addresses, within the startup timeout;
- ``shutdown()`` stops the DHT and terminates the daemon, removing its socket files; so does a
  failed ``create()``, even when the daemon exited on its own (hivemind then leaves its socket).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from dedloc.config import PeerConfig
from dedloc.errors import JoinError

logger = logging.getLogger(__name__)
_launching: contextvars.ContextVar[list[str]] = contextvars.ContextVar("dedloc_daemon_sockets")
"""While ``Node.create`` starts a daemon: where the daemon's socket goes (for clean-up on failure)."""
DHT_RPC_TIMEOUT = 3.0
"""Seconds a DHT request waits for one node (hivemind's default). A frozen peer (a stopped laptop)
costs each reader and writer this per request that reaches it, until it is blacklisted."""
DHT_BLACKLIST_S = 30.0
"""A node that did not answer is left out of DHT searches this long (doubling while it stays
silent): one frozen peer stalled everyone's progress reports for 15 s every 5 s with 5 s/5 s."""


class _Daemon(P2P):
    """hivemind's P2P client, with the daemon's secure channel set to TLS 1.3 only.

    p2pd negotiates Noise (ChaCha20-Poly1305) by default. Its AES-GCM TLS carried 1.3-1.5x more
    bytes per CPU second through the daemon on this hardware (bench in docs/wire.md), and the
    daemons' CPU bounds bulk averaging on small machines. Every dedloc peer starts its daemon this
    way, so peers always agree on the channel.
    """

    @staticmethod
    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        sockets = _launching.get(None)
        if sockets is not None:
            try:
                sockets.append(str(kwargs["listen"]["unix"]))
            except Exception:
                pass
        return P2P._make_process_args(*args, **kwargs) + ["-noise=0"]


class Node:
    """One peer's P2P daemon and DHT node."""

    def __init__(self, p2p: P2P, dht: DHTNode, config: PeerConfig):
        self.p2p, self.dht, self.config = p2p, dht, config
        self.peer_id: PeerID = p2p.peer_id

    @classmethod
    async def create(cls, config: PeerConfig) -> "Node":
        config.validate()
        for addr in config.initial_peers:
            try:
                maddr = Multiaddr(addr)
                maddr["p2p"]
            except Exception:
                raise JoinError(f"initial peer {addr!r} is not a full multiaddr ending in /p2p/<peer id>") from None
        if config.identity_path and not os.path.exists(config.identity_path):
            parent = os.path.dirname(os.path.abspath(config.identity_path))
            if not os.path.isdir(parent):
                raise JoinError(f"identity_path directory {parent} does not exist")
        p2p, sockets = None, []
        launching = _launching.set(sockets)
        try:
            p2p = await _Daemon.create(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) or None,
                identity_path=config.identity_path,
                check_if_identity_free=False,
                dht_mode="client" if config.client_mode else "server",
                no_listen=config.client_mode,
                startup_timeout=config.startup_timeout,
                idle_timeout=0,
            )
            dht = await asyncio.wait_for(
                DHTNode.create(
                    p2p=p2p,
                    initial_peers=list(config.initial_peers),
                    client_mode=config.client_mode,
                    ensure_bootstrap_success=True,
                    bootstrap_timeout=min(10.0, config.startup_timeout),
                    wait_timeout=DHT_RPC_TIMEOUT,
                    blacklist_time=DHT_BLACKLIST_S,
                    cache_locally=False,
                    cache_on_store=False,
                ),
                config.startup_timeout,
            )
        except Exception as e:
            if p2p is not None:
                await p2p.shutdown()
            for path in sockets:  # a daemon that exited by itself, or one hivemind gave up on, leaves it
                try:
                    os.remove(path)
                except OSError:
                    pass
            if isinstance(e, JoinError):
                raise
            hint = f" {list(config.initial_peers)}" if config.initial_peers else ""
            raise JoinError(f"could not join the collaboration through the initial peers{hint}: "
                            f"{type(e).__name__}: {e}") from None
        finally:
            _launching.reset(launching)
        return cls(p2p, dht, config)

    def socket_paths(self) -> list[str]:
        """The daemon's and its client's Unix sockets. They outlive a process that is killed (the
        daemon removes them only on a clean shutdown), so whoever kills it removes them."""
        paths = []
        for attr in ("_daemon_listen_maddr", "_client_listen_maddr"):  # hivemind 1.1.12 internals
            try:
                paths.append(str(getattr(self.p2p, attr)["unix"]))
            except Exception:
                pass
        return paths

    async def visible_maddrs(self) -> list[str]:
        if self.config.client_mode:
            return []
        try:
            return [str(a) for a in await self.p2p.get_visible_maddrs()]
        except ValueError:
            return []

    def key(self, *parts: Any) -> str:
        return ".".join([self.config.run_id, *map(str, parts)])

    async def store(self, key: str, subkey: str, value: Any, ttl: float) -> bool:
        return await self.dht.store(key, value, time.time() + ttl, subkey=subkey)

    async def get(self, key: str) -> dict[str, tuple[Any, float]]:
        """All unexpired (subkey -> (value, expiration)) entries under ``key``; {} if none."""
        found = await self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        now, out = time.time(), {}
        for subkey, item in found.value.items():
            try:
                value, expiration = item.value, item.expiration_time
            except AttributeError:
                continue
            if isinstance(subkey, str) and expiration >= now:
                out[subkey] = (value, expiration)
        return out

    async def shutdown(self) -> None:
        try:
            await asyncio.wait_for(self.dht.shutdown(), 5)
        except Exception:
            logger.debug("DHT shutdown did not finish cleanly", exc_info=True)
        await self.p2p.shutdown()
