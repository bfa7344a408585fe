"""`jaxlongctx eval-ppl`: load a model and print its perplexity on a corpus split
(`jaxlongctx.train.evaluate.perplexity`), with `--kv` over fake-quantized keys and values
(`jaxlongctx.kv_quality`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxlongctx.cli_options import add_model_argument
from jaxlongctx.data.tokenizer import encode_corpus
from jaxlongctx.kv_quality import DEFAULT_GROUP, KV_KINDS, kv_perplexity
from jaxlongctx.kvcache.model_codebooks import load_codebooks_for
from jaxlongctx.loading import load
from jaxlongctx.train.evaluate import KVTransform, perplexity, unigram_baseline


def add_eval_ppl_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `jaxlongctx eval-ppl`."""
    add_model_argument(parser, "jaxlongctx checkpoint or HF model directory", old="--ckpt", required=True)
    parser.add_argument("--split", choices=["train", "validation", "calibration"], default="validation")
    parser.add_argument("--context", type=int, default=512, help="window length in tokens (default 512)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="parameter dtype (default: as stored)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the split"
    )
    parser.add_argument("--baseline", action="store_true", help="also report the unigram baseline")


def run_eval_ppl(args: argparse.Namespace, kv_transform: KVTransform | None = None) -> dict[str, Any]:
    """`jaxlongctx eval-ppl`: print (as JSON) and return the perplexity of `--model` on `--split`."""
    if args.context < 1 or args.batch_size < 1:
        raise ValueError(f"--context and --batch-size must be >= 1, got {args.context} and {args.batch_size}")
    model = load(args.model, args.dtype)
    if not hasattr(model, "module"):
        raise ValueError(
            f"{args.model} holds a {type(model).__name__}; eval-ppl measures full-attention models "
            "(give the base model, or measure ARMT with the retrieval bench)"
        )
    tokens = encode_corpus(args.split, model.tokenizer)
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        tokens = tokens[: args.max_tokens]
    result: dict[str, Any] = {
        "ckpt": str(args.model),
        "split": args.split,
        "context": args.context,
        **perplexity(model.module, tokens, args.context, args.batch_size, kv_transform),
    }
    if args.baseline:
        result["unigram"] = unigram_baseline(
            encode_corpus("train", model.tokenizer), tokens, model.config.vocab_size
        )
    print(json.dumps(result))
    return result


def add_eval_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """The K/V options of `jaxlongctx eval-ppl` (added next to `add_eval_ppl_arguments`)."""
    parser.add_argument("--kv", choices=KV_KINDS, default="dense", help="fake-quantize every token's K/V")
    parser.add_argument("--codebooks", help="codebooks directory for --kv pq (from `jaxlongctx calibrate`)")
    parser.add_argument(
        "--kivi-group",
        type=int,
        default=DEFAULT_GROUP,
        help=f"group size of --kv int4/int2 (default {DEFAULT_GROUP})",
    )


def run_eval_kv(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxlongctx eval-ppl [--kv ...]`: perplexity of `--model` on `--split` with quantized K/V; prints JSON."""
    if args.context < 1 or args.batch_size < 1:
        raise ValueError(f"--context and --batch-size must be >= 1, got {args.context} and {args.batch_size}")
    if (args.kv == "pq") != (args.codebooks is not None):
        raise ValueError("--codebooks is needed with --kv pq, and only then")
    if args.kv == "dense":
        return run_eval_ppl(args)
    model = load(args.model, args.dtype)
    codebooks = load_codebooks_for(model, args.codebooks) if args.kv == "pq" else None
    tokens = encode_corpus(args.split, model.tokenizer)
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        tokens = tokens[: args.max_tokens]
    result = {
        "ckpt": str(args.model),
        "split": args.split,
        "context": args.context,
        **kv_perplexity(model, tokens, args.context, args.kv, codebooks, args.kivi_group, args.batch_size),
    }
    print(json.dumps(result))
    return result
