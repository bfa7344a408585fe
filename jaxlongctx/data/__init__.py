"""Training data: stdlib-docstring corpus, its BPE tokenizer, and the haystack retrieval task."""

from jaxlongctx.data.corpus import SPLITS, corpus_stats, load_corpus
from jaxlongctx.data.haystack import (
    CODE_DIGITS,
    EVAL_SEED_BASE,
    TRAIN_SEED_BASE,
    HaystackSample,
    eval_seed,
    held_out_batch,
    make_batch,
    make_sample,
    train_seed,
)
from jaxlongctx.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    build_assets,
    encode_corpus,
    load_default_tokenizer,
    train_tokenizer,
)

__all__ = [
    "BOS_ID",
    "CODE_DIGITS",
    "EOS_ID",
    "EVAL_SEED_BASE",
    "PAD_ID",
    "SPLITS",
    "TRAIN_SEED_BASE",
    "HaystackSample",
    "build_assets",
    "corpus_stats",
    "encode_corpus",
    "eval_seed",
    "held_out_batch",
    "load_corpus",
    "load_default_tokenizer",
    "make_batch",
    "make_sample",
    "train_seed",
    "train_tokenizer",
]
