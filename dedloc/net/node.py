"""The engine, wrapped once: a go-libp2p daemon (hivemind.p2p.P2P) and a DHT node (hivemind.dht).

Lives inside the runtime process (see runtime.py). Guarantees:
- the identity key persists in ``identity_path`` (an Ed25519 key, created mode 0600 when missing), so a
  restarted peer keeps its peer ID; without one, a fresh key is made (this process holds it either way);
- membership (``config.owner``/``invite``) is checked on every stream (``streams``), DHT request and
  DHT record, and every record this peer stores is signed by its key (dedloc/auth); an invalid own
  invitation raises ConfigError before the daemon starts;
- in client mode the daemon listens on no address: the peer only dials out;
- ``reachability`` is known before the DHT starts (dial-back probe, see reachability.py); a peer
  found private joins the DHT as a client, keeps slots on the run's relays (``relays``, else the
  initial peers) and punches holes to peers that reach it through them (DCUtR, QUIC preferred);
- a ``relay_service`` peer relays for private peers with limits sized for bulk traffic; in an
  invite-only run only for members (relay_guard.py: others are disconnected);
- an unreachable initial peer raises :class:`JoinError` naming the addresses, within the startup timeout;
- ``shutdown()`` stops the DHT and terminates the daemon, removing its socket files; so does a
  failed ``create()``, even when the daemon exited on its own (hivemind then leaves its socket).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterable

from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from dedloc.auth.authorizer import make_authorizer
from dedloc.auth.dht import DHTAccess
from dedloc.auth.records import SignedRecords
from dedloc.config import PeerConfig
from dedloc.errors import BootstrapError, JoinError
from dedloc.records import short_id
from dedloc.auth.identity import create_identity, load_identity, peer_id_of
from dedloc.auth.revocation_sync import RevocationSync
from dedloc.net.relay_guard import RelayGuard, keep_known
from dedloc.net import links
from dedloc.net.serve import Streams
from dedloc.net.reachability import DialbackServer, Reachability, probe
from dedloc.tasks import Tasks

logger = logging.getLogger(__name__)
_launching: contextvars.ContextVar[list[str]] = contextvars.ContextVar("dedloc_daemon_sockets")
"""While ``Node.create`` starts a daemon: where the daemon's socket goes (for clean-up on failure)."""
_extra_args: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("dedloc_daemon_args")
"""While ``Node.create`` starts a daemon: the p2pd flags hivemind's ``P2P.create`` does not pass."""
RELAY_SERVICE_ARGS = ("-relayService=1", f"-relayDataLimit={1 << 40}", "-relayTimeLimit=24h",
                      "-relayMaxCircuits=64", "-relayMaxReservations=1024", f"-relayBufferSize={4 << 20}")
"""A run's relay: large enough for state downloads and averaging payloads where no direct path
exists (1 TiB and 24 h per relayed connection, 64 circuits per peer, 4 MiB buffers)."""
DHT_RPC_TIMEOUT = 3.0
"""Seconds a DHT request waits for one node (hivemind's default). A frozen peer (a stopped laptop)
costs each reader and writer this per request that reaches it, until it is blacklisted."""
TOUCH_EVERY = 10.0
"""Seconds between looks for the run's peers that this peer's DHT lost (``Node.keep_in_touch``)."""
TOUCH_TIMEOUT = 3.0
"""Seconds one reconnection may take."""
REMEMBER_S = 600.0
"""How long a peer of the run is looked for after it was last seen publishing progress."""
MAX_REMEMBERED = 256
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
        return P2P._make_process_args(*args, **kwargs) + ["-noise=0", *_extra_args.get(())]


def _one_address_each(maddrs: tuple[str, ...]) -> list[str]:
    """One multiaddr per relay peer, QUIC where it has one: the daemon's static relays take one
    address per entry, and two entries for the same peer left it with no reservation at all."""
    chosen: dict[str, str] = {}
    for addr in maddrs:
        peer = Multiaddr(addr)["p2p"]
        if peer not in chosen or ("/quic" in addr and "/quic" not in chosen[peer]):
            chosen[peer] = addr
    return list(chosen.values())


def _identity(config: PeerConfig) -> tuple[ed25519.Ed25519PrivateKey, str, str | None]:
    """This peer's key, the identity file the daemon reads, and a scratch directory to remove once
    the daemon has read it (a peer without ``identity_path`` still holds its key here: it signs
    its records and requests with it)."""
    path, scratch = config.identity_path, None
    if path and not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise JoinError(f"identity_path directory {parent} does not exist")
        try:
            create_identity(path)
        except FileExistsError:
            pass  # another process of this peer created it meanwhile: use that one
    elif not path:
        scratch = tempfile.mkdtemp(prefix="dedloc-identity-")
        path = os.path.join(scratch, "identity.key")
        create_identity(path)
    try:
        return load_identity(path), path, scratch
    except (OSError, ValueError) as e:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise JoinError(f"cannot use identity {path}: {e}") from None


async def _find_reachability(p2p: P2P, streams: Streams, config: PeerConfig) -> Reachability:
    """Declared (client mode, or ``reachability`` set), else probed by the initial peers (dial-back).
    Every listening peer also answers others' dial-back requests from here on."""
    if config.client_mode:
        return Reachability(False, "client mode")
    await DialbackServer(streams, config.run_id).start()
    if config.reachability != "auto":
        return Reachability(config.reachability == "public", "declared in the config")
    probers: list[PeerID] = []
    for addr in config.initial_peers:
        peer = PeerID.from_base58(Multiaddr(addr)["p2p"])
        if peer not in probers and peer != p2p.peer_id:
            probers.append(peer)
    listen = list(p2p._visible_maddrs or ())  # the listen addresses, from the daemon's identify at start
    return await probe(streams, config.run_id, probers, listen)


def _unsigned(data: bytes) -> bytes:
    raise RuntimeError("this node was not created with an identity key")


class Node:
    """One peer's P2P daemon and DHT node."""

    def __init__(self, p2p: P2P, dht: DHTNode, config: PeerConfig, reachability: Reachability, streams: Streams):
        self.p2p, self.dht, self.config = p2p, dht, config
        self.peer_id: PeerID = p2p.peer_id
        self.reachability = reachability
        self.streams = streams
        """Opening and serving this peer's stream protocols (membership checked on every stream)."""
        self.authorizer = streams.authorizer
        self.revocations: RevocationSync | None = None
        self.relay_guard: RelayGuard | None = None
        self.sign: Callable[[bytes], bytes] = _unsigned
        """Signs with this peer's identity key (direct-connection hellos, net/tcp.py); set by ``create``."""
        self._tasks = Tasks("node")
        """Background tasks this node owns (membership upkeep); ``shutdown()`` cancels them."""
        self._members: dict[str, float] = {}
        """The run's DHT servers seen publishing progress (peer id -> when, monotonic)."""
        self._addrs: dict[str, list[str]] = {}
        """Where this node was last connected to each of them (direct addresses)."""

    @classmethod
    async def create(cls, config: PeerConfig) -> "Node":
        config.validate()
        for what, addrs in (("initial peer", config.initial_peers), ("relay", config.relays)):
            for addr in addrs:
                try:
                    maddr = Multiaddr(addr)
                    maddr["p2p"]
                except Exception:
                    raise JoinError(f"{what} {addr!r} is not a full multiaddr ending in /p2p/<peer id>") from None
        key, identity_path, scratch = _identity(config)
        peer_id = peer_id_of(key.public_key())
        try:
            authorizer = make_authorizer(config.run_id, config.owner, config.invite, peer_id)
        except BaseException:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        p2p, sockets = None, []
        launching = _launching.set(sockets)
        relays = _one_address_each(config.relays or config.initial_peers)
        auto_relay = not config.client_mode and config.reachability != "public" and bool(relays)
        extra = _extra_args.set((RELAY_SERVICE_ARGS if config.relay_service else ("-relayService=0",)) +
                                (("-relayDiscovery=0",) if auto_relay else ()) +
                                ((f"-metricsAddr={config.metrics_host}:{config.metrics_port + 1}",)
                                 if config.metrics_port > 0 else ()))

        # A relay is not forced public: then its large-limit relay service (started once AutoNAT finds
        # it public) replaces the tiny default one that this daemon build also starts. No daemon is
        # forced private: one forced so never punched a hole here (its relay slot came at once, but a
        # direct path matters more than the 15-20 s its own AutoNAT takes to conclude the same).
        declared = "public" if config.reachability == "public" and not config.relay_service else None
        try:
            p2p = await _Daemon.create(
                initial_peers=list(config.initial_peers) or None,
                host_maddrs=list(config.listen_maddrs()),
                announce_maddrs=list(config.announce_maddrs) or None,
                identity_path=identity_path,
                check_if_identity_free=False,
                # the daemon's own DHT finds peers' addresses (a private one's circuits too): a server
                # wherever the peer listens, so that lookups succeed on loopback (where AutoNAT never
                # decides) and inside one NAT'd LAN alike
                dht_mode="client" if config.client_mode else "server",
                no_listen=config.client_mode,
                auto_nat=True,  # serve AutoNAT to others, and punch holes (DCUtR)
                use_relay=True,
                use_auto_relay=auto_relay,
                trusted_relays=relays if auto_relay else None,
                force_reachability=declared,
                startup_timeout=config.startup_timeout,
                idle_timeout=0,
            )
            streams = Streams(p2p, authorizer)
            reachability = await _find_reachability(p2p, streams, config)
            dht = await asyncio.wait_for(
                DHTNode.create(
                    p2p=p2p,
                    record_validator=SignedRecords(key, peer_id, authorizer),
                    authorizer=DHTAccess(key, peer_id, authorizer),
                    initial_peers=list(config.initial_peers),
                    client_mode=not reachability.public,  # others cannot send it DHT requests
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
            unreachable = config.initial_peers and any(
                why in str(e) for why in ("failed to connect to bootstrap peers", "bootstrap failed"))
            raise (BootstrapError if unreachable else JoinError)(
                f"could not join the collaboration through the initial peers{hint}: {type(e).__name__}: {e}") from None
        finally:
            _launching.reset(launching)
            _extra_args.reset(extra)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)  # the daemon has read its key
        node = cls(p2p, dht, config, reachability, streams)
        node.sign = key.sign
        node._tasks.spawn(node.keep_in_touch(), name="dedloc-keep-in-touch")
        if authorizer.invite_only:
            node.revocations = RevocationSync(authorizer, node.key("revoked"), peer_id, config.revocations, node.store, node.get)
            await node.revocations.refresh()
            node._tasks.spawn(node.revocations.run(), name="dedloc-revocations")
            if config.relay_service:  # the daemon's relay admits anyone: drop who shows no invitation
                node.relay_guard = RelayGuard(p2p, authorizer, peer_id)
                node._tasks.spawn(node.relay_guard.run(), name="dedloc-relay-guard")
            if auto_relay and not reachability.public:  # stay known to the relays this peer holds slots on
                node._tasks.spawn(keep_known(dht.protocol.call_ping, [Multiaddr(a)["p2p"] for a in relays]),
                                  name="dedloc-keep-known")
        return node

    def saw(self, peers: Iterable[str]) -> None:
        """``peers`` (the run's DHT servers) published progress now: stay in touch with them."""
        now = time.monotonic()
        for peer in peers:
            self._members[peer] = now
        if len(self._members) > MAX_REMEMBERED:
            for peer in sorted(self._members, key=self._members.get)[:-MAX_REMEMBERED]:
                del self._members[peer]

    async def rejoin(self, maddrs: list[str], timeout: float) -> list[str]:
        """Connect to the peers at ``maddrs`` (full multiaddrs, several per peer allowed) and put
        those that answer a DHT ping back into the routing table (and off the DHT's blacklist): a
        restarted backbone finds its run again, and the halves of a healed partition find each
        other. Returns the peer ids that answered."""
        by_peer: dict[str, list[Multiaddr]] = {}
        for addr in maddrs:
            try:
                maddr = Multiaddr(addr)
                peer = maddr["p2p"]
            except Exception:
                continue
            if peer != self.peer_id.to_base58():
                by_peer.setdefault(peer, []).append(maddr.decapsulate(Multiaddr(f"/p2p/{peer}")))

        async def one(peer: str, addrs: list[Multiaddr]) -> str | None:
            pid = PeerID.from_base58(peer)
            try:
                await asyncio.wait_for(self.p2p._client.connect(pid, addrs), timeout)  # hivemind 1.1.12 internals
                found = await asyncio.wait_for(self.dht.protocol.call_ping(pid), timeout)
            except Exception as e:
                logger.debug(f"could not reach {peer} at {[str(a) for a in addrs]}: {e!r}")
                return None
            if found is None:
                return None
            if pid in self.dht.blacklist:
                self.dht.blacklist.register_success(pid)
            return peer

        answered = await asyncio.gather(*(one(p, a) for p, a in by_peer.items()))
        return [p for p in answered if p is not None]

    async def keep_in_touch(self) -> None:
        """Every TOUCH_EVERY s, reconnect to the initial peers and to the run's peers seen in the last
        REMEMBER_S that this node's DHT lost (its routing table drops a peer that stops answering,
        and nothing adds it back): without it, the two halves of a healed partition each kept their
        own DHT, and their own history, for good."""
        while True:
            await asyncio.sleep(TOUCH_EVERY)
            try:
                answered = await self._touch()
            except Exception as e:
                logger.debug(f"could not look for lost peers: {e!r}")
                continue
            if answered:
                logger.info(f"back in touch with {len(answered)} peer(s) of the run that this peer's DHT had lost: "
                            + ", ".join(short_id(p) for p in answered))

    async def _touch(self) -> list[str]:
        now = time.monotonic()
        self._members = {p: t for p, t in self._members.items() if now - t < REMEMBER_S}
        for peer, addrs in (await links.connections(self.p2p)).items():
            direct = [a for a in addrs if not links.relayed(a)]
            if peer in self._members and direct:
                self._addrs[peer] = direct[:4]
        self._addrs = {p: a for p, a in self._addrs.items() if p in self._members}
        table = self.dht.protocol.routing_table

        def lost(peer: str) -> bool:
            return PeerID.from_base58(peer) not in table and peer != self.peer_id.to_base58()

        targets = [a for a in self.config.initial_peers if lost(Multiaddr(a)["p2p"])]
        targets += [f"{a}/p2p/{p}" for p, addrs in self._addrs.items() if lost(p) for a in addrs]
        return await self.rejoin(targets, TOUCH_TIMEOUT) if targets else []

    @property
    def reachable(self) -> bool:
        """Others can open connections to this peer directly: it may lead rounds and aggregate."""
        return self.reachability.public

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
            return [str(a) for a in await self.p2p.get_visible_maddrs(latest=True)]
        except ValueError:
            return []

    def key(self, *parts: Any) -> str:
        return ".".join([self.config.run_id, *map(str, parts)])

    async def store(self, key: str, subkey: str, value: Any, ttl: float) -> bool:
        return await self.dht.store(key, value, time.time() + ttl, subkey=subkey)

    async def get(self, key: str) -> dict[str, tuple[Any, float]]:
        """All unexpired (subkey -> (value, expiration)) entries under ``key`` written by peers that are
        members now (a revocation voids the records a peer stored before it); {} if none."""
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
                if not self.authorizer.proven(subkey):  # e.g. revoked since its record was stored
                    logger.debug(f"skipped the record of {subkey} under {key}: not a member now")
                    continue
                out[subkey] = (value, expiration)
        return out

    async def shutdown(self) -> None:
        await self._tasks.close()
        try:
            await asyncio.wait_for(self.dht.shutdown(), 5)
        except Exception:
            logger.debug("DHT shutdown did not finish cleanly", exc_info=True)
        await self.p2p.shutdown()
