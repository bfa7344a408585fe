"""ARMT fine-tuning on the haystack retrieval task through the diagonal schedule (`jaxlongctx train-armt`).

A training sample is a haystack prompt followed by its answer digits, exactly `k * segment_size`
tokens long; the loss is the cross-entropy of the answer digits only. A curriculum doubles the
number of segments `k` (1, 2, 4, ...) in equal-length stages.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.armt.segments import Segments, segment
from jaxlongctx.data.haystack import CODE_DIGITS, make_batch, train_seed
from jaxlongctx.data.tokenizer import load_default_tokenizer
from jaxlongctx.train.evaluate import answer_inputs, retrieval_accuracy
from jaxlongctx.train.optim import OptimConfig, make_optimizer
from jaxlongctx.train.trainer import Trainer, TrainerConfig, load_into


def curriculum(stages: list[int], steps: int) -> list[int]:
    """Segments per training step: `steps` split into equal consecutive stages of `stages` segments."""
    if not stages or any(s < 1 for s in stages):
        raise ValueError(f"curriculum stages must be positive segment counts, got {stages}")
    if steps < len(stages):
        raise ValueError(f"need at least one step per curriculum stage ({len(stages)}), got {steps} steps")
    bounds = np.linspace(0, steps, len(stages) + 1).astype(int)
    return [stages[i] for i in range(len(stages)) for _ in range(bounds[i + 1] - bounds[i])]


def haystack_batch(seed: int, batch: int, total_tokens: int, tokenizer: Any, segment_size: int,
                   num_facts: int) -> dict[str, np.ndarray]:
    """Segments of prompts + answers of exactly `total_tokens` tokens and the answer digits `[B, 4]`."""
    raw = make_batch(seed, batch, total_tokens - (CODE_DIGITS - 1), tokenizer, num_facts=num_facts)
    ids = answer_inputs(raw["ids"], raw["answer_ids"])
    segs = segment(ids, np.full((batch,), ids.shape[1], np.int32), segment_size)
    return {"seg_ids": segs.ids, "seg_n": segs.n, "seg_first": segs.first, "answer_ids": raw["answer_ids"]}


def answer_logits(logits: jnp.ndarray, total_tokens: int) -> jnp.ndarray:
    """Logits `[nS, B, S, V]` -> those predicting the answer digits `[B, CODE_DIGITS, V]`."""
    flat = jnp.swapaxes(logits, 0, 1).reshape(logits.shape[1], -1, logits.shape[-1])  # B nS*S V
    return flat[:, total_tokens - CODE_DIGITS:total_tokens]


def armt_trainer(armt: ARMTModel, optim: OptimConfig, trainer: TrainerConfig, batch_size: int,
                 schedule_segments: list[int], num_facts: int = 4, freeze_base: bool = False,
                 seed: int = 0) -> Trainer:
    """A `Trainer` of the answer-digit loss through the diagonal schedule (memory params, and the
    base weights unless `freeze_base`)."""
    tokenizer = load_default_tokenizer()
    s = armt.armt.segment_size
    base, memory = (nnx.to_pure_dict(p) for p in armt.params)

    def batch_fn(step: int) -> dict[str, np.ndarray]:
        return haystack_batch(train_seed(seed * 1_000_000 + step), batch_size, schedule_segments[step] * s,
                              tokenizer, s, num_facts)

    def loss_fn(params, frozen, batch):
        full = (frozen, params) if freeze_base else params
        segs = Segments(batch["seg_ids"], batch["seg_n"], batch["seg_first"])
        _, logits = armt.run_segments(full, segs, "diagonal")
        total = segs.ids.shape[0] * s
        ce = optax.softmax_cross_entropy_with_integer_labels(answer_logits(logits, total), batch["answer_ids"])
        return jnp.mean(ce)

    params, frozen = (memory, base) if freeze_base else ((base, memory), None)
    return Trainer(loss_fn, params, make_optimizer(optim), batch_fn, trainer, frozen=frozen,
                   count_tokens=lambda b: int(b["seg_n"].sum()))


# --- CLI: train-armt ------------------------------------------------------------------------------
def add_train_armt_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `jaxlongctx train-armt`."""
    parser.add_argument("--base", required=True, help="base model checkpoint (jaxlongctx or HF directory)")
    parser.add_argument("--out", required=True, help="run directory (checkpoints, loss curve, summary.json); "
                                                     "an existing run there is resumed")
    parser.add_argument("--save", help="write the fine-tuned ARMT model here")
    parser.add_argument("--save-dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--segment-size", type=int, default=128)
    parser.add_argument("--mem-tokens", type=int, default=16)
    parser.add_argument("--d-mem", type=int, default=32)
    parser.add_argument("--curriculum", default="1,2,4", help="segments per sample, one stage each (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-facts", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--freeze-base", action="store_true", help="train only the memory parameters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-every", type=int, default=25)
    parser.add_argument("--eval-lengths", default="", help="context lengths for a final accuracy check, e.g. 512,2048")
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--no-progress", action="store_true")


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{name} values must be >= 1, got {text!r}")
    return values


def run_train_armt(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxlongctx train-armt`: wrap the base model with ARMT memory, fine-tune (or resume), save."""
    from jaxlongctx.loading import load

    stages = _int_list(args.curriculum, "--curriculum")
    if min(args.steps, args.batch_size) < 1:
        raise ValueError(f"--steps and --batch-size must be >= 1, got {args.steps} and {args.batch_size}")
    base = load(args.base, "fp32")
    cfg = ARMTConfig(args.segment_size, args.mem_tokens, args.d_mem)
    armt = base.with_armt(cfg, jax.random.key(args.seed))
    out = Path(args.out)
    optim = OptimConfig(lr=args.lr, warmup_steps=max(1, args.steps // 20), total_steps=args.steps,
                        weight_decay=0.0)
    tcfg = TrainerConfig(steps=args.steps, out_dir=out, ckpt_every=args.ckpt_every, progress=not args.no_progress)
    schedule = curriculum(stages, args.steps)
    trainer = armt_trainer(armt, optim, tcfg, args.batch_size, schedule, args.num_facts, args.freeze_base, args.seed)
    resumed = trainer.maybe_resume()
    t0 = time.perf_counter()
    trainer.run()
    trainer.plot(out / "loss_curve.png", title="ARMT fine-tuning: answer-digit loss")
    base_state, memory = (trainer.frozen, trainer.params) if args.freeze_base else trainer.params
    load_into(armt.base.module, base_state)
    load_into(armt.memory, memory)
    summary: dict[str, Any] = {
        "armt_config": cfg.to_dict(), "optim": dataclasses.asdict(optim), "steps": args.steps,
        "curriculum": stages, "batch_size": args.batch_size, "freeze_base": args.freeze_base,
        "num_facts": args.num_facts, "resumed": resumed, "train_wall_s": trainer.history["wall_s"][-1],
        "this_session_wall_s": time.perf_counter() - t0, "final_loss": trainer.history["loss"][-1],
        "accuracy": [retrieval_accuracy(armt, n, args.eval_samples, num_facts=args.num_facts)
                     for n in _int_list(args.eval_lengths, "--eval-lengths")],
    }
    if args.save:
        dtype = jnp.bfloat16 if args.save_dtype == "bf16" else jnp.float32
        cast = jax.tree.map(lambda x: x.astype(dtype), (base_state, memory))
        saved = load(args.base, args.save_dtype).with_armt(cfg, jax.random.key(args.seed))
        load_into(saved.base.module, cast[0])
        load_into(saved.memory, cast[1])
        saved.save(args.save, overwrite=True)
        summary["saved"] = str(args.save)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"final_loss": summary["final_loss"], "accuracy": summary["accuracy"]}))
    return summary
