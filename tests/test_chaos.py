"""The chaos soak's 2-minute variant (bench/chaos.py): sustained churn, a backbone kill, and the checks."""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench", "chaos.py")


@pytest.mark.timeout(400)
def test_two_minutes_of_churn_lose_no_step(tmp_path):
    out = subprocess.run([sys.executable, BENCH, "--minutes", "2", "--seed", "3", "--fault-every", "12",
                          "--backbone-every", "50", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    where = f"(logs in {tmp_path}): {r}"
    assert sum(r["failures_injected"].values()) >= 6 and r["failures_injected"].get("backbone_kill9", 0) >= 1, where
    assert r["steps"] >= 20, where
    # what holds today: nobody raises, every step is replayable, the peers end identical, nothing is
    # left behind, no stall reaches a minute. Not yet: zero lost steps (a transient split of a step
    # into two groups, healed by the lineage check, still counts) and an exact replay (parts of one
    # round may average different contributor sets): both are reported in the JSON (issue 15)
    assert r["crashes"] == [], where
    assert r["replay_gap_at"] is None and r["replay_steps"] == r["steps"], where
    assert r["final_step_agrees"], where
    assert r["orphans"] == {"processes": [], "sockets": []}, where
    assert r["longest_stall_s"] < 60, where
