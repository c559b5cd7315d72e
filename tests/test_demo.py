"""The main job, `dedloc demo`, end to end on a tiny setting: it trains, and writes its outputs."""

import json
import subprocess

import pytest

from dedloc.testing.procs import cli_command


@pytest.mark.timeout(280)
def test_demo_trains_and_writes_summary_and_plot(tmp_path):
    cmd = cli_command("demo", "--steps", "8", "--target-batch-size", "32", "--micro-batch", "8", "--hidden-size",
                      "32", "--heads", "2", "--layers", "1", "--vocab-size", "400", "--corpus-files", "200",
                      "--slowdown", "0.05", "--lr", "0.01", "--out", str(tmp_path), "--verbose",
                      "--invite-only")  # every peer checks the others' invitations: the whole membership path, training
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "loss_first", "loss_last", "peers", "batch_per_step", "max_param_diff"):
        assert key in summary
    assert summary["steps"] == 8 and summary["peers"] == 4 and summary["invite_only"]
    assert (tmp_path / "run" / "owner.key").stat().st_mode & 0o777 == 0o600
    assert summary["max_param_diff"] == 0.0
    assert summary["loss_last_avg"] < summary["loss_first_avg"]
    # on failure, the peers' events (rounds, misses, resyncs) say which samples went missing
    events = "\n".join(line for line in proc.stderr.splitlines() if " INFO " in line or "WARN" in line)
    batches, shares = summary["batch_per_step"], summary["samples_per_trainer"]
    # every step's batch is exactly the samples its three trainers put in: none lost, none counted twice
    # (a trainer that resynced keeps no record of the step it missed)
    assert all(b == sum(s) for b, s in zip(batches, shares) if None not in s), (batches, shares, events)
    # a trainer computes one more micro-batch (8, 4, 4) once the target shows reached, and one more
    # each time its lead is declined while the others are still computing theirs (rule 14)
    assert all(32 <= b < 32 + 2 * (8 + 4 + 4) for b in batches), (batches, shares, events)
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert list((tmp_path / "checkpoints").glob("state-*.pt")), "the backbone wrote no checkpoint"
