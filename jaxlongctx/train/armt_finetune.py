"""ARMT fine-tuning on the haystack retrieval task through the diagonal schedule (the `jaxlongctx
train-armt` command is `jaxlongctx.commands.train_armt`).

A training sample is a haystack prompt followed by its answer digits (and, with follow-ups, by
questions about the sample's other facts, each with its answer), at most `tokens` long. The loss is
the cross-entropy of the answer digits plus `lm_weight` times the mean next-token loss over
the whole sample (it keeps the model a language model and teaches it to copy the asked subject).
The curriculum is a list of stages, each a sample length, a number of steps and a batch size. The
usual one first teaches in-segment retrieval on one segment (short filler, then a full segment), then
doubles the number of segments (2, 4, ...), so that the answer must come through the memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.armt.segments import Segments, pad_segments, segment, segment_at, token_rows
from jaxlongctx.armt.sentences import SentenceSegmenter, make_segmenter
from jaxlongctx.data.haystack import (
    CODE_DIGITS,
    DEFAULT_NOUN,
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
from jaxlongctx.train.optim import OptimConfig, make_optimizer
from jaxlongctx.train.trainer import Trainer, TrainerConfig

DEFAULT_CURRICULUM = "64:300:32,128:300:32,256:800:16,512:400:8"
QUICK_STEPS, QUICK_SEGMENTS, QUICK_SEGMENT_SIZE = 2, 2, 64  # --quick: steps on one batch of 1 sample
# training filler comes from the train split, so that the validation split's text (evaluation filler)
# is new to the memory, as a user's document is
TRAIN_FILLER_SPLIT = "train"
NEAR_FACT_ROOM = 16  # tokens kept free for a fact ("The code of the blue box is 4711.") before a boundary


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
    near_fraction: float = 0.0,
    noun: str = DEFAULT_NOUN,
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
    nearly every segment of the sample (otherwise its depth is uniform). About `near_fraction` of the
    other samples put it in the last quarter of the first segment, just before the first boundary:
    the easiest fact the memory has to carry (one write, one boundary). About `shared_word_fraction`
    of the samples are near misses: every other fact's subject shares the asked subject's colour or
    object (otherwise subjects are random). `num_facts` is a count, or a range `(lo, hi)` from which
    each sample draws its own count uniformly. The filler comes from the corpus split `filler_split`.
    About `split_fraction` of the samples shift their text so that a segment boundary falls between
    the asked fact's subject and its code's last digit, the binding only the memory can carry (at
    uniform positions that is about 5% of facts; where the filler ahead of the first fact is shorter
    than the shift, the sample stays as it is). `noun` is what facts and questions call the code
    ("secret number"); a `chat` frame must be built for the same noun (`chat_frame(tokenizer, noun)`).

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
        ("near_fraction", near_fraction),
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
        near = depth is None and bool(near_fraction) and rng.random() < near_fraction
        near_room = int(rng.integers(0, segment_size // 4 + 1)) if near else 0  # filler after the fact
        facts = lo if lo == hi else int(rng.integers(lo, hi + 1))
        shared = bool(shared_word_fraction) and rng.random() < shared_word_fraction
        make = functools.partial(
            make_sample,
            tokenizer=tokenizer,
            num_facts=facts,
            target_depth=depth,
            shared_word=shared,
            filler_split=filler_split,
            noun=noun,
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
        if near:  # the asked fact's start, as a share of this prompt's filler
            before = segment_size - (0 if chat is None else chat.head.size - 1) - NEAR_FACT_ROOM - near_room
            depth = min(max(before - 1, 0) / max(prompt - fixed, 1), 1.0)
            sample = make(np.random.default_rng([seed, i]), prompt, target_depth=depth)
        elif prompt == longest.ids.size:
            sample = longest
        else:
            sample = make(np.random.default_rng([seed, i]), prompt)
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


def memory_in_float32(armt: ARMTModel) -> ARMTModel:
    """Cast the memory parameters of `armt` to float32 in place (whatever the base weights' dtype), the
    precision they are trained in; returns it."""
    graphdef, state = nnx.split(armt.memory)
    armt.memory = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float32), state))
    return armt


def scale_base_updates(scale: float) -> optax.GradientTransformation:
    """Multiply the base's updates (the first of `(base, memory)` params) by `scale`, the memory's not."""
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"the base's learning-rate scale must be a positive number, got {scale}")

    def scale_first(updates, params=None):
        del params
        base, memory = updates
        return jax.tree.map(lambda u: u * scale, base), memory

    return optax.stateless(scale_first)


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
    base_lr_scale: float = 1.0,
    near_fraction: float = 0.0,
    noun: str = DEFAULT_NOUN,
) -> Trainer:
    """A `Trainer` of `retrieval_loss` through the diagonal schedule over the curriculum `stages` (memory
    params, and the base weights unless `freeze_base`: then the base is neither differentiated nor given
    optimizer state), the samples cut by `segmentation` ("fixed" or "sentences", as
    `ARMTModel.segmentation`). With `chat` the samples are chat haystacks in the model's own tokenizer
    and chat template (else plain ones in the built-in tokenizer); with `fixed_batch` every step
    trains on the first step's batch. Where the base is trained, its updates are scaled by
    `base_lr_scale` (a pretrained base wants a smaller learning rate than a fresh memory). `noun` is
    what the samples' facts and questions call the code."""
    tokenizer = armt.tokenizer if chat else load_default_tokenizer()
    frame = chat_frame(tokenizer, noun) if chat else None
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
            near_fraction,
            noun,
        )

    def loss_fn(params, frozen, batch):
        full = (frozen, params) if freeze_base else params
        segs = Segments(batch["seg_ids"], batch["seg_n"], batch["seg_first"])
        _, logits = armt.run_segments(full, segs, "diagonal")
        return retrieval_loss(logits, batch, lm_weight)

    params, frozen = (memory, base) if freeze_base else ((base, memory), None)
    optimizer = make_optimizer(optim)
    if not freeze_base and base_lr_scale != 1.0:
        optimizer = optax.chain(optimizer, scale_base_updates(base_lr_scale))
    return Trainer(
        loss_fn,
        params,
        optimizer,
        batch_fn,
        trainer,
        frozen=frozen,
        count_tokens=lambda b: int(b["seg_n"].sum()),
    )
