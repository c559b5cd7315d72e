"""The dashboard (monitor/): records it reads, the contribution ledger, a backbone's dashboard and
ledger with real peers and rounds, per-peer Prometheus metrics, `dedloc monitor`, and the page in
a real browser (Debian's chromium driven by Playwright)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
import torch

from dedloc.config import AveragingConfig, BackboneConfig, PeerConfig
from dedloc.monitor.collector import Collector
from dedloc.monitor.ledger import Ledger
from dedloc.peer import Peer
from dedloc.records import CreditRecord, LedgerRecord, ProgressRecord, Role, RoundReport, label
from dedloc.roles.backbone import Backbone
from dedloc.testing.procs import sessions_alive, spawn_cli

from conftest import run_id

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _until(what: str, check, timeout: float = 60.0):
    """Poll ``check()`` (records travel through the DHT) until it returns a truthy value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (OSError, KeyError, ValueError) as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s (last: {last!r})")


def _free_port_pair() -> int:
    """A free port whose next port is free too (a peer's metrics, then its daemon's)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


# ---- records and the ledger, without peers ---------------------------------------------------------
def test_hostile_records_are_skipped_not_raised():
    good = ProgressRecord("a", 3, 0, 1.0, Role.TRAINER, loss=2.5, loss_step=2, loss_samples=8).to_wire()
    assert ProgressRecord.from_wire("a", good).loss == 2.5
    for bad in ({"loss": float("nan")}, {"loss": -1.0}, {"loss_samples": -1}, {"resyncs": "x"}, {"loss_step": -5}):
        assert ProgressRecord.from_wire("a", {**good, **bad}) is None, bad
    credit = CreditRecord("g", "i1", {"a": (10.0, 1.0, 3)}).to_wire()
    assert CreditRecord.from_wire("g", credit).totals == {"a": (10.0, 1.0, 3)}
    for bad in ({"c": {"a": [float("inf"), 1, 3]}}, {"c": {"a": [1, 1]}}, {"c": "x"}, {"i": None, "c": None}):
        assert CreditRecord.from_wire("g", {**credit, **bad}) is None, bad
    report = RoundReport("a", "ff", 3, ("a", "b"), (0.5, 0.5), "partitioned", 0.1, 0.2, 0).to_wire()
    assert RoundReport.list_from_wire("a", [report, {"r": 1}, report]) == [RoundReport.from_wire("a", report)] * 2
    assert RoundReport.from_wire("a", {**report, "h": [0.5]}) is None  # shares do not match the members
    assert RoundReport.list_from_wire("a", "not a list") == []
    row = {"peer": "a", "name": "Ana", "samples": 66, "rounds": 2.0, "last_step": 9}
    ledger = LedgerRecord("b", (row,), (4, 8)).to_wire()
    assert LedgerRecord.from_wire("b", ledger) == LedgerRecord("b", (row,), (4, 8))
    # a display name is the peer's own text: a terminal escape, a newline or a wall of text is refused
    assert ProgressRecord.from_wire("a", {**good, "name": "Ana"}).name == "Ana"
    for bad in ("\x1b[31mred", "two\nlines", "x" * 33, " padded", 7):
        assert ProgressRecord.from_wire("a", {**good, "name": bad}) is None, bad
        assert LedgerRecord.from_wire("b", {**ledger, "table": [{**row, "name": bad}]}).rows[0]["name"] == ""
    for bad in ({"table": [{**row, "samples": float("nan")}]}, {"table": [{"peer": "a"}]}, {"table": [row] * 201},
                {"checkpoints": [-1]}, {"checkpoints": "x"}):
        assert LedgerRecord.from_wire("b", {**ledger, **bad}) is None, bad


def test_the_ledger_sums_its_sources_keeps_departed_ones_and_survives_a_restart(tmp_path):
    ledger = Ledger()
    assert ledger.observe([CreditRecord("g1", "i1", {"a": (30.0, 0.5, 4), "b": (10.0, 0.5, 4)}),
                           CreditRecord("g2", "i1", {"a": (30.0, 0.5, 4), "b": (10.0, 0.5, 4)})])
    assert not ledger.observe([CreditRecord("g1", "i1", {"a": (30.0, 0.5, 4), "b": (10.0, 0.5, 4)})])  # no news
    # g1 restarts (a new incarnation, from 0); g2 left: its last totals still count
    ledger.observe([CreditRecord("g1", "i2", {"a": (6.0, 1.0, 9)})])
    assert ledger.table() == [{"peer": "a", "name": "", "samples": 66, "rounds": 2.0, "last_step": 9},
                              {"peer": "b", "name": "", "samples": 20, "rounds": 1.0, "last_step": 4}]
    assert ledger.to_csv().splitlines() == ["peer,name,samples,rounds,last_step", "a,,66,2.0,9", "b,,20,1.0,4"]
    assert ledger.named([ProgressRecord("a", 1, 0, 1.0, Role.TRAINER, name="Ana"), ProgressRecord("b", 1, 0, 1.0, Role.TRAINER)])
    assert not ledger.named([ProgressRecord("a", 2, 0, 1.0, Role.TRAINER, name="Ana")])  # no news
    assert [r["name"] for r in ledger.table()] == ["Ana", ""]
    path = str(tmp_path / "ledger.json")
    ledger.save(path)
    assert Ledger.load(path).table() == ledger.table()
    assert Ledger.load(str(tmp_path / "none.json")).table() == []
    (tmp_path / "bad.json").write_text('{"sources": {"x": {"a": [1]}}}')
    with pytest.raises(ValueError, match="malformed ledger"):
        Ledger.load(str(tmp_path / "bad.json"))


def test_the_collaboration_loss_is_the_sample_weighted_mean_per_step():
    import asyncio

    records = {"a": ProgressRecord("a", 5, 0, 10.0, Role.TRAINER, time=time.time(), loss=2.0, loss_step=4,
                                   loss_samples=30).to_wire(),
               "b": ProgressRecord("b", 5, 0, 5.0, Role.TRAINER, time=time.time(), loss=4.0, loss_step=4,
                                   loss_samples=10).to_wire(),
               "c": {"step": "garbage"}}
    # a trainer's ledger is not shown as the collaboration's: only backbones' are
    forged = LedgerRecord("a", ({"peer": "a", "samples": 10 ** 9, "rounds": 1.0, "last_step": 4},), ()).to_wire()

    async def read(names):
        return {"progress": records, "ledger": {"a": forged}}

    c = Collector(read, "r")
    asyncio.run(c.poll())
    assert c.loss_curve() == ([4], [2.5])  # (2*30 + 4*10) / 40
    state = c.state()
    assert state["step"] == 5 and len(state["peers"]) == 2 and c.speed[-1][1] == 15.0
    assert state["ledger"]["peers"] == [] and state["ledger"]["source"].startswith("this monitor")


# ---- real peers: a backbone's dashboard and ledger, metrics, `dedloc monitor`, a browser --------------
def _publish(peer: Peer, step: int, loss: float, samples: int) -> None:
    peer.report(ProgressRecord(peer.peer_id, step, 0, 50.0, Role.TRAINER, time=time.time(), loss=loss,
                               loss_step=step - 1, loss_samples=samples))


NAME = "Rahim's [b]laptop[/b] <i>"
"""Peer 0's display name: markup for rich and for the page, which must show it as it is."""


class Collab:
    """A backbone serving the dashboard, and three peers that ran two rounds and published losses."""

    def __init__(self, tmp_path):
        self.rid, self.ckpt = run_id(), tmp_path / "ckpt"
        self.metrics_port = _free_port_pair()  # and the next one, for the daemon's
        self.bb = Backbone(PeerConfig(run_id=self.rid, host_maddrs=("/ip4/127.0.0.1/tcp/0",), progress_ttl=600),
                           BackboneConfig(checkpoint_dir=str(self.ckpt), dashboard_port=0, resume=False))
        self.peers: list[Peer] = []
        try:
            avg = AveragingConfig(matchmaking_time=3, averaging_timeout=30, probe_interval=0, planner="equal")
            # (their progress records, and the backbone's, published once, live for the module's tests: 10
            # min, not 30 s: on a pytest-xdist worker a test may wait its turn while another runs alone)
            configs = [PeerConfig(run_id=self.rid, initial_peers=tuple(self.bb.maddrs), progress_ttl=600,
                                  metrics_port=self.metrics_port if i == 0 else -1, name=NAME if i == 0 else "")
                       for i in range(3)]
            with cf.ThreadPoolExecutor(3) as pool:
                self.peers = list(pool.map(lambda c: Peer(c, avg), configs))
            weights = [10.0, 20.0, 30.0]
            for step in range(2):
                with cf.ThreadPoolExecutor(3) as pool:
                    stats = list(pool.map(lambda a: a[0].average(torch.ones(1000), step=step, weight=a[1],
                                                                 expected_peers=3), zip(self.peers, weights)))
                assert all(s.group_size == 3 for s in stats)
                for p, loss, n in zip(self.peers, (1.0, 2.0, 3.0), (10, 20, 30)):
                    _publish(p, step + 1, loss + step, n)
            self.expected = {p.peer_id: (2 * w, 2.0) for p, w in zip(self.peers, weights)}
            self.url = self.bb.dashboard.url
        except BaseException:
            self.close()
            raise

    def state(self, url: str | None = None) -> dict:
        return json.loads(_get((url or self.url) + "api/state"))

    def close(self) -> None:
        for p in self.peers:
            p.close()
        self.bb.close()


@pytest.fixture(scope="module")
def collab(tmp_path_factory):
    c = Collab(tmp_path_factory.mktemp("monitor"))
    yield c
    c.close()


def test_the_backbone_ledger_counts_what_aggregators_accepted_and_survives_a_restart(collab, capsys):
    """Each peer's samples exactly (weights times rounds), one round per round joined."""
    def counted():
        collab.bb.account()
        return {r["peer"]: (r["samples"], r["rounds"]) for r in collab.bb.ledger.table()}
    _until("the ledger counting both rounds", lambda: counted() == collab.expected)
    assert Ledger.load(str(collab.ckpt / "ledger.json")).table() == collab.bb.ledger.table()
    from dedloc.cli import main

    assert main(["ledger", str(collab.ckpt), "--format", "json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert {r["peer"]: (r["samples"], r["rounds"]) for r in exported} == collab.expected
    # a volunteer finds itself by the name it chose (--name), kept with the ledger across restarts
    assert {r["peer"]: r["name"] for r in exported} == {p.peer_id: p.config.name for p in collab.peers}
    assert main(["ledger", str(collab.ckpt), "--format", "csv"]) == 0
    assert f"{collab.peers[0].peer_id},{NAME},20,2.0," in capsys.readouterr().out
    # a volunteer asks the run for its own row, from its machine (as the dashboard counts it)
    me = collab.peers[0].peer_id
    assert main(["ledger", "--run-id", collab.rid, "--initial-peers", *collab.bb.maddrs, "--peer", me,
                 "--format", "json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["peer"], row["name"], row["samples"], row["rounds"], row["rank"]) == (me, NAME, 20, 2.0, 3)
    assert main(["ledger", "--run-id", collab.rid, "--initial-peers", *collab.bb.maddrs, "--peer", "nobody"]) == 1
    assert "nobody: no contribution counted yet (by backbone" in capsys.readouterr().err


def test_the_dashboard_serves_peers_loss_plan_ledger_and_metrics(collab):
    def complete():
        collab.bb.account()  # (what its run loop does; this test may run on another xdist worker than the ledger's)
        s = collab.state()
        done = len(s["peers"]) == 4 and 1 in s["loss"]["step"] and len(s["ledger"]["peers"]) == 3 \
            and s["ledger"]["source"].startswith("backbone")
        return s if done else None
    s = _until("the dashboard seeing every peer, the loss of step 1 and the backbone's ledger", complete)
    assert sorted(p["role"] for p in s["peers"]) == ["backbone", "trainer", "trainer", "trainer"]
    assert s["step"] == 2 and s["plan"]["strategy"] and len(s["plan"]["peers"]) == 3
    assert s["loss"]["loss"][s["loss"]["step"].index(1)] == pytest.approx((2 * 10 + 3 * 20 + 4 * 30) / 60)
    assert {r["peer"]: r["samples"] for r in s["ledger"]["peers"]} == {p: v[0] for p, v in collab.expected.items()}
    assert _get(collab.url + "api/ledger.csv").decode().splitlines()[0] == "peer,name,samples,rounds,last_step"
    assert s["names"] == {collab.peers[0].peer_id: NAME}
    assert {p["peer"]: p["name"] for p in s["peers"]}[collab.peers[0].peer_id] == NAME
    scraped = _get(collab.url + "metrics").decode()
    assert "dedloc_global_step 2.0" in scraped and 'dedloc_peers{role="trainer"} 3.0' in scraped


def test_a_peer_serves_its_own_metrics_and_its_daemons(collab):
    own = _get(f"http://127.0.0.1:{collab.metrics_port}/metrics").decode()
    assert "dedloc_rounds_total 2.0" in own and "dedloc_step 2.0" in own and "dedloc_loss 2.0" in own
    sent = [float(line.split()[-1]) for line in own.splitlines() if line.startswith("dedloc_sent_bytes_total")]
    assert sent and sent[0] > 0
    assert b"libp2p" in _get(f"http://127.0.0.1:{collab.metrics_port + 1}/metrics")


def test_dedloc_monitor_serves_the_page_and_leaves_nothing_on_ctrl_c(collab, tmp_path):
    err = open(tmp_path / "monitor.err", "w+")
    monitor = spawn_cli("monitor", "--run-id", collab.rid, "--initial-peers", *collab.bb.maddrs, "--port", "0",
                        "--log-level", "INFO", stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = ""
        while "dashboard at" not in line:
            line = monitor.stdout.readline()
            assert line or monitor.poll() is None, "dedloc monitor exited before serving"
        url = line.split("dashboard at ")[1].strip()
        assert url.startswith("http://127.0.0.1:")
        _until("the monitor seeing every peer", lambda: len(collab.state(url)["peers"]) == 4)
        monitor.send_signal(signal.SIGINT)
        try:
            assert monitor.wait(60) == 0
        except subprocess.TimeoutExpired:  # say where it hangs: the CLI dumps every thread's stack on SIGUSR1
            monitor.send_signal(signal.SIGUSR1)
            time.sleep(2)
            err.seek(0)
            pytest.fail("dedloc monitor did not exit within 60 s of Ctrl+C:\n" + err.read()[-6000:])
        assert sessions_alive([monitor.pid]) == [], "dedloc monitor left a process behind"
    finally:
        err.close()
        if monitor.poll() is None:
            os.killpg(monitor.pid, signal.SIGKILL)
            monitor.wait()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (.ci/run installs Debian's)")
def test_the_page_in_a_real_browser(collab):
    _check_in_browser(collab.url, collab.peers)


def _check_in_browser(url: str, peers: list[Peer]) -> None:
    """The page in Debian's chromium: it loads, lists the peers with their roles, shows the plan, and
    its step and loss advance without a reload."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("document.querySelectorAll('#peers tbody tr').length === 4", timeout=30_000)
            roles = sorted(page.locator("#peers tbody tr td:nth-child(2)").all_inner_texts())
            assert roles == ["backbone", "trainer", "trainer", "trainer"]
            shown = set(page.locator("#peers tbody tr td:nth-child(1)").all_inner_texts())
            # as the trainer's table shows them: a chosen name beside the short id, as text (not markup)
            assert {label(p.peer_id, p.config.name) for p in peers} <= shown, shown
            assert page.inner_text("#peer-count") == "4" and page.inner_text("#step") == "2"
            assert "partitioned" in page.inner_text("#plan") or "ring" in page.inner_text("#plan")
            assert page.locator("#loss-chart .main-svg").count() >= 1  # Plotly drew the chart
            for p, loss in zip(peers, (0.5, 0.5, 0.5)):  # step 3 starts; step 2's loss arrives
                _publish(p, 3, loss, 10)
            page.wait_for_function("document.getElementById('step').textContent === '3'", timeout=30_000)
            page.wait_for_function("document.getElementById('loss').textContent === '0.500'", timeout=30_000)
            assert len(page.locator("#ledger tbody tr").all()) == 3
        finally:
            browser.close()


def test_the_curves_go_to_tensorboard_once_each(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dedloc.monitor.sinks import Curves, TensorBoardSink

    curves = Curves([TensorBoardSink(str(tmp_path))])
    state = {"step": 3, "peers": [{}, {}], "loss": {"step": [1, 2, 3], "loss": [4.0, 3.0, 2.5]},
             "history": {"samples_per_second": [[0.0, 100.0]]}}
    curves.update(state)
    curves.update({**state, "step": 4, "loss": {"step": [1, 2, 3, 4], "loss": [4.0, 3.0, 2.0, 1.5]},
                   "history": {"samples_per_second": [[0.0, 100.0], [1.0, 120.0]]}})
    curves.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    # the newest step's loss waits for its last losses; each point is written once
    assert scalars["collaboration/loss"] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert scalars["collaboration/samples_per_second"] == [(3, 100.0), (4, 120.0)]
    assert scalars["collaboration/peers"] == [(3, 2.0), (4, 2.0)]


def test_a_taken_port_is_a_clear_error_not_a_traceback():
    import asyncio

    from dedloc.config import MonitorConfig
    from dedloc.errors import ConfigError
    from dedloc.monitor.peer_metrics import PeerMetrics
    from dedloc.monitor.server import Dashboard

    async def read(names):
        return {}

    async def main():
        first = Dashboard(read, "r", MonitorConfig(port=0))
        await first.start()
        try:
            with pytest.raises(ConfigError, match=f"cannot serve the dashboard on 127.0.0.1:{first.port}"):
                await Dashboard(read, "r", MonitorConfig(port=first.port)).start()
            metrics = PeerMetrics()
            with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{first.port}"):
                metrics.serve("127.0.0.1", first.port)
        finally:
            await first.close()

    asyncio.run(main())



def test_a_monitor_given_no_initial_peers_is_refused_before_it_starts(capsys):
    """`dedloc monitor --run-id R` without --initial-peers watched an empty run and printed "others
    join with --initial-peers " with nothing after it (issue 41): a monitor accepts no connections."""
    from dedloc.cli import main

    assert main(["monitor", "--run-id", "r"]) == 2
    assert "dedloc monitor needs --initial-peers" in capsys.readouterr().err
