"""Language-model pretraining of a small Llama on the corpus train split (`jaxlongctx train-lm`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.checkpoint import save_model
from jaxlongctx.config import ModelConfig
from jaxlongctx.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_PATH, encode_corpus
from jaxlongctx.model.model import Model
from jaxlongctx.output_dir import check_output
from jaxlongctx.train.data import TokenWindows
from jaxlongctx.train.evaluate import perplexity, token_nll, unigram_baseline
from jaxlongctx.train.optim import OptimConfig, make_optimizer
from jaxlongctx.train.trainer import Trainer, TrainerConfig, load_into

_SPECIALS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
# The shipped base model: 4 layers, d 192, GQA 6/2 heads of 32, SwiGLU 512, tied embeddings (2.4M params:
# 4.7 MB in bf16, and about 1.7x cheaper per step than d 256 / MLP 768 on the shared 2-core CPU).
BASE_CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=192,
    intermediate_size=512,
    num_layers=4,
    num_heads=6,
    num_kv_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    **_SPECIALS,
)
# A tiny model for smoke tests.
QUICK_CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
    max_position_embeddings=64,
    **_SPECIALS,
)


def lm_trainer(
    config: ModelConfig,
    optim: OptimConfig,
    trainer: TrainerConfig,
    batch_size: int,
    context: int,
    seed: int = 0,
    eval_tokens: Any = None,
    eval_batch_size: int = 8,
) -> Trainer:
    """A `Trainer` for next-token prediction on the train split (fp32 params, init from `seed`)."""
    train_tokens = encode_corpus("train")
    if config.vocab_size < int(train_tokens.max()) + 1:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's ids need")
    model = Model.init(config, seed=seed, dtype=jnp.float32)
    graphdef = model.graphdef
    windows = TokenWindows(train_tokens, batch_size, context, seed=seed)

    def loss_fn(params, _frozen, batch):
        s, c = token_nll(nnx.merge(graphdef, params), batch["ids"], batch["mask"])
        return s / c

    def eval_fn(params) -> dict[str, float]:
        module = nnx.merge(graphdef, params)
        return perplexity(module, eval_tokens, context, eval_batch_size)

    return Trainer(
        loss_fn,
        nnx.to_pure_dict(model.params),
        make_optimizer(optim),
        windows.batch,
        trainer,
        eval_fn=None if eval_tokens is None else eval_fn,
        count_tokens=lambda b: int(b["mask"][:, 1:].sum()),
    )


# --- CLI: train-lm --------------------------------------------------------------------------------
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
        dtype = jnp.bfloat16 if args.save_dtype == "bf16" else jnp.float32
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
