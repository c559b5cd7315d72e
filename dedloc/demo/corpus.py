"""The demo's data, built at run time from text already on the machine: the standard library's docstrings.

Nothing is downloaded and no text is stored in the repository. The tokenizer is trained on the
corpus with ``tokenizers``; examples are fixed-length token blocks; each peer streams its own
shard through a shuffle buffer.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def stdlib_docstrings(max_files: int = 1500) -> list[str]:
    """Docstrings (>= 40 characters, whitespace-normalised) of the standard library's modules, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if not {"site-packages", "test", "tests", "idle_test"} & set(f.relative_to(root).parts))
    texts: list[str] = []
    for f in files[:max_files]:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    texts.append(" ".join(doc.split()))
    if not texts:
        raise RuntimeError(f"found no docstrings under {root}; the demo needs Python's standard library sources")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A WordPiece tokenizer trained on ``texts``, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def token_blocks(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """All texts as one token stream cut into ``[CLS] ... [SEP]`` blocks of ``seq_len``: (N, seq_len) int64."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.sep_token_id)
    body = seq_len - 2
    n = len(ids) // body
    blocks = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
    cls = torch.full((n, 1), tokenizer.cls_token_id, dtype=torch.long)
    sep = torch.full((n, 1), tokenizer.sep_token_id, dtype=torch.long)
    return torch.cat([cls, blocks, sep], dim=1)


def shard_stream(blocks: torch.Tensor, shard: int, shards: int, buffer: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless stream of this peer's shard (every ``shards``-th block), shuffled through a buffer."""
    rng = random.Random(seed)
    pool: list[torch.Tensor] = []
    epoch = 0
    while True:
        for i in range(shard, len(blocks), shards):
            pool.append(blocks[i])
            if len(pool) >= buffer:
                yield pool.pop(rng.randrange(len(pool)))
        epoch += 1
        if epoch > 1000 and not pool:
            return
