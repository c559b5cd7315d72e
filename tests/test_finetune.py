"""`dedloc finetune`: a pretrained checkpoint's encoder fine-tuned on tiny NER and classification sets
the test writes, scored with seqeval F1 and accuracy; inputs that do not fit fail by name."""

import json
import random
import re

import pytest

from dedloc.cli import main
from dedloc.recipes import get_recipe
from dedloc.state import snapshot
from dedloc.state.checkpoint import CheckpointStore

PER, ORG, LOC = ["alice", "bob", "carol", "dave"], ["acme", "globex", "initech"], ["paris", "dhaka", "lima"]
OTHER = ["the", "went", "to", "with", "from", "saw", "and", "a"]
SHAPE = ["--hidden-size", "32", "--intermediate-size", "64", "--embedding-size", "16", "--layers", "1",
         "--heads", "2", "--seq-len", "32"]


def ner_rows(n, rng):
    rows = []
    for _ in range(n):
        tokens, tags = [], []
        for _ in range(rng.randint(4, 9)):
            kind = rng.choice(["O", "O", "PER", "ORG", "LOC"])
            word = rng.choice({"O": OTHER, "PER": PER, "ORG": ORG, "LOC": LOC}[kind])
            tokens.append(word)
            tags.append("O" if kind == "O" else f"B-{kind}")
        rows.append({"tokens": tokens, "ner_tags": tags})
    return rows


def text_rows(n, rng):
    topics = {"sports": ["goal", "match", "team", "cricket", "score"], "politics": ["vote", "party", "minister",
                                                                                   "election", "law"]}
    rows = []
    for _ in range(n):
        label = rng.choice(sorted(topics))
        words = [rng.choice(topics[label]) for _ in range(3)] + [rng.choice(OTHER) for _ in range(4)]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def setup(tmp_path):
    rng = random.Random(0)
    files = {"ner_train": write(tmp_path / "ner_train.jsonl", ner_rows(240, rng)),
             "ner_valid": write(tmp_path / "ner_valid.jsonl", ner_rows(60, rng)),
             "cls_train": write(tmp_path / "cls_train.jsonl", text_rows(240, rng)),
             "cls_valid": write(tmp_path / "cls_valid.jsonl", text_rows(60, rng))}
    # the tokenizer's corpus is varied enough for whole-word pieces (on a few dozen distinct words,
    # a Unigram model keeps mostly single characters); the task sets' words are in it too
    from dedloc.demo.corpus import write_corpus

    write_corpus(tmp_path / "docs.jsonl", max_files=150)
    corpus = write(tmp_path / "corpus.jsonl", [{"text": " ".join(r["tokens"])} for r in ner_rows(300, rng)]
                   + [{"text": r["text"]} for r in text_rows(300, rng)])
    assert main(["tokenizer", "--data", corpus, str(tmp_path / "docs.jsonl"), "--vocab-size", "800",
                 "--out", str(tmp_path / "tok")]) == 0
    from dedloc.data.tokenizer import load_tokenizer

    model = get_recipe("tiny-mlm", hidden_size=32, intermediate_size=64, embedding_size=16, layers=1,
                       seq_len=32).build_model(len(load_tokenizer(str(tmp_path / "tok"))))
    CheckpointStore(tmp_path / "ckpt").write(7, snapshot.encode({"step": 7, "model": model.state_dict()}))
    return tmp_path, files


@pytest.mark.timeout(240)
def test_finetune_ner_and_classification_from_a_checkpoint(setup, capsys):
    tmp_path, files = setup
    common = ["--checkpoint", str(tmp_path / "ckpt"), "--tokenizer", str(tmp_path / "tok"), "--epochs", "10",
              "--lr", "5e-3", "--batch-size", "16", *SHAPE]
    assert main(["finetune", "--task", "ner", "--train", files["ner_train"], "--validation", files["ner_valid"],
                 "--out", str(tmp_path / "ner"), *common]) == 0
    ner = json.loads((tmp_path / "ner" / "metrics.json").read_text())
    # it said how far it was, and left a model transformers loads with its head
    said = capsys.readouterr()
    assert re.search(r"finetune: step \d+/\d+, epoch [\d.]+, loss [\d.]+", said.err), said.err[-2000:]
    from transformers import AutoModelForTokenClassification
    assert AutoModelForTokenClassification.from_pretrained(tmp_path / "ner").config.num_labels == 4
    assert ner["metrics"]["encoder_tensors_loaded"] > 10
    assert ner["labels"] == ["B-LOC", "B-ORG", "B-PER", "O"]
    assert ner["metrics"]["f1"] >= 0.8, ner["metrics"]
    assert main(["finetune", "--task", "classification", "--train", files["cls_train"], "--validation",
                 files["cls_valid"], "--out", str(tmp_path / "cls"), *common]) == 0
    cls = json.loads((tmp_path / "cls" / "metrics.json").read_text())
    assert cls["metrics"]["accuracy"] >= 0.9, cls["metrics"]
    printed = [json.loads(line) for line in (said.out + capsys.readouterr().out).splitlines() if line.startswith('{"')]
    assert [p["task"] for p in printed] == ["ner", "classification"]


def test_finetune_inputs_that_do_not_fit_fail_by_name(setup, capsys):
    tmp_path, files = setup
    common = ["--tokenizer", str(tmp_path / "tok"), "--train", files["ner_train"], "--validation",
              files["ner_valid"], "--out", str(tmp_path / "x")]
    assert main(["finetune", "--checkpoint", str(tmp_path / "nope"), *common, *SHAPE]) == 2
    assert "'" + str(tmp_path / "nope") + "': no such file" in capsys.readouterr().err
    # the checkpoint's model is smaller than the recipe's default shape
    assert main(["finetune", "--checkpoint", str(tmp_path / "ckpt"), *common]) == 2
    assert "does not fit recipe 'tiny-mlm'" in capsys.readouterr().err
    assert main(["finetune", "--task", "classification", "--checkpoint", str(tmp_path / "ckpt"), *common, *SHAPE]) == 2
    assert "no column 'text'" in capsys.readouterr().err


def test_named_entity_fine_tuning_without_seqeval_fails_before_training(monkeypatch):
    """seqeval scores NER after the last epoch: missing, it failed only then, after all the training
    (issue 41). It is asked for first."""
    import sys

    from dedloc.errors import DedlocError
    from dedloc.recipes.mlm import MLMRecipe
    from dedloc.roles.finetune import FinetuneConfig, finetune

    monkeypatch.setitem(sys.modules, "seqeval.metrics", None)  # as if not installed
    config = FinetuneConfig(task="ner", checkpoint="nope", tokenizer="nope", train="nope", validation="nope")
    with pytest.raises(DedlocError, match=r"this needs seqeval, which is not installed: pip install 'dedloc\[eval\]'"):
        finetune(config, MLMRecipe())
