"""bench/simulate.py's short variant: a collaboration of 10 and 100 simulated peers on the real rules
(docs/scaling.md has the hour-long runs at 10 to 1,000)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"peers", "sim_hours", "steps_per_hour", "lost_steps", "skipped_steps", "matchmaking_p50_s",
        "matchmaking_p95_s", "group_sizes", "dht_requests_per_peer_step", "dht_bytes_per_peer_step",
        "records_alive", "planner_solve_s", "wall_s"}


def test_a_simulated_collaboration_of_100_takes_steps_in_groups_and_never_one_step_twice():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "simulate.py"), "--peers", "10", "100",
                          "--hours", "0.1"], capture_output=True, text=True, timeout=300, check=True).stdout
    runs = [json.loads(line) for line in out.splitlines()]
    assert [r["peers"] for r in runs] == [10, 100]
    for r in runs:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["lost_steps"] == 0, r
        assert r["steps_per_hour"] > 0 and r["group_sizes"]["max"] >= 2, r
    assert runs[1]["group_sizes"]["max"] > runs[0]["group_sizes"]["max"], runs
