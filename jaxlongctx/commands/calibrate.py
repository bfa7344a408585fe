"""`jaxlongctx calibrate`: load a model, tokenize the calibration text, train PQ codebooks for its keys
and values (`jaxlongctx.kvcache.calibrate`) and save them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxlongctx.cli_options import add_model_argument
from jaxlongctx.data.tokenizer import encode_corpus
from jaxlongctx.kvcache.calibrate import calibrate, default_points_per_centroid
from jaxlongctx.kvcache.channel_weights import WEIGHTINGS
from jaxlongctx.kvcache.codebooks import GRANULARITIES, save_codebooks
from jaxlongctx.loading import load
from jaxlongctx.output_dir import check_output


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `jaxlongctx calibrate`."""
    add_model_argument(parser, "jaxlongctx checkpoint or HF model directory", old="--ckpt", required=True)
    parser.add_argument("--text", help="calibration text file (default: the built-in calibration split)")
    parser.add_argument("--out", required=True, help="output codebooks directory")
    parser.add_argument(
        "--ds", type=int, default=2, help="subspace size (2: 4 bits/element, 4: 2 bits/element)"
    )
    parser.add_argument(
        "--bits",
        type=int,
        default=8,
        help="bits per code, 1-12 (default 8: 256 centroids; the PQ cache takes at most 8, wider codes serve quality evaluation)",
    )
    parser.add_argument("--granularity", choices=GRANULARITIES, default="shared")
    parser.add_argument("--iters", type=int, default=25, help="k-means iterations (default 25)")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="calibration window length (default 512); keys are stored after RoPE, so codebooks fit "
        "best up to this position: make it the context the cache will hold",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16384, help="calibration tokens used (default 16384)"
    )
    parser.add_argument(
        "--points-per-centroid",
        type=int,
        help="k-means vectors sampled per centroid in each problem (default: about 16,384 a problem and "
        "at least 64 a centroid: 64 for 8-bit codes, 1,024 for 4-bit)",
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=1e-3,
        help="stop k-means once the total error falls by at most this fraction in an "
        "iteration (default 1e-3; 0 runs every --iters)",
    )
    parser.add_argument(
        "--weighting",
        choices=WEIGHTINGS,
        default="none",
        help="attention: weight each channel by its effect on attention in k-means and encoding "
        "(query second moments for keys, W_o row norms for values); generation and eval-ppl --kv pq "
        "encode with the same weights (default none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="parameter dtype (default: as stored)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def run_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxlongctx calibrate`: train codebooks for `--model` and save them to `--out`; prints a JSON summary."""
    check_output(args.out, overwrite=args.overwrite, inputs=(args.model, args.text))
    model = load(args.model, args.dtype)
    if args.text is None:
        tokens, source = encode_corpus("calibration", model.tokenizer), "calibration split"
    else:
        text_path = Path(args.text)
        if not text_path.is_file():
            raise ValueError(f"--text {text_path} is not a file")
        if model.tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer.json, so --text cannot be tokenized")
        tokens = np.asarray(model.tokenizer.encode(text_path.read_text()).ids, np.int32)
        source = str(text_path)
    cb = calibrate(
        model,
        tokens,
        args.ds,
        args.bits,
        args.granularity,
        args.iters,
        seq_len=args.seq_len,
        max_tokens=args.max_tokens,
        seed=args.seed,
        progress=True,
        source=source,
        points_per_centroid=(
            default_points_per_centroid(args.bits)
            if args.points_per_centroid is None
            else args.points_per_centroid
        ),
        tol=args.tol,
        weighting=args.weighting,
    )
    path = save_codebooks(cb, args.out, overwrite=args.overwrite, inputs=(args.model, args.text))
    summary = {"out": str(path), "ds": cb.ds, "bits": cb.bits, "granularity": cb.granularity, **cb.metadata}
    print(json.dumps(summary))
    return summary
