"""Configuration dataclasses: the one source of truth shared by the CLI and the Python API.

Every field is validated by ``validate()``, which raises :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dedloc.errors import ConfigError
from dedloc.records import MAX_NAME, MAX_RUN_HASH, name_ok

COMPRESSIONS = ("none", "float16")
STRATEGIES = ("partitioned", "ring")
PLANNERS = ("lp", "equal", "bandwidth", "declared")
TRANSPORTS = ("auto", "libp2p")
REACHABILITY = ("auto", "public", "private")
PUBLIC_PORT = 31337
PUBLIC_HOST_MADDRS = (f"/ip4/0.0.0.0/tcp/{PUBLIC_PORT}", f"/ip4/0.0.0.0/udp/{PUBLIC_PORT}/quic-v1")
"""Where a backbone listens by default: every interface, TCP and QUIC on one port number (the one
port a backbone operator opens, for TCP and UDP)."""


LOOPBACK_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
ANY_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1")
"""Every interface, TCP and QUIC, on ports the system picks."""


def _is_loopback(maddr: str) -> bool:
    parts = maddr.split("/")
    return len(parts) > 2 and ((parts[1] == "ip4" and parts[2].startswith("127.")) or (parts[1] == "ip6" and parts[2] == "::1"))


def _check(cond: bool, name: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"invalid config: {name} {why}")


@dataclass
class PeerConfig:
    """How a peer joins the network."""

    run_id: str = "dedloc"
    """Collaboration name; peers with different run ids never interact."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the collaboration (empty: start a new one)."""
    host_maddrs: tuple[str, ...] = ()
    """Where to listen (empty: loopback when every initial peer is on this machine, as in the local
    demo; else every interface over TCP and QUIC on a random port; see ``listen_maddrs``)."""
    announce_maddrs: tuple[str, ...] = ()
    """Public addresses to announce, if different from host_maddrs."""
    identity_path: str | None = None
    """File holding the private key; created if missing. Keeps the peer ID across restarts."""
    name: str = ""
    """How people see this peer on the dashboard, in the ledger and in the trainers' tables, beside
    its short id (at most 32 printable characters; empty: the short id alone). What a peer says of
    itself: two peers may share a name, so the id stays beside it."""
    client_mode: bool = False
    """Accept no inbound connections: the peer dials out only and never aggregates."""
    reachability: str = field(default="auto", metadata={"choices": REACHABILITY})
    """'auto': find out with a dial-back probe by the initial peers whether others can connect to
    this peer; 'public' or 'private': declare it. A private peer never leads and aggregates only
    over direct paths to every member; it keeps a slot on the run's relays and punches holes to
    other peers (docs/nat.md)."""
    relays: tuple[str, ...] = ()
    """Multiaddrs of the run's relays, for a private peer (empty: the initial peers)."""
    relay_service: bool | None = None
    """Relay connections for the run's private peers (None: the role decides; backbones relay)."""
    owner: str = ""
    """The run owner's public key, as `dedloc run init` prints it (empty: an open run, where any
    peer that knows the run id and an address may take part). With it, the run is invite-only:
    every stream, DHT request and record must come from a peer holding the owner's invitation."""
    invite: str = ""
    """This peer's invitation to an invite-only run (`dedloc invite PEER_ID` prints it), or a file
    holding it: the file is re-read when it changes, so writing a new invitation into it renews a
    running peer."""
    revocations: str = ""
    """The owner's revocation list file (`dedloc revoke` writes it): this peer applies it and
    publishes it to the run, re-reading it every 30 s. Usually given to the owner's backbone."""
    startup_timeout: float = 60.0
    """Seconds to wait for the background process, the daemon and the DHT bootstrap."""
    join_timeout: float = 300.0
    """Seconds to keep trying while none of the initial peers answers (a backbone rebooting): the
    peer retries every JOIN_RETRY_S, saying so once, and raises JoinError after this (0: at once)."""
    progress_ttl: float = 30.0
    """Seconds a published progress record stays valid."""
    log_level: str = "INFO"
    metrics_port: int = -1
    """Serve this peer's Prometheus metrics on this port (monitor/peer_metrics.py) and the p2p
    daemon's on the next one (-1: none)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics are served on (loopback unless told otherwise)."""

    def listen_maddrs(self) -> tuple[str, ...]:
        """``host_maddrs``, or the default chosen from where the initial peers are."""
        if self.host_maddrs:
            return tuple(self.host_maddrs)
        if all(_is_loopback(a) for a in self.initial_peers):
            return LOOPBACK_HOST_MADDRS
        return ANY_HOST_MADDRS

    def validate(self) -> "PeerConfig":
        _check(self.reachability in REACHABILITY, "reachability", f"must be one of {REACHABILITY}")
        _check(not (self.relay_service and self.client_mode), "relay_service", "cannot be used in client mode")
        _check(not (self.relay_service and self.reachability == "private"), "relay_service",
               "needs a publicly reachable peer (reachability 'auto' or 'public')")
        _check(name_ok(self.name), "name", f"must be at most {MAX_NAME} printable characters without spaces at "
               f"either end (got {self.name!r})")
        _check(bool(self.run_id) and all(c.isalnum() or c in "-_" for c in self.run_id), "run_id",
               f"must be non-empty letters, digits, '-' or '_' (got {self.run_id!r})")
        for addr in self.initial_peers:  # '1.2.3.4:31337' is what people try first
            _check(isinstance(addr, str) and addr.startswith("/"), "initial_peers",
                   f"{addr!r} is not a multiaddr: give the address a peer of the run prints, such as "
                   f"/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... (the backbone prints its own at start)")
        for addr in tuple(self.host_maddrs) + tuple(self.announce_maddrs) + tuple(self.relays):
            _check(isinstance(addr, str) and addr.startswith("/"), "multiaddr", f"must start with '/' (got {addr!r})")
        _check(not (self.invite and not self.owner), "invite", "needs the run owner's public key (owner)")
        _check(not (self.revocations and not self.owner), "revocations", "needs the run owner's public key (owner)")
        if self.owner:
            from dedloc.auth.invitation import owner_public_key
            owner_public_key(self.owner)
        _check(self.startup_timeout > 0, "startup_timeout", "must be > 0")
        _check(self.join_timeout >= 0, "join_timeout", "must be >= 0")
        _check(0 < self.progress_ttl <= 1800, "progress_ttl", "must be > 0 and at most 1800 (records live at most 1 h)")
        _check(self.metrics_port == -1 or 0 < self.metrics_port < 65535, "metrics_port",
               "must be -1 (none) or a port below 65535 (the daemon's metrics take the next one)")
        _check(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
               "must be DEBUG, INFO, WARNING or ERROR")
        return self


@dataclass
class AveragingConfig:
    """How averaging rounds are formed and run."""

    matchmaking_time: float = 3.0
    """Longest wait for the expected peers to declare themselves ready for a step."""
    averaging_timeout: float = 60.0
    """Deadline for a whole round after matchmaking; on expiry every member gets an error."""
    max_group_size: int = 64
    """Largest all-reduce group; larger collaborations reduce hierarchically."""
    strategy: str = field(default="partitioned", metadata={"choices": STRATEGIES})
    """'partitioned' (reduce-scatter + all-gather, fault tolerant) or 'ring'."""
    compression: str = field(default="none", metadata={"choices": COMPRESSIONS})
    """'none' or 'float16' on the wire."""
    chunk_bytes: int = 4 << 20
    """Bytes per socket write/read when streaming a part."""
    transport: str = field(default="auto", metadata={"choices": TRANSPORTS})
    """How round streams travel: 'auto' (direct TCP connections between members that can reach
    each other, libp2p streams for the other pairs and whenever a direct connection fails) or
    'libp2p' (every stream through the p2p daemon). Set by a round's leader for its group."""
    encryption: bool = True
    """TLS 1.3 on direct connections. False only on a trusted network: this peer then listens in
    plaintext, and rounds it leads accept plaintext endpoints (docs/wire.md)."""
    data_port: int = 0
    """TCP port for direct connections (0: any free port)."""
    verify: bool = False
    """Verified rounds (set by a round's leader for its group): every part's backup aggregator
    recomputes the part from copies of the same contributions and confirms it only if the
    aggregator's result matches; every member checks its copy against the backup's digest. A
    mismatch fails the part over to the backup and names the aggregator. Costs each sender a
    second upload of its contributions (docs/averaging.md, "Verified rounds")."""
    share: float | None = None
    """This peer's aggregation share hint (None: 1 for reachable peers, 0 in client mode). 0 means
    never aggregate, whatever the planner says; other values matter only with planner='declared'."""
    aggregator_only: bool = False
    """This peer trains nothing: it aggregates parts for the others and needs no result
    (a CPU helper with good bandwidth). It averages with weight 0."""
    planner: str = field(default="lp", metadata={"choices": PLANNERS})
    """How a round's leader sets the shares: 'lp' (the linear program over measured capabilities),
    'equal' (butterfly), 'bandwidth' (proportional to each peer's bandwidth) or 'declared'
    (each peer's own share hint)."""
    upload_mbps: float | None = None
    """This peer's upload in Mbit/s, overriding the measurement (None: measure)."""
    download_mbps: float | None = None
    """This peer's download in Mbit/s, overriding the measurement (None: measure)."""
    probe_interval: float = 120.0
    """Seconds between active bandwidth probes to a few peers (0: passive measurement only)."""
    probe_peers: int = 3
    """How many peers each probe reaches at once."""
    probe_mb: float = 4.0
    """MiB sent to (and pulled from) each probed peer."""
    replan_interval: float = 120.0
    """Seconds between refreshes of everyone's capabilities for planning (members changing also
    triggers one)."""

    def validate(self) -> "AveragingConfig":
        _check(self.matchmaking_time > 0, "matchmaking_time", "must be > 0")
        _check(self.averaging_timeout > 0, "averaging_timeout", "must be > 0")
        _check(self.max_group_size >= 2, "max_group_size", "must be >= 2")
        _check(self.strategy in STRATEGIES, "strategy", f"must be one of {STRATEGIES}")
        _check(self.compression in COMPRESSIONS, "compression", f"must be one of {COMPRESSIONS}")
        _check(self.chunk_bytes >= 4096, "chunk_bytes", "must be >= 4096")
        _check(self.transport in TRANSPORTS, "transport", f"must be one of {TRANSPORTS}")
        _check(0 <= self.data_port < 65536, "data_port", "must be a TCP port (0: any)")
        _check(self.share is None or self.share >= 0, "share", "must be >= 0")
        _check(self.planner in PLANNERS, "planner", f"must be one of {PLANNERS}")
        for name in ("upload_mbps", "download_mbps"):
            value = getattr(self, name)
            _check(value is None or value > 0, name, "must be > 0 or None")
        _check(self.probe_interval >= 0, "probe_interval", "must be >= 0")
        _check(self.probe_peers >= 1, "probe_peers", "must be >= 1")
        _check(0 < self.probe_mb <= 64, "probe_mb", "must be in (0, 64]")
        _check(self.replan_interval > 0, "replan_interval", "must be > 0")
        _check(not (self.aggregator_only and self.share == 0), "aggregator_only", "needs a share other than 0")
        return self


@dataclass
class OptimizerConfig:
    """How the collaborative optimizer turns many peers' micro-batches into one large-batch step."""

    target_batch_size: int = 4096
    """Samples the whole collaboration processes per optimizer step (the global batch)."""
    delay_updates: bool = False
    """Delayed parameter updates: average and step in the background while the next step's
    micro-batches are computed (one step of staleness; peers stay identical)."""
    clip_grad_norm: float | None = None
    """Clip the averaged gradient to this global L2 norm before the step (None: no clipping)."""
    max_gather_wait: float = 30.0
    """Longest a peer waits at the step boundary for slower peers' in-flight micro-batches."""
    state_timeout: float = 120.0
    """Deadline for downloading the collaboration's state when joining or resyncing."""
    max_state_bytes: int | None = None
    """Largest state accepted from a donor (None: 4x the model's parameters and buffers, in bytes,
    plus 64 MiB: room for an optimizer holding two moments per parameter)."""
    verify_sync: bool = True
    """Publish a hash of the parameters after each step; a peer that disagrees with the majority
    downloads the state again."""
    hand_on_timeout: float = 30.0
    """On leaving (``close``), a trainer that holds a step no other peer serving its state holds
    yet serves it up to this long, until one does (0: leave at once)."""
    run_hash: str = ""
    """A hash of the settings every peer of the run must share (``dedloc train``: the recipe's run-wide
    values, ``roles/manifest.recipe_hash``), published with this peer's progress. Joining, a peer
    whose hash is not the run's (``CollaborationView.settings_mismatch``) is refused by name before it
    downloads anything. Empty: not published, not checked."""

    def validate(self) -> "OptimizerConfig":
        _check(self.target_batch_size >= 1, "target_batch_size", "must be >= 1")
        _check(self.clip_grad_norm is None or self.clip_grad_norm > 0, "clip_grad_norm", "must be > 0 or None")
        _check(self.max_gather_wait >= 0, "max_gather_wait", "must be >= 0")
        _check(self.state_timeout > 0, "state_timeout", "must be > 0")
        _check(self.max_state_bytes is None or self.max_state_bytes > 0, "max_state_bytes", "must be > 0 or None")
        _check(self.hand_on_timeout >= 0, "hand_on_timeout", "must be >= 0")
        _check(len(self.run_hash) <= MAX_RUN_HASH and self.run_hash.isprintable(), "run_hash",
               f"must be printable, at most {MAX_RUN_HASH} characters")
        return self


@dataclass
class BackboneConfig:
    """A backbone peer: keeps the DHT alive, pulls the state, writes checkpoints, serves newcomers."""

    checkpoint_dir: str = "checkpoints"
    """Where checkpoints go (created if missing)."""
    checkpoint_interval: float = 60.0
    """Seconds between state pulls; a checkpoint is written when the step has advanced."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""
    resume: bool = True
    """Load the newest checkpoint at start and serve it (resuming a stopped collaboration)."""
    dashboard_port: int = -1
    """Serve the run's dashboard on this port (``dedloc monitor``'s page; 0: any free port; -1: none)."""
    ledger: str = "ledger.json"
    """The contribution ledger's file, in checkpoint_dir (monitor/ledger.py); kept across restarts."""
    memory: str = "run.json"
    """What this backbone remembers of the run across restarts, in checkpoint_dir
    (state/run_memory.py): the newest step it saw and its peers' addresses."""
    refind_timeout: float = 120.0
    """Seconds a restarted backbone whose checkpoint is older than the newest step it saw looks for
    the run before it concludes the run ended (no trainer holds that step) and serves its checkpoint."""

    def validate(self) -> "BackboneConfig":
        _check(bool(self.checkpoint_dir), "checkpoint_dir", "must be a path")
        _check(self.checkpoint_interval > 0, "checkpoint_interval", "must be > 0")
        _check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        _check(-1 <= self.dashboard_port < 65536, "dashboard_port", "must be -1 (none), 0 (any) or a port")
        _check(bool(self.ledger) and "/" not in self.ledger, "ledger", "must be a file name")
        _check(bool(self.memory) and "/" not in self.memory and self.memory != self.ledger, "memory",
               "must be a file name other than the ledger's")
        _check(self.refind_timeout > 0, "refind_timeout", "must be > 0")
        return self


@dataclass
class MonitorConfig:
    """The dashboard (``dedloc monitor``, a backbone's or the demo's): a read-only web page, /api/state, /metrics."""

    port: int = 8080
    """Port of the web page, /api/state and /metrics."""
    bind: str = "127.0.0.1"
    """Address to serve on: loopback unless told otherwise (the page is read-only, but it names every peer)."""
    poll_interval: float = 2.0
    """Seconds between two readings of the run's records."""
    tensorboard_dir: str = ""
    """Also write the collaboration's loss, samples/s and peers as TensorBoard events here (needs tensorboard)."""
    wandb_project: str = ""
    """Also log them to this Weights & Biases project (needs wandb and its login)."""

    def validate(self) -> "MonitorConfig":
        _check(0 <= self.port < 65536, "port", "must be 0 (any free port) to 65535")
        _check(self.poll_interval > 0, "poll_interval", "must be > 0")
        _check(bool(self.bind), "bind", "must name an address")
        return self


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build a config from a dict, refusing unknown keys by name."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"invalid config: unknown field(s) {unknown} for {cls.__name__}")
    obj = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    return obj.validate()


__all__ = ["PeerConfig", "AveragingConfig", "OptimizerConfig", "BackboneConfig", "to_dict", "from_dict", "field"]
