"""Byte-level BPE tokenizer trained on the train split of the corpus.

Pre-tokenisation splits every digit into its own piece before the GPT-2 style byte-level
split, so a number is always one token per digit and the space before it is a token of
its own (``" 4711"`` -> ``" ", "4", "7", "1", "1"``).  Decoding is byte-level, so any text
round-trips exactly.  Special tokens: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

Run ``python -m jaxlongctx.data.tokenizer`` to regenerate ``assets/tokenizer.json`` and
``assets/corpus_manifest.json``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxlongctx.data.corpus import SPLITS, corpus_stats, load_corpus, split_sha1

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
DEFAULT_VOCAB_SIZE = 4096

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"
MANIFEST_PATH = ASSETS_DIR / "corpus_manifest.json"


def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer with digit splitting on ``texts``."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must hold the 256 bytes and 3 specials, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


@functools.cache
def load_default_tokenizer() -> Tokenizer:
    """The committed tokenizer (``jaxlongctx/assets/tokenizer.json``)."""
    if not TOKENIZER_PATH.is_file():
        raise FileNotFoundError(f"{TOKENIZER_PATH} is missing; run python -m {__name__}")
    return Tokenizer.from_file(str(TOKENIZER_PATH))


@functools.cache
def _encode_split(split: str, tokenizer: Tokenizer) -> np.ndarray:
    """Uncached body of :func:`encode_corpus`."""
    docs = load_corpus()[split]
    pieces: list[np.ndarray] = []
    for i, encoding in enumerate(tokenizer.encode_batch(docs, add_special_tokens=False)):
        if i:
            pieces.append(np.array([EOS_ID], dtype=np.int32))
        pieces.append(np.asarray(encoding.ids, dtype=np.int32))
    out = np.concatenate(pieces)
    out.flags.writeable = False
    return out


def encode_corpus(split: str, tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Token ids (int32, read-only, cached) of a split's documents joined by ``<eos>``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return _encode_split(split, load_default_tokenizer() if tokenizer is None else tokenizer)


def _sha1(path: Path) -> str:
    """Hex sha1 of a file's bytes."""
    return hashlib.sha1(path.read_bytes()).hexdigest()


def build_assets() -> dict[str, object]:
    """Retrain the tokenizer and rewrite ``tokenizer.json`` and ``corpus_manifest.json``."""
    tokenizer = train_tokenizer(load_corpus()["train"])
    ASSETS_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(TOKENIZER_PATH), pretty=True)
    load_default_tokenizer.cache_clear()
    stats = corpus_stats()
    for split in SPLITS:
        stats["splits"][split]["sha1"] = split_sha1(split)
        stats["splits"][split]["tokens"] = int(encode_corpus(split).size)
    manifest = {
        "description": "Corpus behind jaxlongctx/assets/tokenizer.json; built by "
        "jaxlongctx.data.tokenizer.build_assets() (see jaxlongctx/data/corpus.py).",
        "sources": [
            "pydoc_data.topics.topics (one document per topic, sorted by key)",
            "docstrings read with ast from the source of the modules listed below",
        ],
        "split_rule": "sha1(identity) % 100: <90 train, <95 validation, else calibration",
        "python_version": stats["python_version"],
        "modules": stats["modules"],
        "skipped_modules": stats["skipped_modules"],
        "splits": stats["splits"],
        "tokenizer": {
            "vocab_size": tokenizer.get_vocab_size(),
            "sha1": _sha1(TOKENIZER_PATH),
            "special_tokens": dict(zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID))),
        },
    }
    MANIFEST_PATH.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


if __name__ == "__main__":
    print(json.dumps(build_assets()["splits"], indent=2))
