"""A held-out chat retrieval set for a real chat model: facts planted at set depths in corpus filler.

Item i is the haystack sample of held-out seed `eval_seed(first_index + i)` (facts "The code of the
blue box is 4711." planted in validation-split text, see `jaxlongctx.data.haystack`), its asked fact
at depth `depths[i % len(depths)]`, rendered in the model's chat template: the document and question
are the user's turn; the assistant's answer starts "The code of the blue box is " and must go on with
the code's digits. `noun` renames the code in facts, question and answer ("The secret number of the
blue box is 4711."). Same arguments -> the same items, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxlongctx.data.haystack import (
    CODE_DIGITS,
    DEFAULT_NOUN,
    answer_prefix_text,
    chat_frame,
    chat_prompt,
    eval_seed,
    make_sample,
)

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class RetrievalItem:
    """One question: `prompt` (int32 `[P]`, up to the assistant's turn), `answer_prefix` (int32 `[A]`,
    the assistant's words before the code) and the code's digit tokens `answer_ids` (int32 `[4]`)."""

    prompt: np.ndarray
    answer_prefix: np.ndarray
    answer_ids: np.ndarray
    answer: str
    depth: float
    seed: int


def retrieval_set(
    tokenizer: Any,
    count: int,
    context: int,
    depths: tuple[float, ...] = DEFAULT_DEPTHS,
    first_index: int = 0,
    num_facts: int = 4,
    noun: str = DEFAULT_NOUN,
) -> list[RetrievalItem]:
    """`count` held-out items whose prompt, answer prefix and code together fit `context` tokens."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be a non-empty tuple of values in [0, 1], got {depths}")
    frame = chat_frame(tokenizer, noun)
    length = (
        context - frame.overhead - CODE_DIGITS
    )  # the plain sample; its chat form is at most overhead longer
    items = []
    for i in range(first_index, first_index + count):
        depth = depths[i % len(depths)]
        seed = eval_seed(i)
        sample = make_sample(
            np.random.default_rng([seed, 0]),
            length,
            tokenizer,
            num_facts=num_facts,
            target_depth=depth,
            noun=noun,
        )
        full = chat_prompt(sample, frame, tokenizer)
        prefix_len = len(
            tokenizer.encode(
                answer_prefix_text(sample.subjects[sample.target_fact], noun), add_special_tokens=False
            ).ids
        )
        items.append(
            RetrievalItem(
                prompt=full[:-prefix_len],
                answer_prefix=full[-prefix_len:],
                answer_ids=sample.answer_ids,
                answer=sample.answer,
                depth=depth,
                seed=seed,
            )
        )
    return items
