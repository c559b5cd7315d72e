"""One peer's Prometheus metrics (``PeerConfig.metrics_port``), served by its background process.

``/metrics`` on ``metrics_host:metrics_port`` (loopback by default): the peer's step, samples/s
and loss (from the progress it publishes), resyncs and catch-ups (its optimizer's counts), rounds,
round and matchmaking times, failovers, bytes sent and received in rounds, and state downloads.
The p2p daemon's own metrics (libp2p's) are on the next port, ``metrics_port + 1``
(node.py starts the daemon with ``-metricsAddr``).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from dedloc.averaging.outcome import RoundOutcome
from dedloc.errors import ConfigError

logger = logging.getLogger(__name__)
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class PeerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.step = Gauge("dedloc_step", "The global step this peer is at", registry=r)
        self.samples_per_second = Gauge("dedloc_samples_per_second", "This peer's training speed", registry=r)
        self.loss = Gauge("dedloc_loss", "This peer's mean loss at its last finished step", registry=r)
        self.resyncs = Gauge("dedloc_resyncs", "State downloads to rejoin the collaboration", registry=r)
        self.catchups = Gauge("dedloc_catchups", "Catch-ups after a delayed round failed", registry=r)
        self.rounds = Counter("dedloc_rounds", "Averaging rounds finished", registry=r)
        self.failovers = Counter("dedloc_failovers", "Parts taken from a backup in finished rounds", registry=r)
        self.round_seconds = Histogram("dedloc_round_seconds", "All-reduce time of finished rounds",
                                       buckets=_SECONDS, registry=r)
        self.matchmaking_seconds = Histogram("dedloc_matchmaking_seconds", "Matchmaking time of finished rounds",
                                             buckets=_SECONDS, registry=r)
        self.sent = Counter("dedloc_sent_bytes", "Payload bytes sent in rounds", registry=r)
        self.received = Counter("dedloc_received_bytes", "Payload bytes received in rounds", registry=r)
        self.state_downloads = Counter("dedloc_state_downloads", "States downloaded from other peers", registry=r)
        self._server: Any = None

    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` (a thread of prometheus_client's)."""
        try:
            self._server, _ = start_http_server(port, host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {host}:{port} (metrics_port): {e.strerror or e}") from None
        logger.info(f"metrics on http://{host}:{port}/metrics (the daemon's on port {port + 1})")

    def progress(self, record: dict[str, Any]) -> None:
        self.step.set(record.get("step", 0))
        self.samples_per_second.set(record.get("samples_per_second", 0.0))
        if record.get("loss_samples"):
            self.loss.set(record.get("loss", 0.0))
        self.resyncs.set(record.get("resyncs", 0))
        self.catchups.set(record.get("catchups", 0))

    def round(self, outcome: RoundOutcome) -> None:
        self.rounds.inc()
        self.failovers.inc(outcome.failovers)
        self.round_seconds.observe(outcome.allreduce_s)
        self.matchmaking_seconds.observe(outcome.matchmaking_s)

    def transfers(self, sent: int, received: int) -> None:
        self.sent.inc(sent)
        self.received.inc(received)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


__all__ = ["PeerMetrics"]
