"""A monitor peer (``dedloc monitor``): trains nothing, aggregates nothing, publishes no progress;
it reads the run's records and serves the dashboard (monitor/server.py).

It joins like any peer, in client mode (it accepts no connections, so it needs no open port), and
in an invite-only run it needs an invitation like any member: the records it shows are the
members'. It runs no bandwidth probes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

from dedloc.config import AveragingConfig, MonitorConfig, PeerConfig
from dedloc.monitor.server import DashboardThread
from dedloc.peer import Peer


class Monitor:
    def __init__(self, peer_config: PeerConfig, config: MonitorConfig | None = None):
        self.config = (config or MonitorConfig()).validate()
        self.peer = Peer(dataclasses.replace(peer_config, client_mode=True), AveragingConfig(probe_interval=0))
        try:
            self.dashboard = DashboardThread(self.peer.read_records, peer_config.run_id, self.config)
        except BaseException:
            self.peer.close()
            raise

    @property
    def url(self) -> str:
        return self.dashboard.url

    @property
    def maddrs(self) -> list[str]:
        return self.peer.maddrs

    def run(self, stop: threading.Event) -> None:
        print(f"dashboard at {self.url}", flush=True)
        stop.wait()

    def close(self) -> None:
        self.dashboard.close()
        self.peer.close()


def read_ledger(peer_config: PeerConfig, timeout: float = 30.0) -> tuple[str, list[dict]]:
    """The run's contribution ledger as the dashboard shows it (``Collector.leaderboard``: a
    backbone's when one publishes it, else the sum of the credits in the DHT): (its source, rows).
    Joins in client mode, reads, leaves. Waits up to ``timeout`` s for a backbone's ledger (a peer
    just joined may not see the records at once); then takes what it has."""
    from dedloc.monitor.collector import Collector

    peer = Peer(dataclasses.replace(peer_config, client_mode=True), AveragingConfig(probe_interval=0))
    try:
        async def read(names: list[str]) -> dict:
            return await asyncio.to_thread(peer.read_records, names)

        collector = Collector(read, peer_config.run_id)
        deadline = time.monotonic() + timeout
        while True:
            asyncio.run(collector.poll())
            if collector.backbone_ledgers or time.monotonic() > deadline:
                return collector.leaderboard()
            time.sleep(1.0)
    finally:
        peer.close()

