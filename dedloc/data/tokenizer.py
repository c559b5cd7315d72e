"""Training, saving and loading a recipe's tokenizer (``dedloc tokenizer``), with ``tokenizers``.

The tokenizer is a SentencePiece-style Unigram model, as sahajBERT's: text is normalised with
NMT clean-up, NFKC and collapsed whitespace (optionally lowercased), split on whitespace into
``▁``-prefixed pieces, and encoded as ``[CLS] text [SEP]`` with the special tokens below. It is
saved as a ``transformers`` tokenizer directory, loaded by path on every peer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Iterator

from dedloc.errors import ConfigError, DataError
from dedloc.files import make_dir

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL = [PAD, UNK, CLS, SEP, MASK]


def train_tokenizer(texts: Iterable[str], vocab_size: int, lowercase: bool = False):
    """A Unigram tokenizer trained on ``texts``, wrapped as a ``transformers`` fast tokenizer.

    The vocabulary may come out smaller than ``vocab_size`` on a small corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if vocab_size < len(SPECIAL) + 10:
        raise DataError(f"vocab_size must be >= {len(SPECIAL) + 10}, got {vocab_size}")
    steps = [normalizers.Nmt(), normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(steps + ([normalizers.Lowercase()] if lowercase else []))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    count = 0

    def counted() -> Iterator[str]:
        nonlocal count
        for text in texts:
            if text:
                count += 1
                yield text

    tok.train_from_iterator(counted(), trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                               unk_token=UNK, shrinking_factor=0.75))
    if count == 0:
        raise DataError("the tokenizer's training data holds no text")
    cls, sep = tok.token_to_id(CLS), tok.token_to_id(SEP)
    tok.post_processor = processors.TemplateProcessing(single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
                                                       special_tokens=[(CLS, cls), (SEP, sep)])
    return wrap(tok)


def wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, pad_token=PAD, cls_token=CLS,
                                   sep_token=SEP, mask_token=MASK)


def save_tokenizer(tokenizer, path: str) -> None:
    """Write ``tokenizer`` as a ``transformers`` tokenizer directory at ``path``."""
    make_dir(path, "the tokenizer's directory")
    tokenizer.save_pretrained(path)


def load_tokenizer(path: str | None):
    """The tokenizer saved at ``path`` (a directory from ``dedloc tokenizer``, or a ``tokenizer.json``).

    DataError, naming the path, if it is missing or not a tokenizer; or if it lacks a special token
    masked-language modelling needs."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if not path:
        raise DataError("no tokenizer: pass --tokenizer DIR (make one with `dedloc tokenizer --data ... --out DIR`)")
    try:
        if os.path.isdir(path):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        elif os.path.isfile(path):
            tokenizer = wrap(Tokenizer.from_file(path))
        else:
            raise DataError(f"--tokenizer {path!r}: no such file or directory")
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"--tokenizer {path!r}: not a tokenizer: {type(e).__name__}: {e}") from None
    missing = [name for name in ("pad_token", "mask_token", "cls_token", "sep_token")
               if getattr(tokenizer, name) is None or tokenizer.convert_tokens_to_ids(getattr(tokenizer, name)) is None]
    if missing:
        raise DataError(f"--tokenizer {path!r}: it has no {', '.join(missing)}")
    return tokenizer


@dataclasses.dataclass
class TokenizerConfig:
    """``dedloc tokenizer``: train the run's tokenizer from its data sources."""

    out: str = "tokenizer"
    """Directory to write the tokenizer to (load it with --tokenizer DIR)."""
    data: tuple[str, ...] = ()
    """Text sources, as for `dedloc train --data`."""
    text_column: str = "text"
    """The column holding the text, in json/csv/parquet and hub sources."""
    vocab_size: int = 32000
    """Vocabulary size (the recipe's, by default)."""
    max_texts: int = 1_000_000
    """Read at most this many texts (the sources interleaved, in order)."""
    lowercase: bool = False
    """Lowercase the text before tokenizing."""

    def validate(self) -> "TokenizerConfig":
        if not self.data:
            raise ConfigError("invalid config: no data: name at least one source with --data")
        if self.max_texts < 1:
            raise ConfigError("invalid config: max_texts must be >= 1")
        return self


def build(config: TokenizerConfig):
    """Train and save the tokenizer ``config`` describes; returns it."""
    from itertools import islice

    from dedloc.data.sources import open_sources

    config.validate()
    texts = (e["text"] for e in islice(open_sources(config.data, config.text_column), config.max_texts))
    tokenizer = train_tokenizer(texts, config.vocab_size, config.lowercase)
    save_tokenizer(tokenizer, config.out)
    return tokenizer
