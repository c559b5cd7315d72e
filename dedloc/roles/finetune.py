"""``dedloc finetune``: evaluate a pretrained checkpoint downstream, as the sahajBERT paper did.

- ``--task ner``: token classification (WikiANN-style: ``tokens`` and ``ner_tags``, tags as names
  or as indices into ``--labels``), scored with seqeval's entity-level F1;
- ``--task classification``: sequence classification (NCC-style: ``text`` and ``label``, a name or
  an index), scored by accuracy.

The checkpoint is a backbone's (``state-*.pt``, or its directory for the newest); its MLM
encoder (``albert.*``) initialises the task model, whose head starts fresh. Training and
evaluation run with ``transformers.Trainer`` on one machine. Data come from the same sources as
``dedloc train`` (local files by extension, or ``NAME[:CONFIG]``), not streamed: fine-tuning sets
are small. Errors (a missing checkpoint, a column or label that does not fit) name the input.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from dedloc.errors import ConfigError, DataError
from dedloc.extras import require
from dedloc.files import make_dir
from dedloc.recipes.mlm import MLMRecipe
from dedloc.state.checkpoint import model_weights

TASKS = ("ner", "classification")
WIKIANN_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")


@dataclass
class FinetuneConfig:
    """A downstream fine-tuning run on one machine."""

    task: str = field(default="ner", metadata={"choices": TASKS})
    """'ner' (token classification, seqeval F1) or 'classification' (sequence classification, accuracy)."""
    checkpoint: str = ""
    """A backbone checkpoint (state-*.pt) or a checkpoint directory (its newest)."""
    recipe: str = "tiny-mlm"
    """The recipe the checkpoint was pretrained with (its model shape)."""
    tokenizer: str = ""
    """The run's tokenizer directory."""
    train: str = ""
    """Training split: a file (.jsonl, .json, .csv, .parquet) or NAME[:CONFIG] (its 'train' split)."""
    validation: str = ""
    """Evaluation split, as --train (for NAME[:CONFIG]: its 'validation' split)."""
    labels: tuple[str, ...] = ()
    """Label names, in index order (empty: WikiANN's for integer NER tags, else the sorted names found)."""
    epochs: float = 3.0
    """Passes over the training split."""
    lr: float = 5e-5
    """Peak learning rate (AdamW, linear decay)."""
    batch_size: int = 16
    """Examples per step."""
    max_length: int = 128
    """Tokens per example (longer ones are truncated)."""
    seed: int = 0
    """Seed of the task head and the data order."""
    out: str = "finetune-out"
    """Where metrics.json and the fine-tuned model (save_pretrained, with the tokenizer) go."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu' or 'cuda' (as dedloc train's)."""

    def validate(self) -> "FinetuneConfig":
        if self.task not in TASKS:
            raise ConfigError(f"invalid config: task must be one of {TASKS}")
        for name in ("checkpoint", "tokenizer", "train", "validation"):
            if not getattr(self, name):
                raise ConfigError(f"invalid config: --{name} is required")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"invalid config: device must be auto, cpu or cuda (got {self.device!r})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("invalid config: device 'cuda', but CUDA is not available here")
        if self.epochs <= 0 or self.lr <= 0 or self.batch_size < 1 or self.max_length < 8:
            raise ConfigError("invalid config: epochs and lr must be > 0, batch_size >= 1, max_length >= 8")
        return self


def _split(spec: str, split: str) -> Any:
    from dedloc.data.sources import load, parse_source

    return load(parse_source(spec), split, streaming=False, option=f"--{split}")


def _label_names(config: FinetuneConfig, train: Any, column: str) -> list[str]:
    values = train[column]
    flat = [v for row in values for v in row] if config.task == "ner" else list(values)
    if config.labels:
        return list(config.labels)
    if all(isinstance(v, int) for v in flat):
        if config.task == "ner":
            return list(WIKIANN_LABELS)
        return [str(i) for i in range(max(flat) + 1)]
    return sorted({str(v) for v in flat})


def _index(value: Any, names: list[str], where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value < len(names):
            return value
    elif str(value) in names:
        return names.index(str(value))
    raise DataError(f"{where}: label {value!r} is not one of {names} (name them with --labels)")


def finetune(config: FinetuneConfig, recipe: MLMRecipe) -> dict[str, float]:
    """Fine-tune and evaluate; returns the validation metrics (also written to ``out/metrics.json``)."""
    transformers = require("transformers")
    require("accelerate")
    from dedloc.data.tokenizer import load_tokenizer

    config.validate()
    if config.task == "ner":
        require("seqeval.metrics")  # scored after the last epoch: missing, it failed only then
    tokenizer = load_tokenizer(config.tokenizer)
    encoder = model_weights(config.checkpoint)
    train, valid = _split(config.train, "train"), _split(config.validation, "validation")
    ner = config.task == "ner"
    need = ("tokens", "ner_tags") if ner else ("text", "label")
    for spec, ds in ((config.train, train), (config.validation, valid)):
        missing = [c for c in need if c not in ds.column_names]
        if missing:
            raise DataError(f"{spec!r}: no column {missing[0]!r} (columns: {ds.column_names}); "
                            f"--task {config.task} needs {list(need)}")
    names = _label_names(config, train, need[1])

    def encode_ner(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=config.max_length)
        labels = []
        for i, tags in enumerate(batch["ner_tags"]):
            row, previous = [], None
            for word in enc.word_ids(i):
                row.append(-100 if word is None or word == previous else _index(tags[word], names, config.train))
                previous = word
            labels.append(row)
        enc["labels"] = labels
        return enc

    def encode_text(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(batch["text"], truncation=True, max_length=config.max_length)
        enc["labels"] = [_index(v, names, config.train) for v in batch["label"]]
        return enc

    encode = encode_ner if ner else encode_text
    train = train.map(encode, batched=True, remove_columns=train.column_names)
    valid = valid.map(encode, batched=True, remove_columns=valid.column_names)
    model_config = recipe.model_config(len(tokenizer))
    model_config.num_labels = len(names)
    model_config.id2label = dict(enumerate(names))
    model_config.label2id = {n: i for i, n in enumerate(names)}
    torch.manual_seed(config.seed)
    cls = transformers.AlbertForTokenClassification if ner else transformers.AlbertForSequenceClassification
    model = cls(model_config)
    loaded = {k: v for k, v in encoder.items() if k.startswith("albert.") and k in model.state_dict()}
    if not loaded:
        raise DataError(f"--checkpoint {config.checkpoint!r}: no ALBERT encoder weights for recipe {config.recipe!r}")
    try:
        missing, _ = model.load_state_dict(loaded, strict=False)
    except RuntimeError as e:
        raise DataError(f"--checkpoint {config.checkpoint!r} does not fit recipe {config.recipe!r} "
                        f"(another model shape?): {str(e)[:300]}") from None
    if any(k.startswith("albert.") and "pooler" not in k for k in missing):
        raise DataError(f"--checkpoint {config.checkpoint!r}: encoder weights missing for recipe "
                        f"{config.recipe!r}: {[k for k in missing if k.startswith('albert.')][:3]}")

    def metrics(pred: Any) -> dict[str, float]:
        logits, gold = pred.predictions, pred.label_ids
        guess = logits.argmax(-1)
        if not ner:
            return {"accuracy": float((guess == gold).mean())}
        seqeval = require("seqeval.metrics")
        y_true = [[names[g] for g in row if g != -100] for row in gold]
        y_pred = [[names[p] for p, g in zip(prow, grow) if g != -100] for prow, grow in zip(guess, gold)]
        return {"f1": float(seqeval.f1_score(y_true, y_pred)), "precision": float(seqeval.precision_score(y_true, y_pred)),
                "recall": float(seqeval.recall_score(y_true, y_pred))}

    collator = (transformers.DataCollatorForTokenClassification(tokenizer) if ner
                else transformers.DataCollatorWithPadding(tokenizer))
    args = transformers.TrainingArguments(
        output_dir=config.out, num_train_epochs=config.epochs, learning_rate=config.lr,
        per_device_train_batch_size=config.batch_size, per_device_eval_batch_size=config.batch_size,
        eval_strategy="no", save_strategy="no", report_to=[], seed=config.seed, disable_tqdm=True,
        logging_strategy="steps", logging_steps=0.1, use_cpu=config.device == "cpu" or not torch.cuda.is_available())
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, eval_dataset=valid,
                                   data_collator=collator, compute_metrics=metrics,
                                   callbacks=[_progress_lines(transformers)])
    trainer.remove_callback(transformers.PrinterCallback)  # (its dicts on stdout: ours are lines on stderr)
    trainer.train()
    result = {k.removeprefix("eval_"): float(v) for k, v in trainer.evaluate().items()}
    result.update(task=config.task, train_examples=len(train), validation_examples=len(valid),
                  encoder_tensors_loaded=len(loaded))
    make_dir(config.out, "--out")
    trainer.save_model(config.out)  # a model directory: from_pretrained(out) with the task head
    tokenizer.save_pretrained(config.out)
    with open(os.path.join(config.out, "metrics.json"), "w") as f:
        json.dump({"metrics": result, "config": dataclasses.asdict(config), "labels": names}, f, indent=2)
    return result


def _progress_lines(transformers: Any) -> Any:
    """One line on stderr per tenth of the training (``logging_steps=0.1``): step/total, epoch and the
    training loss since the last line (a fine-tuning run was silent until its metrics)."""
    import sys

    class Lines(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"finetune: step {state.global_step}/{state.max_steps}, epoch {state.epoch or 0:.2f}, "
                      f"loss {logs['loss']:.4f}", file=sys.stderr, flush=True)

    return Lines()
