"""`dedloc export`: a backbone checkpoint becomes a directory transformers loads as is."""

import dataclasses
import json

import pytest
import torch

from dedloc.cli import main
from dedloc.recipes.mlm import RECIPES
from dedloc.state import snapshot
from dedloc.state.checkpoint import CheckpointStore

SHAPE = ["--hidden-size", "32", "--intermediate-size", "64", "--embedding-size", "16", "--layers", "1",
         "--heads", "2", "--seq-len", "32"]


@pytest.fixture
def tokenizer(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"doc {i} " + " ".join(f"w{(i * 7 + j) % 90}" for j in range(20))}) + "\n")
    assert main(["tokenizer", "--data", str(corpus), "--vocab-size", "150", "--out", str(tmp_path / "tok")]) == 0
    return tmp_path / "tok"


def test_a_checkpoint_exports_as_a_model_transformers_loads_with_the_same_weights(tmp_path, tokenizer, capsys):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from dedloc.data.tokenizer import load_tokenizer

    recipe = dataclasses.replace(RECIPES["tiny-mlm"], hidden_size=32, intermediate_size=64, embedding_size=16,
                                 layers=1, heads=2, seq_len=32)
    model = recipe.build_model(len(load_tokenizer(str(tokenizer))))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # trained: not the recipe's initial weights
    store = CheckpointStore(tmp_path / "ckpt")
    store.write(7, snapshot.encode({"step": 7, "model": model.state_dict()}))

    out = tmp_path / "model"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--tokenizer", str(tokenizer),
                 "--out", str(out), *SHAPE]) == 0, capsys.readouterr()
    assert f"wrote {out}" in capsys.readouterr().out
    loaded = AutoModelForMaskedLM.from_pretrained(out)
    theirs = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(theirs[name], tensor), name
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("doc 3 w1 w2")["input_ids"] == load_tokenizer(str(tokenizer))("doc 3 w1 w2")["input_ids"]

    # another shape: refused by name, nothing written
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--tokenizer", str(tokenizer),
                 "--out", str(tmp_path / "wrong"), *SHAPE[:-2], "--hidden-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "does not fit this recipe's model" in err and "shapes differ" in err, err
    assert not (tmp_path / "wrong").exists()
    assert main(["export", "--checkpoint", str(tmp_path / "none"), "--tokenizer", str(tokenizer)]) == 2
    assert "--checkpoint" in capsys.readouterr().err
