"""The user-facing peer: join a collaboration, publish progress, average tensors.

Example::

    peer = Peer(PeerConfig(run_id="demo", initial_peers=[...]))
    result = peer.average(grad_vector, step=3, weight=64)   # in place; identical on all members
    peer.close()

Guarantees: networking runs in a background process (see net/runtime.py), so a busy training
thread does not stall it; ``average`` overwrites the tensor only on success and raises
MissedRoundError / MatchmakingError / AveragingError otherwise, within its deadlines.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import time
from typing import Any

import torch

from dedloc.averaging.bounds import WeightBounds
from dedloc.averaging.outcome import RoundOutcome
from dedloc.config import AveragingConfig, PeerConfig
from dedloc.errors import AveragingError, BootstrapError
from dedloc.net.runtime import Runtime, SharedBuffer
from dedloc.optim.port import PeerPort
from dedloc.peer_api import PeerAPI
from dedloc.records import CollaborationView, ProgressRecord, Role

logger = logging.getLogger(__name__)
JOIN_RETRY_S = 5.0
"""Seconds between tries to join while none of the initial peers answers."""


class Peer(PeerPort):
    """One member of a collaboration, running its networking in a background process."""

    def __init__(self, config: PeerConfig | None = None, averaging: AveragingConfig | None = None):
        self.config = (config or PeerConfig()).validate()
        self.averaging = (averaging or AveragingConfig()).validate()
        self.progress_ttl = self.config.progress_ttl
        self.runtime = self._start()
        self.peer_id: str = self.runtime.info["peer_id"]
        self.maddrs: list[str] = self.runtime.info["maddrs"]
        self.reachable: bool = self.runtime.info["reachable"]
        """Others can connect to this peer directly (found by a dial-back probe, or declared)."""
        self.reachability: str = self.runtime.info["reachability"]
        """Why: who connected back to which address, or why nobody could."""
        self._buffers: dict[str, SharedBuffer] = {}
        self._free: dict[int, list[str]] = {}
        """Shared buffers not in use, by size: each averaging call leases its own until finish()."""

    def _start(self) -> Runtime:
        """The background process, once it joined; while none of the initial peers answers (they may
        be restarting), tried again every JOIN_RETRY_S for ``join_timeout`` (one INFO line)."""
        deadline, said = time.monotonic() + self.config.join_timeout, False
        while True:
            try:
                return Runtime("dedloc.service:create", (self.config, self.averaging), api=PeerAPI,
                               startup_timeout=self.config.startup_timeout, log_level=self.config.log_level)
            except BootstrapError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BootstrapError(f"{e} (kept trying for {self.config.join_timeout:.0f} s)") from None
                if not said:
                    said = True
                    logger.info(f"none of the initial peers answers (they may be restarting): trying again every "
                                f"{JOIN_RETRY_S:.0f} s for up to {self.config.join_timeout:.0f} s")
                time.sleep(min(JOIN_RETRY_S, left))

    @property
    def role(self) -> Role:
        if self.averaging.aggregator_only:
            return Role.AGGREGATOR
        return Role.CLIENT if self.config.client_mode else Role.TRAINER

    # ---- progress -------------------------------------------------------------------------------------
    def publish_progress(self, step: int, samples: int, samples_per_second: float, *, role: Role | None = None,
                         bandwidth: float = 0.0) -> None:
        record = ProgressRecord(self.peer_id, step, samples, samples_per_second, role or self.role, bandwidth,
                                time.time())
        self.runtime.call(PeerAPI.publish_progress, record.to_wire(), self.config.progress_ttl)

    def collaboration(self) -> CollaborationView:
        return CollaborationView.build(self.runtime.call(PeerAPI.read_progress))

    def report(self, record: ProgressRecord) -> tuple[CollaborationView, bool]:
        """Publish ``record`` and read everyone's in one call; also returns whether a peer wants our state."""
        return self.report_async(record).result()

    def report_async(self, record: ProgressRecord) -> "cf.Future[tuple[CollaborationView, bool]]":
        """:meth:`report` without waiting: a future of its result (errors as in :meth:`report`)."""
        raw = self.runtime.call_async(PeerAPI.report, record.to_wire(), self.config.progress_ttl)
        out: cf.Future = cf.Future()

        def done(f: cf.Future) -> None:
            try:
                records, wanted = f.result()
                out.set_result((CollaborationView.build(records), wanted))
            except BaseException as e:  # noqa: BLE001: handed to whoever reads the future
                out.set_exception(e)

        raw.add_done_callback(done)
        return out

    def leave(self) -> None:
        """Announce that this peer left (others stop waiting for it); close() still has to be called."""
        self.runtime.call(PeerAPI.leave, 2 * self.config.progress_ttl)

    # ---- training state ---------------------------------------------------------------------------------
    def offer_state(self, step: int, blob: bytes, history: list[str] | None = None) -> None:
        """Make ``blob`` (a state at ``step``, see state/snapshot.py) available to peers that ask for it;
        ``history``: its lineage (``"t:h"`` per step, state/lineage.py), sent ahead of the bytes."""
        self.runtime.call(PeerAPI.offer_state, step, blob, list(history or ()))

    def download_state(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                       votes: dict[str, str] | None = None, max_step: int | None = None) -> tuple[int, bytes, str]:
        """Download a state at step >= ``min_step`` from the first of ``donors`` that has one.

        Returns (step, blob, donor); raises StateError naming each donor's failure. A donor that
        announces more than ``max_bytes`` (None: the 64 GiB protocol cap) is refused before any
        byte of the state is read: size it from what this peer expects (its own model). So is a
        donor whose announced lineage the live peers' fingerprints ``votes`` outvote (a fork;
        state/lineage.py): when no donor succeeded and some were forks, it raises ForkError with
        those donors in ``peers``. So is a donor announcing a step above ``max_step`` (the run's
        attested step, ``CollaborationView.global_step``, plus the one a catch-up may be behind).
        The blob itself must still be checked against its own fingerprint.
        """
        return self.download_state_async(donors, min_step, timeout, max_bytes, votes, max_step).result(timeout + 30)

    def download_state_async(self, donors: list[str], min_step: int, timeout: float, max_bytes: int | None = None,
                             votes: dict[str, str] | None = None,
                             max_step: int | None = None) -> "cf.Future[tuple[int, bytes, str]]":
        """:meth:`download_state` without waiting: a future of its result (errors as there)."""
        return self.runtime.call_async(PeerAPI.download_state, list(donors), min_step, timeout, max_bytes,
                                       dict(votes) if votes else None, max_step)

    # ---- averaging ------------------------------------------------------------------------------------
    def _lease(self, numel: int) -> str:
        """A shared buffer of ``numel`` floats that no other averaging call is using (its name)."""
        free = self._free.setdefault(numel, [])
        if free:
            return free.pop()
        name = f"b{numel}.{len(self._buffers)}"
        buf = SharedBuffer(numel)
        self.runtime.call(PeerAPI.register_buffer, name, buf.name, numel)
        self._buffers[name] = buf
        return name

    def average_async(self, tensor: torch.Tensor, *, step: int, weight: float, expected_peers: int | None = None,
                      timeout: float | None = None, gather_time: float | None = None,
                      bounds: WeightBounds | None = None):
        """Start averaging; returns (future of its RoundOutcome, finish) where finish() copies the result back.
        Concurrent calls never share a buffer: each holds its own until its finish() returns or raises."""
        if not tensor.is_floating_point():
            raise AveragingError(f"can only average floating-point tensors, got {tensor.dtype}")
        name = self._lease(tensor.numel())
        buf = self._buffers[name].tensor
        buf.copy_(tensor.detach().reshape(-1))  # one copy, from any device and dtype, into shared memory
        try:
            fut = self.runtime.call_async(PeerAPI.average, name, step, float(weight), expected_peers, timeout,
                                          gather_time, bounds)
        except BaseException:
            self._free[tensor.numel()].append(name)
            raise

        def finish() -> RoundOutcome:
            try:
                stats = fut.result()
                with torch.no_grad():
                    tensor.copy_(buf.view_as(tensor))
                return stats
            finally:
                if name in self._buffers:  # not closed meanwhile
                    self._free[tensor.numel()].append(name)

        return fut, finish

    def average(self, tensor: torch.Tensor, *, step: int, weight: float, expected_peers: int | None = None,
                timeout: float | None = None, gather_time: float | None = None,
                bounds: WeightBounds | None = None) -> RoundOutcome:
        """Replace ``tensor`` by the sample-weighted mean over this step's group; return the round's outcome.

        Matchmaking waits up to ``gather_time`` (default: matchmaking_time) for ``expected_peers``.
        ``bounds``: the largest weight each member may bring (averaging/bounds.py; None: only 2^40).
        Every part of a round averages one and the same set of contributions, named in
        ``outcome.contributors`` (peer ids; None for hierarchical groups); a round whose parts would
        average different sets (a sender that died between its parts) raises AveragingError on every
        member, naming whose contributions each part lacks, and leaves ``tensor`` untouched.
        """
        _, finish = self.average_async(tensor, step=step, weight=weight, expected_peers=expected_peers,
                                       timeout=timeout, gather_time=gather_time, bounds=bounds)
        return finish()

    # ---- planning ---------------------------------------------------------------------------------------
    def probe(self, peers: list[str] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        """Measure bandwidth to ``peers`` now (default: a few random reachable ones) and publish it.

        Returns rates in bytes/s: ``pushed``/``pulled`` per peer, ``upload``/``download`` overall,
        and ``failed`` peers with reasons.
        """
        return self.runtime.call_async(PeerAPI.probe, peers).result(timeout)

    def connections(self) -> dict[str, dict[str, Any]]:
        """Open connections: peer id -> ``{"direct": bool, "addrs": [...]}`` (``direct``: not only
        through a relay, e.g. after hole punching)."""
        return self.runtime.call(PeerAPI.connections)

    def read_records(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """The run's raw DHT records under ``names`` (``progress``, ``caps``, ``rounds``, ``ledger``):
        name -> {peer id: value}. Validate them with the record types of dedloc.records."""
        return self.runtime.call(PeerAPI.read_records, list(names))

    def publish_record(self, name: str, value: Any, ttl: float) -> bool:
        """Store ``value`` under this peer's subkey of record ``name`` (only ``ledger``)."""
        return self.runtime.call(PeerAPI.publish_record, name, value, ttl)

    def rejoin(self, maddrs: list[str], timeout: float = 5.0) -> list[str]:
        """Connect to the peers at ``maddrs`` and add those that answer to this peer's DHT routing
        table (a restarted backbone finding its run again); returns the peer ids that answered."""
        return self.runtime.call_async(PeerAPI.rejoin, list(maddrs), timeout).result(timeout + 10)

    def stream_counts(self) -> dict[str, int]:
        """How many streams outside rounds (state downloads, probes) this peer opened over direct
        connections (``direct``) and over libp2p (``libp2p``, the fallback)."""
        return self.runtime.call(PeerAPI.stream_counts)

    def capabilities(self) -> dict[str, Any]:
        """Everyone's capability records as read now (``peers``: id -> record) and the last plan
        this peer made as a round's leader (``plan``: peers, shares, strategy, predicted_s)."""
        return self.runtime.call(PeerAPI.capabilities)

    def reconfigure(self, *, planner: str | None = None, strategy: str | None = None,
                    compression: str | None = None) -> None:
        """Change how the rounds this peer leads are planned and run; raises ConfigError on a bad value."""
        changes = {k: v for k, v in dict(planner=planner, strategy=strategy, compression=compression).items()
                   if v is not None}
        self.runtime.call(PeerAPI.reconfigure, changes)

    def _dht_read_timeout(self) -> float:
        """How long the training loop waits for the runtime to answer one DHT read (a matchmaking
        window's worth of slow nodes, and a margin for a busy runtime)."""
        return 2 * self.averaging.matchmaking_time + 10

    def pending_round(self, step: int) -> int:
        """The size of the vector contributing peers are ready to average for ``step`` (0: none yet).
        Raises DedlocError if the DHT cannot be read, TimeoutError if the runtime does not answer
        within ``2 * matchmaking_time + 10`` s."""
        return self.runtime.call_async(PeerAPI.pending_round, step).result(self._dht_read_timeout())

    def closed_round(self, step: int) -> dict[str, list[str]]:
        """Members of each group that closed for ``step`` (leader -> peer ids), read from the DHT."""
        return self.runtime.call(PeerAPI.closed_round, step)

    def round_deadline(self, step: int) -> float | None:
        """Until when (wall clock) a round of ``step`` may still finish: the latest deadline of the
        groups that closed it, plus a grace for clock skew; None if none did. Raises DedlocError if
        the DHT cannot be read, TimeoutError if the runtime does not answer within
        ``2 * matchmaking_time + 10`` s."""
        return self.runtime.call_async(PeerAPI.round_deadline, step).result(self._dht_read_timeout())

    # ---- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        self.runtime.close()
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
        self._free.clear()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_peers(configs: list[PeerConfig],
                averaging: AveragingConfig | list[AveragingConfig | None] | None = None) -> list[Peer]:
    """Start the first peer, then the others in parallel, bootstrapping from the first.

    ``averaging`` is one config for all or a list with one per peer. Peers whose config already
    names initial peers keep them. If any peer fails to start, the ones already started are
    closed and the error is raised.
    """
    avg = list(averaging) if isinstance(averaging, (list, tuple)) else [averaging] * len(configs)
    if len(avg) != len(configs):
        raise ValueError(f"{len(configs)} peer configs but {len(avg)} averaging configs")
    first = Peer(configs[0], avg[0])
    started = [first]
    try:
        def start(cfg: PeerConfig, averaging: AveragingConfig | None) -> Peer:
            if not cfg.initial_peers:
                cfg = dataclasses.replace(cfg, initial_peers=tuple(first.maddrs))
            return Peer(cfg, averaging)

        with cf.ThreadPoolExecutor(max(1, len(configs) - 1)) as pool:
            futures = [pool.submit(start, c, a) for c, a in zip(configs[1:], avg[1:])]
        errors = [f.exception() for f in futures if f.exception() is not None]
        started += [f.result() for f in futures if f.exception() is None]
        if errors:
            raise errors[0]
        return started
    except BaseException:
        for p in started:
            p.close()
        raise
