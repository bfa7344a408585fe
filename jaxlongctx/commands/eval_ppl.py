"""`jaxlongctx eval-ppl`: load a model and print its perplexity on a corpus split or on your own text
(`--text FILE`, `-` for standard input), with `--kv-cache` over the keys and values that a quantized
cache holds: `pq` with the options of `generate`'s PQ cache (`jaxlongctx.kv_quality.cache_perplexity`),
or int4 / int2 fake quantization (`jaxlongctx.kv_quality.kv_perplexity`); quantized caches report the
dense perplexity on the same windows beside theirs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jaxlongctx.cache_choice import add_pq_cache_arguments, check_no_pq_options, pq_cache_from_args
from jaxlongctx.cli_options import add_model_argument
from jaxlongctx.data.tokenizer import encode_corpus
from jaxlongctx.kv_quality import DEFAULT_GROUP, KV_KINDS, cache_perplexity, kv_perplexity
from jaxlongctx.loading import load
from jaxlongctx.train.evaluate import perplexity, unigram_baseline


def add_eval_ppl_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `jaxlongctx eval-ppl` (the cache options: `add_eval_kv_arguments`)."""
    add_model_argument(
        parser, "jaxlongctx checkpoint, HF model directory or GGUF file", old="--ckpt", required=True
    )
    parser.add_argument(
        "--text", help="text file to measure ('-' reads standard input; default: the corpus split --split)"
    )
    parser.add_argument("--split", choices=["train", "validation", "calibration"], default="validation")
    parser.add_argument("--context", type=int, default=512, help="window length in tokens (default 512)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="parameter dtype (default: as stored)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text"
    )
    parser.add_argument("--baseline", action="store_true", help="also report the unigram baseline")


def add_eval_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """The cache options of `jaxlongctx eval-ppl` (added next to `add_eval_ppl_arguments`)."""
    parser.add_argument(
        "--kv-cache",
        "--kv",
        dest="kv_cache",
        choices=KV_KINDS,
        default="dense",
        help="the keys and values attention reads: dense, the PQ cache (with the --pq-* options, as "
        "`generate --kv-cache pq`), or every token int4/int2 fake-quantized (default dense)",
    )
    add_pq_cache_arguments(parser)
    parser.add_argument(
        "--kivi-group",
        type=int,
        default=DEFAULT_GROUP,
        help=f"group size of --kv-cache int4/int2 (default {DEFAULT_GROUP})",
    )


def read_text_tokens(path: str, tokenizer: Any, model_name: str) -> np.ndarray:
    """The token ids of text file `path` ('-': standard input)."""
    if tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer, so --text cannot be tokenized")
    if path == "-":
        text = sys.stdin.read()
    else:
        if not Path(path).is_file():
            raise ValueError(f"--text {path} is not a file")
        text = Path(path).read_text()
    tokens = np.asarray(tokenizer.encode(text).ids, np.int32)
    if tokens.size < 2:
        raise ValueError(f"--text {path}: {tokens.size} tokens, perplexity needs at least 2")
    return tokens


def run_eval_ppl(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxlongctx eval-ppl`: print (as JSON) and return the perplexity of `--model` on `--text` or
    `--split`, over the keys and values of `--kv-cache`."""
    if args.context < 1 or args.batch_size < 1:
        raise ValueError(f"--context and --batch-size must be >= 1, got {args.context} and {args.batch_size}")
    kind = getattr(args, "kv_cache", "dense")
    if kind != "pq" and hasattr(args, "codebooks"):
        check_no_pq_options(args, kind)
    model = load(args.model, args.dtype)
    if not hasattr(model, "module"):
        raise ValueError(
            f"{args.model} holds a {type(model).__name__}; eval-ppl measures full-attention models "
            "(give the base model, or measure ARMT with the retrieval bench)"
        )
    text = getattr(args, "text", None)
    if text is not None:
        tokens = read_text_tokens(text, model.tokenizer, str(args.model))
    else:
        tokens = encode_corpus(args.split, model.tokenizer)
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        tokens = tokens[: args.max_tokens]
    where = {"text": text} if text is not None else {"split": args.split}
    result: dict[str, Any] = {"ckpt": str(args.model), **where, "context": args.context}
    progress = True  # tqdm on standard error; the JSON result goes to standard output
    if kind == "dense":
        result.update(perplexity(model.module, tokens, args.context, args.batch_size, progress=progress))
    elif kind == "pq":
        cache = pq_cache_from_args(args, model)
        result.update(cache_perplexity(model, tokens, args.context, cache, args.batch_size, progress))
    else:
        quantized = kv_perplexity(model, tokens, args.context, kind, None, args.kivi_group, args.batch_size)
        dense = perplexity(model.module, tokens, args.context, args.batch_size)
        result.update(quantized, dense_ppl=dense["ppl"], ppl_change=quantized["ppl"] / dense["ppl"] - 1)
    if args.baseline:
        result["unigram"] = unigram_baseline(
            encode_corpus("train", model.tokenizer), tokens, model.config.vocab_size
        )
    print(json.dumps(result))
    return result
