"""`jaxlongctx train-lm`: pretrain (or resume) a small Llama on the corpus train split
(`jaxlongctx.train.lm`), evaluate it against the unigram baseline, save it and plot the loss."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax

from jaxlongctx.checkpoint import save_model
from jaxlongctx.data.tokenizer import TOKENIZER_PATH, encode_corpus
from jaxlongctx.loading import parse_dtype
from jaxlongctx.model.model import Model
from jaxlongctx.output_dir import check_output
from jaxlongctx.train.evaluate import perplexity, unigram_baseline
from jaxlongctx.train.lm import BASE_CONFIG, QUICK_CONFIG, lm_trainer
from jaxlongctx.train.optim import OptimConfig
from jaxlongctx.train.trainer import TrainerConfig, load_into


def add_train_lm_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `jaxlongctx train-lm`."""
    parser.add_argument(
        "--out",
        required=True,
        help="run directory (checkpoints, loss curve, summary.json); an existing run there is resumed",
    )
    parser.add_argument(
        "--save", help="write the final model here as a jaxlongctx checkpoint (with tokenizer)"
    )
    parser.add_argument("--save-dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --save checkpoint of ours"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, 20 steps, short context (smoke test)"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%% of --steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-every", type=int, default=25)
    parser.add_argument(
        "--eval-every", type=int, default=0, help="validation every N steps (0: only at the end)"
    )
    parser.add_argument("--no-progress", action="store_true")


def _given_or(value: int | None, default: int) -> int:
    """A command-line number as given (0 included, so that it is refused rather than replaced), or `default`."""
    return default if value is None else value


def run_train_lm(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxlongctx train-lm`: pretrain (or resume), evaluate on validation vs unigram, save, plot."""
    config = QUICK_CONFIG if args.quick else BASE_CONFIG
    steps = _given_or(args.steps, 20 if args.quick else 180)
    batch_size = _given_or(args.batch_size, 4 if args.quick else 8)
    context = _given_or(args.context, 64 if args.quick else 512)
    if min(steps, batch_size, context) < 1:
        raise ValueError(
            f"--steps, --batch-size and --context must be >= 1, got {steps}, {batch_size}, {context}"
        )
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    out = Path(args.out)
    if args.save:
        check_output(args.save, overwrite=args.overwrite, inputs=(out,))
    val = encode_corpus("validation")
    if args.quick:
        val = val[: 4 * context]
    optim = OptimConfig(lr=args.lr, warmup_steps=warmup, total_steps=steps)
    hyperparams = {
        "model": "quick" if args.quick else "base",
        "batch_size": batch_size,
        "context": context,
        "seed": args.seed,
        "optim": dataclasses.asdict(optim),
    }
    tcfg = TrainerConfig(
        steps=steps,
        out_dir=out,
        ckpt_every=args.ckpt_every,
        eval_every=args.eval_every,
        progress=not args.no_progress,
        hyperparams=hyperparams,
    )
    trainer = lm_trainer(config, optim, tcfg, batch_size, context, args.seed, eval_tokens=val)
    resumed = trainer.maybe_resume()
    t0 = time.perf_counter()
    trainer.run()
    elapsed = time.perf_counter() - t0
    trainer.plot(out / "loss_curve.png", title=f"train-lm: {config.num_layers}L d{config.hidden_size}")
    val_metrics = trainer.history["eval"][-1]
    summary: dict[str, Any] = {
        "model_config": config.to_dict(),
        "optim": dataclasses.asdict(optim),
        "steps": steps,
        "batch_size": batch_size,
        "context": context,
        "seed": args.seed,
        "resumed": resumed,
        "train_tokens_seen": steps * batch_size * context,
        "train_wall_s": trainer.history["wall_s"][-1],
        "this_session_wall_s": elapsed,
        "final_train_loss": trainer.history["loss"][-1],
        "validation": {
            "loss": val_metrics["loss"],
            "ppl": val_metrics["ppl"],
            "tokens": val_metrics["tokens"],
        },
        "unigram_validation": unigram_baseline(encode_corpus("train"), val, config.vocab_size),
        "params": int(sum(x.size for x in jax.tree.leaves(trainer.params))),
    }
    if args.save:
        dtype = parse_dtype(args.save_dtype)
        params = jax.tree.map(lambda x: x.astype(dtype), trainer.params)
        cast = load_into(Model.init(config, dtype=dtype).module, params)
        save_model(cast, args.save, overwrite=args.overwrite, tokenizer_file=TOKENIZER_PATH)
        saved = perplexity(cast, val, context)
        summary["saved"] = {"path": str(args.save), "dtype": args.save_dtype, "validation": saved}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        json.dumps(
            {
                "validation_ppl": summary["validation"]["ppl"],
                "unigram_ppl": summary["unigram_validation"]["ppl"],
            }
        )
    )
    return summary
