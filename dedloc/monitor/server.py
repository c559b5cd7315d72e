"""The dashboard's web server (aiohttp): the page, its JSON and the collaboration's metrics.

Routes, all read-only (GET):
- ``/``: the page (monitor/page.html). It polls ``/api/state`` and redraws without reloading;
  charts are Plotly's, served from the installed ``plotly`` package (``/plotly.min.js``): no CDN,
  so the page works on a network without internet;
- ``/api/state``: everything the page shows, as JSON (monitor/collector.py ``state()``);
- ``/api/ledger.csv``: the contribution ledger the page shows, as CSV;
- ``/metrics``: Prometheus text: the collaboration's step, samples/s, loss, peers and rounds.

It binds to 127.0.0.1 unless told otherwise. :class:`Dashboard` serves on the caller's event loop;
:class:`DashboardThread` runs one on a thread of its own for a synchronous program (a backbone,
the demo), reading records through a peer; ``close()`` stops it and joins the thread.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import threading
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from dedloc.config import MonitorConfig
from dedloc.errors import ConfigError
from dedloc.monitor.collector import Collector, Read
from dedloc.monitor.ledger import rows_csv
from dedloc.monitor.sinks import Curves, make_sinks

logger = logging.getLogger(__name__)


def _plotly_js() -> bytes:
    return importlib.resources.files("plotly").joinpath("package_data/plotly.min.js").read_bytes()


class _Metrics:
    """A Prometheus collector reading the dashboard's state at scrape time."""

    def __init__(self, collector: Collector):
        self.c = collector

    def collect(self):
        state = self.c.state()
        g = GaugeMetricFamily
        yield g("dedloc_global_step", "The collaboration's global step", value=state["step"])
        speed = self.c.speed[-1][1] if self.c.speed else 0.0
        yield g("dedloc_samples_per_second", "Samples/s over all trainers", value=speed)
        if state["loss"]["loss"]:
            yield g("dedloc_loss", "The collaboration's loss at its newest step with losses",
                    value=state["loss"]["loss"][-1])
        peers = g("dedloc_peers", "Live peers by role", labels=["role"])
        roles: dict[str, int] = {}
        for p in state["peers"]:
            roles[p["role"]] = roles.get(p["role"], 0) + 1
        for role, n in sorted(roles.items()):
            peers.add_metric([role], n)
        yield peers
        if state["rounds"]:
            last = state["rounds"][0]
            yield g("dedloc_round_seconds", "Duration of the newest round", value=last["measured_s"])
            yield g("dedloc_round_failovers", "Failovers in the newest round", value=last["failovers"])


class Dashboard:
    """The dashboard on the running event loop: ``await start()`` serves, ``await close()`` stops."""

    def __init__(self, read: Read, run_id: str, config: MonitorConfig):
        self.config = config.validate()
        self.collector = Collector(read, run_id, config.poll_interval)
        self.curves = Curves(make_sinks(config.tensorboard_dir, config.wandb_project, run_id))
        self.registry = CollectorRegistry()
        self.registry.register(_Metrics(self.collector))
        self._runner: web.AppRunner | None = None
        self._poller: asyncio.Task | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.config.bind if self.config.bind not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}/"

    async def start(self) -> str:
        """Start polling and serving; returns the page's URL."""
        app = web.Application()
        page = importlib.resources.files("dedloc.monitor").joinpath("page.html").read_bytes()
        plotly = _plotly_js()

        async def index(_: web.Request) -> web.Response:
            return web.Response(body=page, content_type="text/html")

        async def js(_: web.Request) -> web.Response:
            return web.Response(body=plotly, content_type="application/javascript",
                                headers={"Cache-Control": "max-age=86400"})

        async def state(_: web.Request) -> web.Response:
            return web.Response(text=json.dumps(self.collector.state()), content_type="application/json")

        async def ledger(_: web.Request) -> web.Response:
            return web.Response(text=rows_csv(self.collector.leaderboard()[1]), content_type="text/csv")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app.add_routes([web.get("/", index), web.get("/plotly.min.js", js), web.get("/api/state", state),
                        web.get("/api/ledger.csv", ledger), web.get("/metrics", metrics)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.bind, self.config.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            raise ConfigError(f"cannot serve the dashboard on {self.config.bind}:{self.config.port}: "
                              f"{e.strerror or e}") from None
        self.port = site._server.sockets[0].getsockname()[1]  # the bound port when config.port is 0
        self._poller = asyncio.create_task(self.collector.run(on_poll=self.curves.update))
        logger.info(f"dashboard at {self.url} (read-only; bound to {self.config.bind})")
        return self.url

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        self.curves.close()


class DashboardThread:
    """A :class:`Dashboard` on its own thread and event loop, reading records with ``read_records``
    (a blocking call, e.g. ``Peer.read_records``; run on the loop's executor)."""

    def __init__(self, read_records: Callable[[list[str]], dict[str, dict[str, Any]]], run_id: str,
                 config: MonitorConfig):
        self._read_records = read_records
        self.dashboard: Dashboard | None = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, args=(run_id, config), name="dedloc-dashboard",
                                        daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error
        if self.dashboard is None:
            raise TimeoutError("the dashboard did not start within 30 s")

    @property
    def url(self) -> str:
        assert self.dashboard is not None
        return self.dashboard.url

    def _main(self, run_id: str, config: MonitorConfig) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(run_id, config))
        self._loop.close()

    async def _serve(self, run_id: str, config: MonitorConfig) -> None:
        loop = asyncio.get_running_loop()

        async def read(names: list[str]) -> dict[str, dict[str, Any]]:
            return await loop.run_in_executor(None, self._read_records, names)

        self._stop = asyncio.Event()
        dashboard = None
        try:
            dashboard = Dashboard(read, run_id, config)
            await dashboard.start()
        except BaseException as e:
            self._error = e
            self._started.set()
            if dashboard is not None:
                await dashboard.close()
            return
        self.dashboard = dashboard
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await dashboard.close()

    def close(self) -> None:
        """Stop serving and join the thread (bounded)."""
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


__all__ = ["Dashboard", "DashboardThread"]
