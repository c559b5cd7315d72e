"""What the dashboard shows, built from the run's DHT records (read-only).

Every ``poll_interval`` the collector reads the progress, capability, round-report and ledger
records (through ``read``: a monitor node's DHT, or a peer's runtime) and keeps a bounded history:
the global step over time, samples/s over time, the collaboration's loss per step (the
sample-weighted mean of the losses trainers published for that step), recent rounds, and a
contribution ledger (monitor/ledger.py). ``state()`` is what ``/api/state`` serves. Malformed
records are skipped (records.py validates them); nothing a peer publishes can make it raise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Awaitable, Callable

from dedloc.monitor.ledger import Ledger
from dedloc.records import (CapabilityRecord, CollaborationView, CreditRecord, LedgerRecord, ProgressRecord, Role,
                            RoundReport)

logger = logging.getLogger(__name__)
Read = Callable[[list[str]], Awaitable[dict[str, dict[str, Any]]]]
"""``read(names)``: the run's records under each name, ``{name: {peer id: raw value}}``."""
NAMES = ["progress", "caps", "rounds", "credits", "ledger"]
MAX_POINTS = 2000
MAX_LOSS_STEPS = 5000
MAX_ROUNDS = 50


class Collector:
    """Polls the run's records and keeps the dashboard's state. ``run()`` polls until cancelled."""

    def __init__(self, read: Read, run_id: str, poll_interval: float = 2.0):
        self.read, self.run_id, self.poll_interval = read, run_id, poll_interval
        self.steps: deque[tuple[float, int]] = deque(maxlen=MAX_POINTS)
        self.speed: deque[tuple[float, float]] = deque(maxlen=MAX_POINTS)
        self.step_times: dict[int, float] = {}
        """When each global step was first seen."""
        self.loss: dict[int, dict[str, tuple[float, int]]] = {}
        """Step -> peer -> (mean loss, samples) as published."""
        self.rounds: dict[str, dict[str, RoundReport]] = {}
        self.ledger = Ledger()
        self.peers: dict[str, dict[str, Any]] = {}
        self.backbone_ledgers: dict[str, LedgerRecord] = {}
        """Ledgers published by peers whose progress record says they are backbones."""
        self.polls = 0
        self.last_poll = 0.0
        self.error = ""

    async def run(self, on_poll: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Poll until cancelled; ``on_poll(state())`` after each successful poll."""
        while True:
            try:
                await self.poll()
                self.error = ""
                if on_poll is not None:
                    on_poll(self.state())
            except Exception as e:  # a DHT hiccup: keep the last state, say so on the page
                self.error = f"{type(e).__name__}: {e}"
                logger.debug(f"monitor poll failed: {e!r}")
            await asyncio.sleep(self.poll_interval)

    async def poll(self, now: float | None = None) -> None:
        raw = await self.read(NAMES)
        now = time.time() if now is None else now
        progress = [r for p, v in raw.get("progress", {}).items() if (r := ProgressRecord.from_wire(p, v)) is not None]
        caps = {p: r for p, v in raw.get("caps", {}).items() if (r := CapabilityRecord.from_wire(p, v)) is not None}
        reports = [r for p, v in raw.get("rounds", {}).items() for r in RoundReport.list_from_wire(p, v)]
        view = CollaborationView.build(progress, now)
        step = view.global_step if progress else -1
        if step >= 0:
            self.steps.append((now, step))
            self.step_times.setdefault(step, now)
            for s in sorted(self.step_times)[:-MAX_POINTS]:
                del self.step_times[s]
        self.speed.append((now, sum(r.samples_per_second for r in progress if r.role.trains)))
        for r in progress:
            if r.loss_samples > 0 and r.loss_step >= 0:
                self.loss.setdefault(r.loss_step, {})[r.peer_id] = (r.loss, r.loss_samples)
        for s in sorted(self.loss)[:-MAX_LOSS_STEPS]:
            del self.loss[s]
        for r in reports:
            self.rounds.setdefault(r.round_id, {})[r.reporter] = r
        for rid in sorted(self.rounds, key=lambda k: max(x.time for x in self.rounds[k].values()))[:-MAX_ROUNDS]:
            del self.rounds[rid]
        self.ledger.observe(r for p, v in raw.get("credits", {}).items()
                            if (r := CreditRecord.from_wire(p, v)) is not None)
        self.ledger.named(progress)
        backbones = {r.peer_id for r in progress if r.role == Role.BACKBONE}
        self.backbone_ledgers = {p: r for p, v in raw.get("ledger", {}).items()
                                 if p in backbones and (r := LedgerRecord.from_wire(p, v)) is not None}
        self.peers = {}
        for r in progress:
            cap = caps.get(r.peer_id)
            self.peers[r.peer_id] = {
                "peer": r.peer_id, "name": r.name, "role": r.role.value, "step": r.step, "samples_per_second": r.samples_per_second,
                "last_seen_s": max(0.0, now - r.time),
                "reachability": _reachability(cap),
                "upload_Bps": cap.upload if cap else 0.0, "download_Bps": cap.download if cap else 0.0}
        self.polls += 1
        self.last_poll = now

    # ---- what is served ------------------------------------------------------------------------
    def loss_curve(self) -> tuple[list[int], list[float]]:
        """(steps, the collaboration's loss): per step, the sample-weighted mean over trainers."""
        steps, values = [], []
        for s in sorted(self.loss):
            total = sum(n for _, n in self.loss[s].values())
            if total:
                steps.append(s)
                values.append(sum(loss * n for loss, n in self.loss[s].values()) / total)
        return steps, values

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds to the next global step, from the mean time of the last (up to) 10 steps."""
        now = time.time() if now is None else now
        seen = sorted(self.step_times.items())[-11:]
        if len(seen) < 2:
            return None
        per_step = (seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0])
        return max(0.0, seen[-1][1] + per_step - now)

    def recent_rounds(self) -> list[dict[str, Any]]:
        out = []
        for rid, reports in self.rounds.items():
            rs = list(reports.values())
            lead = next((r for r in rs if r.predicted_s > 0), rs[0])
            out.append({"round": rid[:12], "step": max(r.step for r in rs), "peers": list(lead.peers),
                        "shares": list(lead.shares), "strategy": lead.strategy,
                        "measured_s": max(r.seconds for r in rs), "predicted_s": lead.predicted_s or None,
                        "matchmaking_s": max(r.matchmaking_s for r in rs),
                        "failovers": max(r.failovers for r in rs), "time": max(r.time for r in rs)})
        return sorted(out, key=lambda r: r["time"], reverse=True)

    def leaderboard(self) -> tuple[str, list[dict[str, Any]]]:
        """(source, rows): a backbone's persistent ledger when one publishes it, else this monitor's
        own (from the credits still in the DHT)."""
        if self.backbone_ledgers:
            peer = min(self.backbone_ledgers)
            return f"backbone {peer}", list(self.backbone_ledgers[peer].rows)
        return "this monitor, from the credits in the DHT", self.ledger.table()

    def checkpoints(self) -> list[dict[str, Any]]:
        out = [{"backbone": peer, "steps": list(record.checkpoints)}
               for peer, record in sorted(self.backbone_ledgers.items())]
        for p in self.peers.values():
            if p["role"] == Role.BACKBONE.value and not any(c["backbone"] == p["peer"] for c in out):
                out.append({"backbone": p["peer"], "steps": [p["step"]]})
        return out

    def state(self) -> dict[str, Any]:
        steps, loss = self.loss_curve()
        source, board = self.leaderboard()
        rounds = self.recent_rounds()
        # display names (PeerConfig.name) of the peers shown: the live ones', and those the ledger remembers
        names = {r["peer"]: r["name"] for r in board if r.get("name")}
        names.update((p["peer"], p["name"]) for p in self.peers.values() if p["name"])
        return {"run_id": self.run_id, "time": self.last_poll, "polls": self.polls, "error": self.error,
                "step": self.steps[-1][1] if self.steps else -1, "eta_s": self.eta_s(),
                "history": {"step": [list(x) for x in self.steps], "samples_per_second": [list(x) for x in self.speed]},
                "loss": {"step": steps, "loss": loss},
                "peers": sorted(self.peers.values(), key=lambda p: (p["role"], p["peer"])),
                "plan": rounds[0] if rounds else None, "rounds": rounds[:20],
                "checkpoints": self.checkpoints(), "ledger": {"source": source, "peers": board},
                "names": names}


def _reachability(cap: CapabilityRecord | None) -> str:
    if cap is None:
        return "unknown"
    if cap.client:
        return "client mode"
    if cap.private:
        return f"behind NAT ({len(cap.direct)} direct)"
    return "public"


__all__ = ["Collector", "NAMES"]
