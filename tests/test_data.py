"""Training data: local sources of every kind, interleaved; a per-peer shuffled order; a restart
that continues the stream without replaying it; the tokenizer command; the recipes."""

import json

import pytest
import torch

from dedloc.cli import main
from dedloc.data.mlm import BatchSpec, DataConfig, loader
from dedloc.data.position import DataPosition
from dedloc.data.sources import first_text, open_sources, parse_source
from dedloc.data.stream import PeerStream, peer_seed
from dedloc.data.tokenizer import load_tokenizer
from dedloc.errors import DataError


def texts(prefix: str, n: int) -> list[str]:
    return [f"{prefix} sample {i} " + " ".join(f"w{(i * 7 + j) % 31}" for j in range(12)) for i in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """Four sources, one of each kind, every text unique: {kind: (path, texts)}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts("jsonl", 60))))
    out["jsonl"] = (str(jsonl), texts("jsonl", 60))
    txt = tmp_path / "b.txt"
    txt.write_text("\n".join(texts("txt", 40)) + "\n")
    out["txt"] = (str(txt), texts("txt", 40))
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": texts("parquet", 30)}), parquet)
    out["parquet"] = (str(parquet), texts("parquet", 30))
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(3):  # a source of several files: its shard order is shuffled per peer
        (shards / f"part-{k}.jsonl").write_text("".join(json.dumps({"body": t}) + "\n"
                                                        for t in texts(f"shard{k}", 50)))
    out["shards"] = (str(shards / "part-*.jsonl"), [t for k in range(3) for t in texts(f"shard{k}", 50)])
    return out


def test_sources_of_every_kind_are_interleaved(corpus, tmp_path):
    specs = [corpus["jsonl"][0], corpus["parquet"][0], corpus["shards"][0]]
    got = [e["text"] for e in open_sources(specs, text_column="body")]
    # all_exhausted: each source in turn, the smaller ones repeated until the largest (150) ends
    assert set(got) == set(corpus["jsonl"][1]) | set(corpus["parquet"][1]) | set(corpus["shards"][1])
    assert got[:3] == [corpus["jsonl"][1][0], corpus["parquet"][1][0], corpus["shards"][1][0]]
    # plain text files have their own column; weights pick sources by probability
    weighted = [e["text"] for _, e in zip(range(200), open_sources([corpus["txt"][0], corpus["jsonl"][0]],
                                                                   text_column="body", weights=[1, 0]))]
    assert weighted[:40] == corpus["txt"][1]


def test_a_dataset_directory_goes_through_the_hub_call(tmp_path):
    # `--data NAME[:CONFIG]` is load_dataset(NAME, CONFIG, streaming=True): a local dataset directory
    # takes the same call as a hub name (nothing downloads here)
    ds_dir = tmp_path / "mydataset"
    ds_dir.mkdir()
    (ds_dir / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts("dir", 10)))
    source = parse_source(str(ds_dir))
    assert source.builder == str(ds_dir) and not source.files
    assert [e["text"] for e in open_sources([str(ds_dir)])] == texts("dir", 10)
    hub = parse_source("wikimedia/wikipedia:20231101.bn")
    assert (hub.builder, hub.config, hub.files) == ("wikimedia/wikipedia", "20231101.bn", ())


def test_bad_sources_fail_at_start_naming_the_source(corpus, tmp_path):
    with pytest.raises(DataError, match="'missing/\\*.jsonl': no such file"):
        parse_source("missing/*.jsonl")
    (tmp_path / "notes.docx").write_text("x")
    with pytest.raises(DataError, match="notes.docx"):
        parse_source(str(tmp_path / "notes.docx"))
    with pytest.raises(DataError, match="no column 'text'.*--text-column"):
        first_text(corpus["jsonl"][0], "text")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        first_text(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match="no training data"):
        open_sources([])
    # weights that do not fit the sources: refused by the config, before the peer joins (issue 41: first
    # inside a DataLoader worker, after joining)
    with pytest.raises(DataError, match="--data-weights: 2 weights for 1 sources"):
        DataConfig(data=(corpus["jsonl"][0],), data_weights=(1.0, 2.0)).validate()
    with pytest.raises(DataError, match="--data-weights: weights must be >= 0 and not all 0"):
        DataConfig(data=(corpus["jsonl"][0],), data_weights=(0.0,)).validate()


def take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_each_peer_walks_its_own_order_and_a_restart_continues_it(corpus):
    spec, all_texts = corpus["shards"]
    a, b = peer_seed("12D3KooWpeerA"), peer_seed("12D3KooWpeerB")
    assert a != b and a == peer_seed("12D3KooWpeerA")
    order_a = take(PeerStream([spec], a, text_column="body", shuffle_buffer=16), 150)
    order_b = take(PeerStream([spec], b, text_column="body", shuffle_buffer=16), 150)
    assert sorted(order_a) == sorted(order_b) == sorted(all_texts)  # one epoch: every text once
    assert order_a != order_b
    assert order_a == take(PeerStream([spec], a, text_column="body", shuffle_buffer=16), 150)

    # a restart at a saved position continues the walk: nothing taken before comes again this epoch
    first = PeerStream([spec], a, text_column="body", shuffle_buffer=16)
    it = iter(first)
    before = [next(it) for _ in range(40)]
    position = json.loads(json.dumps(first.position()))
    after = take(PeerStream([spec], a, text_column="body", shuffle_buffer=16, position=position), 80)
    assert not set(before) & set(after)
    assert set(after) <= set(all_texts) and len(set(after)) == 80
    # the next epoch reshuffles and brings every text again
    rest = take(PeerStream([spec], a, text_column="body", shuffle_buffer=16), 300)
    assert sorted(rest[150:]) == sorted(all_texts) and rest[150:] != rest[:150]


def blocks_of(batch):
    """The unmasked token blocks of an MLM micro-batch."""
    original = torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])
    return [tuple(row.tolist()) for row in original]


def test_mlm_micro_batches_come_from_a_worker_and_resume_without_replay(corpus, tmp_path):
    tok_dir = tmp_path / "tok"
    assert main(["tokenizer", "--data", corpus["shards"][0], "--text-column", "title",
                 "--vocab-size", "200", "--out", str(tok_dir)]) == 2  # no such column: an error, not a traceback
    assert main(["tokenizer", "--data", corpus["shards"][0], "--text-column", "body", "--vocab-size", "200",
                 "--out", str(tok_dir)]) == 0
    tokenizer = load_tokenizer(str(tok_dir))
    assert len(tokenizer) <= 200 and tokenizer.mask_token_id is not None
    enc = tokenizer("ﬁne  Sample")["input_ids"]  # NFKC folds the ligature; [CLS] ... [SEP] around it
    assert enc == tokenizer("fine Sample")["input_ids"]
    assert enc[0] == tokenizer.cls_token_id and enc[-1] == tokenizer.sep_token_id

    data = DataConfig(data=(corpus["shards"][0],), text_column="body", shuffle_buffer=8, data_workers=1)
    key = {"data": list(data.data)}
    position = DataPosition(str(tmp_path / "pos.json"), key)
    spec = BatchSpec(str(tok_dir), seq_len=24, micro_batch=4, seed=peer_seed("p"))
    batches = iter(loader(data, spec))
    seen = []
    for _ in range(5):
        batch = next(batches)
        assert batch["input_ids"].shape == batch["labels"].shape == (4, 24)
        assert (batch["input_ids"][:, 0] == tokenizer.cls_token_id).all()
        assert (batch["labels"] != -100).any()
        position.took(batch, 4)
        seen += blocks_of(batch)
    position.save()
    del batches

    again = DataPosition(str(tmp_path / "pos.json"), key)
    resumed = BatchSpec(str(tok_dir), seq_len=24, micro_batch=4, seed=peer_seed("p"), positions=again.load())
    assert again.samples == 20 and resumed.positions
    later = [b for _, batch in zip(range(5), loader(data, resumed)) for b in blocks_of(batch)]
    assert not set(seen) & set(later)
    fresh = [b for _, batch in zip(range(5), loader(data, spec)) for b in blocks_of(batch)]
    assert fresh == seen  # without the position, the same peer would replay its samples
    # another peer's key (other data) starts over, and says so
    assert DataPosition(str(tmp_path / "pos.json"), {"data": ["other"]}).load() == {}
    (tmp_path / "pos.json").write_text("{not json")
    with pytest.raises(DataError, match="pos.json"):
        DataPosition(str(tmp_path / "pos.json"), key).load()


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_albert_recipe_is_sahajberts_with_lamb():
    from pytorch_optimizer import Lamb

    from dedloc.recipes import get_recipe

    recipe = get_recipe("albert-mlm")
    model = recipe.build_model(32000)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.embedding_size) == (1024, 24, 16, 128)
    assert (recipe.seq_len, recipe.target_batch_size, recipe.wire) == (512, 4096, "float16")
    opt = recipe.build_optimizer(model)
    assert isinstance(opt, Lamb)
    sched = recipe.build_scheduler(opt)
    assert sched.get_last_lr()[0] == 0.0
    for _ in range(2500):
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.00176 / 2)
    assert torch.equal(next(iter(get_recipe("albert-mlm").build_model(32000).parameters())),
                       next(iter(model.parameters())))  # every peer starts from the same model
    with pytest.raises(Exception, match="unknown recipe 'bert'"):
        get_recipe("bert")
