"""`dedloc train` end to end, as volunteers run it: a backbone and two trainer commands on one
corpus (one joins with the organiser's manifest line); both stop at --max-steps with identical
parameters, handing the final state to the backbone; one restarts with the same state directory,
keeps its peer id, resumes the collaboration's state, continues its data where it stopped, and
Ctrl+C leaves no process behind; a volunteer with another recipe is refused before it downloads."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from dedloc.cli import main
from dedloc.testing.procs import children, cli_command, processes, spawn_cli

from conftest import run_id


def corpus(path, n=400):
    words = [f"w{i}" for i in range(120)]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i} " + " ".join(words[(i * 13 + j * 7) % 120] for j in range(30))}) + "\n")


def descendants(pid):
    found, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children(p)]
        found += kids
        frontier = kids
    return found


def alive(pids):
    deadline = time.monotonic() + 10  # a process being reaped by its parent
    while True:
        left = [p for p, *_ in processes() if p in set(pids)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.timeout(280)
def test_a_volunteer_joins_with_the_manifest_line_another_recipe_is_refused_a_restart_resumes_its_state_and_data(tmp_path):
    corpus(tmp_path / "corpus.jsonl")
    assert main(["tokenizer", "--data", str(tmp_path / "corpus.jsonl"), "--vocab-size", "200",
                 "--out", str(tmp_path / "tok")]) == 0
    run = run_id()
    backbone = spawn_cli("backbone", "--run-id", run, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                         "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "2",
                         "--log-level", "WARNING", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = backbone.stdout.readline()
        maddr = re.search(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", line)
        assert maddr, line
        shape = ["--target-batch-size", "24", "--hidden-size", "32", "--intermediate-size", "64",
                 "--embedding-size", "16", "--layers", "1", "--seq-len", "32"]
        common = ["--run-id", run, "--initial-peers", maddr.group(1), "--tokenizer", str(tmp_path / "tok"),
                  "--data", str(tmp_path / "corpus.jsonl"), *shape, "--micro-batch", "4",
                  "--shuffle-buffer", "32", "--log-level", "INFO"]
        # the organiser's manifest: a volunteer joins with the line it prints and its own choices alone
        made = subprocess.run(cli_command("run", "manifest", "--run-id", run, "--recipe", "tiny-mlm", *shape,
                                          "--tokenizer", str(tmp_path / "tok"), "--data", str(tmp_path / "corpus.jsonl"),
                                          "--initial-peers", maddr.group(1)), capture_output=True, text=True, timeout=60)
        join = re.search(r"dedloc train (--join dlj1\.\S+)", made.stdout)
        assert join, made.stdout + made.stderr
        # the volunteer's machine, checked against the run without joining it
        doctor = subprocess.run(cli_command("doctor", *join.group(1).split(), "--state-dir", str(tmp_path / "peer1")),
                                capture_output=True, text=True, timeout=120)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        for says in ("tokenizer: ", "tokens", "data: ", "readable", f"initial peer: {maddr.group(1)}: answers",
                     "reachable: public", "all checks passed"):
            assert says in doctor.stdout, doctor.stdout

        def trainer(i, steps, *argv):
            limit = ["--max-steps", str(steps)] if steps else []
            return spawn_cli("train", *(argv or common), "--state-dir", str(tmp_path / f"peer{i}"), *limit,
                             "--out", str(tmp_path / f"out{i}-{steps}"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def finish(proc):
            try:
                out, _ = proc.communicate(timeout=150)
            except subprocess.TimeoutExpired:  # say where it hangs: the CLI dumps every thread's stack on SIGUSR1
                proc.send_signal(signal.SIGUSR1)
                try:
                    out, _ = proc.communicate(timeout=5)
                except subprocess.TimeoutExpired as e:
                    out = (e.output or b"").decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
                pytest.fail(f"dedloc train did not exit within 150 s:\n{out[-8000:]}")
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            assert proc.returncode == 0, out[-4000:]
            return out

        first = [trainer(0, 4), trainer(1, 4, *join.group(1).split(), "--micro-batch", "4", "--log-level", "INFO")]
        logs = [finish(p) for p in first]
        # off a terminal, progress is one line per global step (a log file stayed empty until exit: issue 41)
        assert re.search(r"global step [1-4]/4: loss \d+\.\d{3}, \d+ samples/s, batch \d+, \d+ peers", logs[0]), logs[0][-3000:]
        assert "no --initial-peers" not in logs[0]
        # one start-up line says who this peer is and how it runs
        assert re.search(r"joined run '\w+' at global step \d+: tiny-mlm on cpu \(fp32\), micro-batch 4, "
                         r"(reachable|not reachable) \(.+\), 1 initial peer\(s\), run-wide settings [0-9a-f]{16} "
                         r"\(checked against the run's\), dedloc \d", logs[0]), logs[0][:3000]
        a, b = (json.loads((tmp_path / f"out{i}-4" / "summary.json").read_text()) for i in range(2))
        assert a["global_step"] == b["global_step"] == 4
        assert a["parameters_sha256"] == b["parameters_sha256"], "the two trainers' parameters differ"
        assert a["peer_id"] != b["peer_id"]
        assert sorted(set(a["steps"]) | set(b["steps"])) == [0, 1, 2, 3]
        assert (tmp_path / "out0-4" / "loss.png").stat().st_size > 1000
        # the last one out handed step 4 to the backbone before leaving
        assert (tmp_path / "ckpt" / "state-00000004.pt").exists(), logs

        # restarted without --max-steps, it trains until Ctrl+C, which leaves nothing behind
        again = trainer(0, 0)
        position = tmp_path / "peer0" / "data-position.json"
        deadline = time.monotonic() + 120
        while json.loads(position.read_text())["samples"] < a["samples"] + 2 * 24:  # two more global steps
            assert again.poll() is None and time.monotonic() < deadline, again.stdout.read()[-4000:]
            time.sleep(0.2)
        # a volunteer whose recipe differs (here its learning rate: the shapes still fit) is refused by
        # name, before it downloads anything
        other = trainer(2, 0, *common, "--lr", "0.5")
        try:
            out, _ = other.communicate(timeout=120)
        finally:
            if other.poll() is None:
                os.killpg(other.pid, signal.SIGKILL)
        assert other.returncode == 2, out[-4000:]
        assert re.search(r"are not the run's \(hash \w+, published by [^)]*" + a["peer_id"][-8:], out), out[-4000:]
        assert "downloading the state" not in out and "downloaded from" not in out, out[-4000:]
        family = descendants(again.pid)
        assert len(family) >= 3, family  # the DataLoader worker, the peer's runtime and its p2p daemon
        again.send_signal(signal.SIGINT)
        log = finish(again)
        c = json.loads((tmp_path / "out0-0" / "summary.json").read_text())
        assert c["peer_id"] == a["peer_id"], "the restarted peer has a new identity"
        assert c["steps"][0] == 4 and len(c["steps"]) >= 2, log  # resumed from the collaboration's step 4
        assert f"resuming the data stream after {a['samples']} samples" in log
        assert c["samples"] >= a["samples"] + 2 * 24
        assert alive(family) == [], "a process outlived Ctrl+C"
    finally:
        backbone.send_signal(signal.SIGTERM)
        try:
            backbone.wait(30)
        finally:
            if backbone.poll() is None:
                os.killpg(backbone.pid, signal.SIGKILL)


@pytest.mark.parametrize("argv, says", [
    (["identity", "--identity-path", "{file}/id.key"], "--identity-path's directory {file}: a file that is not a directory"),
    (["identity", "--identity-path", "{tmp}"], "--identity-path {tmp}: a directory"),
    (["run", "init", "--dir", "{file}/run", "--run-id", "r"], "--dir {file}/run: cannot create"),
    (["backbone", "--run-id", "r", "--checkpoint-dir", "{file}"], "--checkpoint-dir {file}: a file that is not a directory"),
    (["train", "--run-id", "r", "--state-dir", "{file}"], "--state-dir {file}: a file that is not a directory"),
])
def test_a_directory_that_cannot_be_used_is_refused_naming_the_option_not_with_a_traceback(tmp_path, capsys, argv,
                                                                                         says):
    """`dedloc train --state-dir t.txt` raised FileExistsError from deep inside (issue 41); every
    directory a command creates is refused by the option that named it, before any peer starts."""
    (tmp_path / "t.txt").write_text("not a directory")
    paths = {"file": str(tmp_path / "t.txt"), "tmp": str(tmp_path)}
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert says.format(**paths) in err and "Traceback" not in err, err


def test_version_names_dedloc_and_the_versions_peers_must_share(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.startswith("dedloc 0.") and "hivemind 1.1.12" in out and "torch " in out, out


def test_an_owner_key_and_an_invitation_starting_with_a_dash_are_read_as_pasted(tmp_path, capsys):
    """About one owner key in 64 (URL-safe base64) starts with ``-``: `dedloc train --owner -Xy...`,
    pasted as `dedloc run init` prints it, failed with "expected one argument" (issue 41). The values
    reach the peer's configuration: here it goes on to refuse the state directory."""
    (tmp_path / "t.txt").write_text("not a directory")
    assert main(["train", "--run-id", "r", "--owner", "-" + "A" * 42, "--invite", "-" + "B" * 60,
                 "--state-dir", str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err
    assert "expected one argument" not in err and "--state-dir" in err, err


@pytest.mark.parametrize("command", [["tokenizer", "--data", "x.jsonl"], ["train", "--help"], ["finetune", "--help"]])
def test_an_unknown_recipe_is_refused_before_anything_even_help(capsys, command):
    """`dedloc tokenizer --recipe albert-large` trained a 3,000-word vocabulary and `dedloc train
    --recipe albert-large --help` showed the tiny recipe's defaults (issue 41)."""
    assert main([command[0], "--recipe", "albert-large", *command[1:]]) == 2
    assert "unknown recipe 'albert-large' (known: tiny-mlm, albert-mlm)" in capsys.readouterr().err


def test_two_peers_given_one_state_directory_are_refused_instead_of_sharing_an_identity(tmp_path, capsys):
    """Two `dedloc train` on one machine from one directory shared the default state directory, and
    with it one identity: the others saw one peer restarting over and over (issue 41)."""
    from dedloc.files import hold_dir

    state = tmp_path / "state"
    state.mkdir()
    held = hold_dir(state, "--state-dir")  # as a running trainer holds it
    try:
        assert main(["train", "--run-id", "r", "--state-dir", str(state)]) == 2
        assert f"--state-dir {state} is in use by another dedloc process (pid {os.getpid()})" in capsys.readouterr().err
    finally:
        held.close()
    assert main(["train", "--run-id", "r", "--state-dir", str(state)]) == 2  # free again: on to the next check
    assert "no tokenizer" in capsys.readouterr().err


def test_one_token_carries_the_run_and_a_run_wide_value_changed_on_the_command_line_is_refused(tmp_path, capsys):
    """The join line was assembled by hand: a volunteer who forgot `--recipe albert-mlm` downloaded the
    whole state before "the state does not fit this model" (issue 41). `dedloc run manifest` prints one
    token; `dedloc train --join` takes the run from it and refuses a run-wide value changed on its
    command line, by name, before the peer starts; the per-peer ones stay the volunteer's."""
    import base64
    import zlib

    from dedloc.recipes.mlm import RECIPES
    from dedloc.roles.manifest import Manifest

    peer = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWJX6ZnqhDUdWPKNYsNhKGWD8JYFE9hWNoqZFWGRuhp3UH"
    assert main(["run", "manifest", "--run-id", "bn", "--recipe", "albert-mlm", "--lr", "0.001", "--tokenizer",
                 "bn-tok", "--data", "a.jsonl", "b.jsonl", "--initial-peers", peer, "--out",
                 str(tmp_path / "run.json")]) == 0
    token = re.search(r"dedloc train --join (dlj1\.\S+)", capsys.readouterr().out).group(1)
    manifest = Manifest.read(token)
    assert manifest == Manifest.read(str(tmp_path / "run.json"))
    assert (manifest.run_id, manifest.recipe, manifest.overrides) == ("bn", "albert-mlm", {"lr": 0.001})
    assert (manifest.tokenizer, manifest.data, manifest.initial_peers) == ("bn-tok", ("a.jsonl", "b.jsonl"), (peer,))
    assert manifest.build_recipe().hidden_size == RECIPES["albert-mlm"].hidden_size

    state = tmp_path / "in-the-way"
    state.write_text("a file")
    for changed, says in ((["--lr", "0.5"], "--lr 0.5 (the run's: 0.001)"),
                          (["--recipe", "tiny-mlm"], "--recipe tiny-mlm (the run's: albert-mlm)"),
                          (["--run-id", "other"], "--run-id other (the run's: bn)")):
        assert main(["train", "--join", token, *changed, "--state-dir", str(state)]) == 2
        assert says in capsys.readouterr().err
    # a per-peer value is the volunteer's: the manifest passes, and the peer goes on (to its state directory)
    assert main(["train", "--join", token, "--micro-batch", "2", "--state-dir", str(state)]) == 2
    assert "--state-dir" in capsys.readouterr().err

    body = json.loads(manifest.to_json())
    body["overrides"]["lr"] = 0.5  # edited by hand, hash left as it was
    edited = "dlj1." + base64.urlsafe_b64encode(zlib.compress(json.dumps(body).encode())).decode().rstrip("=")
    bomb = "dlj1." + base64.urlsafe_b64encode(zlib.compress(b" " * (8 << 20))).decode().rstrip("=")
    for bad, says in ((token[:60], "not a whole manifest token"), (edited, "recipe hash does not match"),
                      (bomb, "not a whole manifest token"), ("nope.json", "neither a manifest token")):
        assert main(["train", "--join", bad]) == 2
        assert says in capsys.readouterr().err


def test_train_help_is_grouped_by_who_chooses_and_a_value_outside_the_choices_is_refused(capsys):
    """`--help` was one wall of 68 options, valid values in prose (issue 41)."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for heading in ("this peer:", "the recipe: must match the run", "network, identity and membership:",
                    "averaging (network tuning"):
        assert heading in text, heading
    body = text[text.index("\nthis peer:"):]  # (after the usage line, which names every option)
    assert body.index("  --micro-batch") > body.index("the recipe: must match the run") > body.index("  --max-steps")
    with pytest.raises(SystemExit) as exited:
        main(["train", "--precision", "fp8"])
    assert exited.value.code == 2
    assert "argument --precision: invalid choice: 'fp8' (choose from" in capsys.readouterr().err
