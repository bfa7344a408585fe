"""Exact-match accuracy on held-out chat haystacks (`jaxlongctx.data.chat_retrieval`) by teacher forcing.

One forward per item over prompt + answer prefix + the code's first `CODE_DIGITS - 1` digits; the
prediction is the argmax at the `CODE_DIGITS` positions that predict the digits. All of them are right
exactly when greedy decoding writes the code: greedy's first digit is the first argmax, and while its
digits are right it has fed the same tokens teacher forcing feeds, so its next argmax is the next one.

A full-attention model sees at most `native` tokens (its trained context): `fit_context` cuts a longer
item to fit. An ARMT model reads an item as its decoding does (`jaxlongctx.armt.generation`): every
segment before the prompt's last runs through the chosen schedule, writing the memory state (a few
segments per call, their logits dropped, so memory stays bounded at any length), and the rest is the
decoding window, which reads the memory state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxlongctx.armt.generation import window_logits, window_starts
from jaxlongctx.armt.memory import zero_state
from jaxlongctx.data.chat_retrieval import RetrievalItem, retrieval_set
from jaxlongctx.data.haystack import (
    CODE_DIGITS,
    COLOURS,
    DEFAULT_NOUN,
    OBJECTS,
    chat_frame,
    chat_question_text,
)
from jaxlongctx.model.llama import forward_hidden
from jaxlongctx.train.evaluate import exact_match_interval

PREFIX_CHUNK_SEGMENTS = 8  # prompt segments per schedule call: their dropped logits stay [8, 1, S, V]

DigitLogits = Callable[[np.ndarray, int], np.ndarray]  # (ids [T], prompt_length) -> [CODE_DIGITS, V]


class ChatCut(NamedTuple):
    """What `fit_context` keeps of a chat prompt: its first `head` tokens (the template's system turn
    and the user turn's start) and, at least, its last `end` tokens (question and assistant turn start)."""

    head: int
    end: int


def chat_cut(tokenizer: Any, noun: str = DEFAULT_NOUN) -> ChatCut:
    """The `ChatCut` of `tokenizer`'s chat template (`end`: the longest question over all subjects, the
    code called `noun`)."""
    frame = chat_frame(tokenizer, noun)
    longest = max(
        len(tokenizer.encode(chat_question_text(f"{c} {o}", noun), add_special_tokens=False).ids)
        for c in COLOURS
        for o in OBJECTS
    )
    return ChatCut(int(frame.head.size), int(frame.tail.size) + longest)


def fit_context(item: RetrievalItem, cut: ChatCut, native: int) -> RetrievalItem:
    """`item` cut so that prompt, answer prefix and code fit `native` tokens: the prompt keeps its first
    `cut.head` tokens (chat frame head) and its last tokens (the end of the document, the question, the
    assistant turn's start); the tokens dropped are the document's first ones. Unchanged when it fits."""
    over = item.prompt.size + item.answer_prefix.size + CODE_DIGITS - native
    if over <= 0:
        return item
    if item.prompt.size - cut.head - over < cut.end:
        raise ValueError(
            f"a context of {native} tokens cannot hold the chat frame, the question and the answer "
            f"({cut.head + cut.end + item.answer_prefix.size + CODE_DIGITS} tokens at least)"
        )
    prompt = np.concatenate([item.prompt[: cut.head], item.prompt[cut.head + over :]])
    return dataclasses.replace(item, prompt=prompt)


def teacher_forced(item: RetrievalItem) -> tuple[np.ndarray, int]:
    """Ids `[P + A + CODE_DIGITS - 1]` (prompt, answer prefix, all code digits but the last) and the
    prompt length `P + A`: the logits at `P + A - 1 + k` predict digit k."""
    ids = np.concatenate([item.prompt, item.answer_prefix, item.answer_ids[:-1]]).astype(np.int32)
    return ids, item.prompt.size + item.answer_prefix.size


def full_attention_digit_logits(model: Any) -> DigitLogits:
    """`(ids [T], prompt_length) -> logits [CODE_DIGITS, V]` of a full-attention `Model` (one causal
    forward; inputs right-padded to a power of two, so that few lengths compile)."""
    fns = model.__dict__.setdefault("_chat_accuracy_fns", {})
    if "digits" not in fns:

        def digits(params, ids, mask, first):  # ids, mask [1, W]; first: the first digit's logit row
            module = model.merge(params)
            h = jax.lax.dynamic_slice_in_dim(forward_hidden(module, ids, mask), first, CODE_DIGITS, axis=1)
            return module.head(h)[0]

        fns["digits"] = jax.jit(digits)

    def logits(ids: np.ndarray, prompt_length: int) -> np.ndarray:
        model.check_length(ids.size)
        width = 1 << max(ids.size - 1, 1).bit_length()
        padded = np.zeros((1, width), np.int32)
        padded[0, : ids.size] = ids
        mask = np.arange(width)[None] < ids.size
        return np.asarray(fns["digits"](model.params, padded, mask, prompt_length - 1))

    return logits


def armt_digit_logits(armt: Any, schedule: str, chunk_segments: int = PREFIX_CHUNK_SEGMENTS) -> DigitLogits:
    """`(ids [T], prompt_length) -> logits [CODE_DIGITS, V]` of an `ARMTModel` as its decoding after
    `prompt_length` tokens computes them (`ARMTModel.generation_logits`), the prompt's segments before
    the decoding window run through `schedule` `chunk_segments` at a time."""
    if chunk_segments < 1:
        raise ValueError(f"chunk_segments must be >= 1, got {chunk_segments}")

    def logits(ids: np.ndarray, prompt_length: int) -> np.ndarray:
        rows, S = ids[None].astype(np.int32), armt.armt.segment_size
        opens, before = window_starts(armt, rows, np.array([prompt_length]))
        start = int(opens[0])
        if ids.size - start > 2 * S:
            raise ValueError(
                f"{ids.size - prompt_length} tokens after the prompt outgrow the decoding window"
            )
        state = zero_state(armt, 1)
        if start:
            segs, _ = armt.segments(rows, opens, before)
            for i in range(0, segs.count, chunk_segments):
                state, _ = armt.run_segments(armt.params, segs[i : i + chunk_segments], schedule, state)
        window = np.zeros((1, 2 * S), np.int32)
        window[0, : ids.size - start] = ids[start:]
        out = window_logits(armt, state, window, np.array([ids.size - start]))
        first = prompt_length - 1 - start
        return np.asarray(out[0, first : first + CODE_DIGITS])

    return logits


def code_position(prompt: np.ndarray, code: np.ndarray) -> int:
    """Where the asked code's digit tokens `code [CODE_DIGITS]` first appear in `prompt [T]`."""
    windows = np.lib.stride_tricks.sliding_window_view(prompt, len(code))
    return int(np.flatnonzero((windows == code).all(axis=1))[0])


def fact_in_window(armt: Any, item: RetrievalItem) -> dict[str, Any]:
    """Where `item`'s fact lies for an `ARMTModel` reading it as `armt_digit_logits` does: the code's
    first token in the prompt, the start of the decoding window, and whether the fact is inside the
    window (answerable by attention there) rather than before it (only through the memory)."""
    at = code_position(item.prompt, item.answer_ids)
    ids, prompt_length = teacher_forced(item)
    opens, _ = window_starts(armt, ids[None], np.array([prompt_length]))
    return {"code_position": at, "window_start": int(opens[0]), "fact_in_window": at >= int(opens[0])}


def answer_logits(
    digit_logits: DigitLogits, items: list[RetrievalItem], desc: str = "items", progress: bool = True
) -> np.ndarray:
    """Teacher-forced digit logits `[N, CODE_DIGITS, V]` of every item (a progress bar over items)."""
    out = []
    for item in tqdm(items, desc=desc, unit="item", disable=not progress):
        out.append(digit_logits(*teacher_forced(item)))
    return np.stack(out)


def exact_match(predicted: np.ndarray, items: list[RetrievalItem]) -> dict[str, Any]:
    """Exact match (all digits right) of predicted digit tokens `[N, CODE_DIGITS]` against the items'
    codes: correct, n, accuracy, its 95% Wilson interval and the per-digit accuracy."""
    hit = np.asarray(predicted) == np.stack([item.answer_ids for item in items])
    right, n = int(hit.all(axis=1).sum()), len(items)
    return {
        "correct": right,
        "n": n,
        "accuracy": right / n,
        "interval": exact_match_interval(right, n),
        "digit_accuracy": float(hit.mean()),
    }


def argmax_digits(logits: np.ndarray) -> np.ndarray:
    """Predicted digit tokens `[N, CODE_DIGITS]` of logits `[N, CODE_DIGITS, V]`."""
    return np.argmax(logits, axis=-1).astype(np.int32)


def armt_chat_accuracy(
    armt: Any,
    length: int,
    samples: int,
    num_facts: int = 1,
    schedule: str = "diagonal",
    progress: bool = False,
    noun: str = DEFAULT_NOUN,
) -> dict[str, Any]:
    """Exact match of an `ARMTModel` on `samples` held-out chat items of `length` tokens with `num_facts`
    facts (`retrieval_set`: validation-split filler, depths cycling through DEFAULT_DEPTHS, the code
    called `noun`), read as its decoding reads them through `schedule`."""
    items = retrieval_set(armt.tokenizer, samples, length, num_facts=num_facts, noun=noun)
    logits = answer_logits(
        armt_digit_logits(armt, schedule), items, f"chat retrieval at {length:,}", progress
    )
    return {
        "length": length,
        "num_facts": num_facts,
        "noun": noun,
        **exact_match(argmax_digits(logits), items),
    }
