"""Hugging Face Trainer integration: two peers run an ordinary Trainer script with CollaborativeTrainer;
global step, schedule, logging and save_steps follow the collaboration, parameters end identical."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dedloc.cli import main

from conftest import run_id

PEER = str(Path(__file__).with_name("hf_trainer_peer.py"))


def expected_lr(step: int, peak: float = 1e-2, warmup: int = 2, total: int = 4) -> float:
    return peak * step / warmup if step < warmup else peak * max(0.0, (total - step) / (total - warmup))


@pytest.mark.timeout(240)
@pytest.mark.alone  # two Trainer scripts and their runtimes: under a second test's load it ran past its rounds
def test_two_trainer_scripts_train_one_model(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " + " ".join(f"w{(i * 13 + j * 7) % 120}"
                                                                         for j in range(30))}) + "\n"
                              for i in range(400)))
    assert main(["tokenizer", "--data", str(corpus), "--vocab-size", "200", "--out", str(tmp_path / "tok")]) == 0
    run = run_id()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                                     os.environ.get("PYTHONPATH")])))
    procs = []

    def start(index, initial):
        with open(tmp_path / f"peer{index}.log", "w") as log:  # the peer's log lines (INFO)
            p = subprocess.Popen([sys.executable, PEER, run, str(tmp_path / "tok"), str(tmp_path / f"out{index}"),
                                  str(index), *initial], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                 text=True, env=env, start_new_session=True)
        procs.append(p)
        return p

    def logs():
        return "\n".join((tmp_path / f"peer{i}.log").read_text()[-3000:] for i in range(len(procs)))

    def line(p):
        while True:  # the Trainer prints its logs on stdout too, as Python dicts
            text = p.stdout.readline()  # the peer exits (closing it) on any error
            assert text, logs()
            if text.startswith('{"'):
                return json.loads(text)

    try:
        first = start(0, [])
        maddrs = line(first)["maddrs"]
        second = start(1, maddrs)
        line(second)
        results = [line(first), line(second)]
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            p.wait(60)
            assert p.returncode == 0, logs()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    a, b = results
    assert a["global_step"] == b["global_step"] == 4
    assert a["sha"] == b["sha"], "the two peers' parameters differ"
    for result in results:
        logged = [e for e in result["log"] if "loss" in e]
        steps = [e["step"] for e in logged]
        assert steps == sorted(set(steps)) and set(steps) <= {1, 2, 3, 4}, steps  # once per global step
        assert len(steps) >= 3, steps  # both peers took part (a joiner may miss the first step)
        for e in logged:
            assert e["learning_rate"] == pytest.approx(expected_lr(e["step"]), abs=1e-9), e
    # save_steps=2 counts global steps: checkpoints 2 and 4 (the first peer took part in every step)
    assert sorted(p.name for p in (tmp_path / "out0").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
