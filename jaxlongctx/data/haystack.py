"""BABILong-like long-context retrieval task: find a code among facts hidden in filler text.

A sample is, in tokens, exactly ``length_tokens`` long::

    <bos> filler ... " The code of the blue box is 4711." ... filler ... (num_facts facts)
    "\\nWhat is the code of the blue box? The code of the blue box is "

The filler is random contiguous spans of one tokenized corpus split (documents separated by
``<eos>``, exactly as in packed training data): the *validation* split by default, text the base
model never trained on; ARMT fine-tuning draws it from the *train* split by default. A sample
longer than its split repeats text (the validation split holds about 54K tokens). Facts are spliced in at token
boundaries, preferably at sentence ends.  The prompt ends with the space token, and the
answer is the code's :data:`CODE_DIGITS` digits, one token each (the tokenizer splits
digits), so greedy exact-match chance is ``10 ** -CODE_DIGITS`` and per-digit chance 1/10.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from jaxlongctx.data.tokenizer import BOS_ID, EOS_ID, encode_corpus

COLOURS: tuple[str, ...] = (
    "black",
    "blue",
    "brown",
    "green",
    "grey",
    "orange",
    "pink",
    "purple",
    "red",
    "silver",
    "white",
    "yellow",
)
OBJECTS: tuple[str, ...] = (
    "bag",
    "book",
    "bottle",
    "box",
    "chest",
    "door",
    "drawer",
    "folder",
    "jar",
    "key",
    "lamp",
    "safe",
)
CODE_DIGITS = 4
TOKENS_BEFORE_CODE = 2  # " is", " ": between a fact's subject and its code (see fact_head_text)
FILLER_SPLIT = "validation"  # default filler: text the base model never trained on
MAX_SHARED_WORD_FACTS = len(COLOURS) + len(OBJECTS) - 1  # the asked subject and all that share a word with it

# What a fact calls its number. "code" is what every shipped ARMT model was trained on; a chat model
# may read it as program code (SmolLM2-135M-Instruct answers many "code" questions with a ``` fence
# and gets most of them right when the facts say "secret number" instead).
DEFAULT_NOUN = "code"

# Seeds below EVAL_SEED_BASE are for training, seeds from it on are held out for evaluation.
SEED_SPACE = 2**31
TRAIN_SEED_BASE = 0
EVAL_SEED_BASE = TRAIN_SEED_BASE + SEED_SPACE


@dataclass(frozen=True)
class HaystackSample:
    """One retrieval prompt; the model must continue ``ids`` with ``answer_ids``."""

    ids: np.ndarray  # int32, exactly length_tokens: <bos>, filler and facts, question
    answer_ids: np.ndarray  # int32, CODE_DIGITS single-digit tokens
    answer: str  # the code, e.g. "4711"
    question: str  # text of the prompt's last tokens, ends with "... is "
    facts: tuple[str, ...]  # text of each inserted fact, in position order
    fact_positions: np.ndarray  # int32, offset in ids of each fact's first token, ascending
    target_fact: int  # index into facts / fact_positions of the asked fact
    subjects: tuple[str, ...]  # subject of each fact ("blue box"), in position order
    codes: tuple[str, ...]  # code of each fact, in position order
    filler_tokens: int  # how many of ids are filler (the rest is fixed by the seed)
    noun: str = DEFAULT_NOUN  # what the facts call the number: "the code of the blue box"


@dataclass(frozen=True)
class _TokenTables:
    """What the task needs to know of a tokenizer's vocabulary."""

    digit_ids: np.ndarray  # [10] token id of "0".."9"
    ends_sentence: np.ndarray  # bool [V], the token's text ends with . ! ? or a newline
    starts_space: np.ndarray  # bool [V], the token's text starts with whitespace


@dataclass(frozen=True)
class _Filler:
    """One split's tokenized filler stream and its sentence boundaries."""

    ids: np.ndarray  # int32 [N], the split's token ids
    boundary: np.ndarray  # bool [N], True where a fact may be inserted before ids[i]


def train_seed(step: int) -> int:
    """Seed of training sample/batch ``step``; never equal to an evaluation seed."""
    return TRAIN_SEED_BASE + _check_seed_index(step)


def eval_seed(index: int) -> int:
    """Seed of held-out evaluation sample/batch ``index``; never equal to a training seed."""
    return EVAL_SEED_BASE + _check_seed_index(index)


def _check_seed_index(index: int) -> int:
    """Validate a seed index against :data:`SEED_SPACE`."""
    if not 0 <= index < SEED_SPACE:
        raise ValueError(f"seed index must be in [0, {SEED_SPACE}), got {index}")
    return index


def fact_head_text(subject: str, noun: str = DEFAULT_NOUN) -> str:
    """A fact's text up to its code: ``" The code of the blue box is "`` (its last tokens: " is", " ")."""
    return f" The {noun} of the {subject} is "


def question_text(subject: str, noun: str = DEFAULT_NOUN) -> str:
    """The question asking for the code of ``subject``; it ends right before the code."""
    return f"\nWhat is the {noun} of the {subject}? The {noun} of the {subject} is "


def follow_up_ids(sample: HaystackSample, fact: int, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Tokens that continue a sample after an answer with one more question, about ``facts[fact]``:
    ``"." + question`` (int32 ``[Q]``), and that fact's code digits (int32 ``[CODE_DIGITS]``)."""
    question = question_text(sample.subjects[fact], sample.noun)
    ids = np.concatenate([_encode(tokenizer, "."), _encode(tokenizer, question)])
    return ids, _code_ids(tokenizer, sample.codes[fact])


def _code_ids(tokenizer: Tokenizer, code: str) -> np.ndarray:
    """Token ids `[CODE_DIGITS]` of a code's digits ("4711")."""
    return _token_tables(tokenizer).digit_ids[[int(d) for d in code]]


def _encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Token ids of ``text`` without special tokens."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)


@functools.cache
def _token_tables(tokenizer: Tokenizer) -> _TokenTables:
    """The digit tokens and per-token sentence-end / leading-space flags (cached per tokenizer)."""
    digit_ids = _encode(tokenizer, "0123456789")
    if [tokenizer.decode([int(i)]) for i in digit_ids] != list("0123456789"):
        raise ValueError("the tokenizer must encode each digit as a single token")
    pieces = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())])
    return _TokenTables(
        digit_ids=digit_ids,
        ends_sentence=np.array([p.endswith((".", "!", "?", "\n")) for p in pieces]),
        starts_space=np.array([p[:1].isspace() for p in pieces]),
    )


@functools.cache
def _filler_stream(tokenizer: Tokenizer, filler_split: str) -> _Filler:
    """Tokenized filler of one split and its sentence boundaries (cached per tokenizer and split)."""
    tables = _token_tables(tokenizer)
    ids = encode_corpus(filler_split, tokenizer)
    boundary = np.ones(ids.size, dtype=bool)
    boundary[1:] = (tables.ends_sentence[ids[:-1]] & tables.starts_space[ids[1:]]) | (ids[:-1] == EOS_ID)
    return _Filler(ids=ids, boundary=boundary)


def _filler(rng: np.random.Generator, stream: _Filler, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` filler tokens from random contiguous spans (several if n exceeds the split)."""
    spans, masks, left = [], [], n
    while left > 0:
        size = min(left, stream.ids.size)
        start = int(rng.integers(0, stream.ids.size - size + 1))
        spans.append(stream.ids[start : start + size])
        masks.append(stream.boundary[start : start + size])
        left -= size
    if not spans:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool)
    mask = np.concatenate(masks)
    mask[0] = True
    return np.concatenate(spans), mask


def _insertion_points(
    rng: np.random.Generator, mask: np.ndarray, num_facts: int, target_depth: float | None
) -> tuple[np.ndarray, int]:
    """Ascending filler offsets for the facts and the index of the asked fact among them."""
    candidates = np.flatnonzero(np.append(mask, True))  # the filler's end is a boundary too
    if candidates.size < num_facts:  # too little filler: any offset, facts may touch
        candidates = np.arange(mask.size + 1)
    replace = candidates.size < num_facts
    if target_depth is None:
        points = np.sort(rng.choice(candidates, size=num_facts, replace=replace))
        return points, int(rng.integers(num_facts))
    target = candidates[np.argmin(np.abs(candidates - target_depth * mask.size))]
    others = candidates if replace else candidates[candidates != target]
    points = np.sort(np.append(rng.choice(others, size=num_facts - 1, replace=replace), target))
    return points, int(np.searchsorted(points, target))


def _subject_pairs(rng: np.random.Generator, num_facts: int, shared_word: bool) -> np.ndarray:
    """Distinct (colour, object) pair indices of a sample's subjects; the first is the asked one.
    With ``shared_word`` every other subject shares the asked one's colour or object."""
    n_pairs = len(COLOURS) * len(OBJECTS)
    if not shared_word:
        return rng.choice(n_pairs, size=num_facts, replace=False)
    asked = int(rng.integers(n_pairs))
    colour, obj = divmod(asked, len(OBJECTS))
    sharing = [
        p for p in range(n_pairs) if p != asked and (p // len(OBJECTS) == colour or p % len(OBJECTS) == obj)
    ]
    return np.array([asked, *rng.choice(sharing, size=num_facts - 1, replace=False)], dtype=np.int64)


def make_sample(
    rng_or_seed: int | np.random.Generator,
    length_tokens: int,
    tokenizer: Tokenizer,
    num_facts: int = 4,
    target_depth: float | None = None,
    shared_word: bool = False,
    filler_split: str = FILLER_SPLIT,
    noun: str = DEFAULT_NOUN,
) -> HaystackSample:
    """A retrieval prompt of exactly ``length_tokens`` tokens (same seed -> same sample).

    ``target_depth`` in [0, 1] puts the asked fact at the sentence boundary nearest that
    relative depth of the filler; by default all fact depths are uniformly random.
    ``shared_word`` makes every other fact a near miss: its subject shares the asked subject's
    colour or object ("blue box" among "blue jar", "red box"); by default subjects are random.
    ``filler_split`` names the corpus split the filler comes from; the facts, codes and question
    depend on the seed alone. ``noun`` is what the facts and question call the code ("secret number").
    """
    most = MAX_SHARED_WORD_FACTS if shared_word else len(COLOURS) * len(OBJECTS)
    if not 1 <= num_facts <= most:
        raise ValueError(
            f"num_facts must be in [1, {most}]{' with shared_word' if shared_word else ''}, got {num_facts}"
        )
    if target_depth is not None and not 0.0 <= target_depth <= 1.0:
        raise ValueError(f"target_depth must be in [0, 1], got {target_depth}")
    check_noun(noun)
    rng = np.random.default_rng(rng_or_seed)
    stream = _filler_stream(tokenizer, filler_split)

    # Fact 0 is the asked one; the pairs are random, so this is no bias.
    pairs = _subject_pairs(rng, num_facts, shared_word)
    subjects = [f"{COLOURS[p // len(OBJECTS)]} {OBJECTS[p % len(OBJECTS)]}" for p in pairs]
    codes = ["".join(map(str, rng.integers(0, 10, size=CODE_DIGITS))) for _ in subjects]
    period = _encode(tokenizer, ".")
    fact_ids = [
        np.concatenate([_encode(tokenizer, fact_head_text(s, noun)), _code_ids(tokenizer, c), period])
        for s, c in zip(subjects, codes)
    ]
    facts = [f"{fact_head_text(s, noun)}{c}." for s, c in zip(subjects, codes)]
    question = question_text(subjects[0], noun)
    question_ids = _encode(tokenizer, question)

    filler_size = length_tokens - 1 - sum(f.size for f in fact_ids) - question_ids.size
    if filler_size < 0:
        raise ValueError(
            f"length_tokens={length_tokens} is too small: <bos>, {num_facts} facts "
            f"and the question take {length_tokens - filler_size} tokens here"
        )
    filler, mask = _filler(rng, stream, filler_size)
    points, target = _insertion_points(rng, mask, num_facts, target_depth)
    order = [*range(1, target + 1), 0, *range(target + 1, num_facts)]

    parts, positions, prev, offset = [np.array([BOS_ID], dtype=np.int32)], [], 0, 1
    for point, k in zip(points, order):
        parts += [filler[prev:point], fact_ids[k]]
        offset += point - prev
        positions.append(offset)
        offset += fact_ids[k].size
        prev = point
    parts += [filler[prev:], question_ids]
    return HaystackSample(
        ids=np.concatenate(parts),
        answer_ids=_code_ids(tokenizer, codes[0]),
        answer=codes[0],
        question=question,
        facts=tuple(facts[k] for k in order),
        fact_positions=np.array(positions, dtype=np.int32),
        target_fact=target,
        subjects=tuple(subjects[k] for k in order),
        codes=tuple(codes[k] for k in order),
        filler_tokens=int(filler_size),
        noun=noun,
    )


def check_noun(noun: str) -> None:
    """A noun for facts: words of letters and single spaces ("code", "secret number")."""
    if not isinstance(noun, str) or not all(w.isalpha() for w in noun.split(" ")):
        raise ValueError(f"noun must be words of letters separated by single spaces, got {noun!r}")


def code_offset(sample: HaystackSample, fact: int, tokenizer: Tokenizer) -> int:
    """Offset of ``facts[fact]``'s first code digit from the fact's first token."""
    return _encode(tokenizer, fact_head_text(sample.subjects[fact], sample.noun)).size


def asked_code_start(sample: HaystackSample, tokenizer: Tokenizer) -> int:
    """Position of the asked fact's first code digit in ``sample.ids``."""
    asked = sample.target_fact
    return int(sample.fact_positions[asked]) + code_offset(sample, asked, tokenizer)


def code_split_span(code_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions where a segment start separates a fact's subject from its code's last digit, for
    codes whose first digit is at ``code_start`` (any shape): from the token after the subject (" is",
    :data:`TOKENS_BEFORE_CODE` before the code) to the code's last digit ("... blue box is 47" | "11.").
    Returns the first and last such position."""
    code_start = np.asarray(code_start)
    return code_start - TOKENS_BEFORE_CODE, code_start + CODE_DIGITS - 1


def code_split_by_boundary(code_start: np.ndarray, segment_size: int) -> np.ndarray:
    """Whether a boundary of the fixed ``segment_size`` grid falls in the :func:`code_split_span` of codes
    starting at ``code_start`` (any shape)."""
    first, last = code_split_span(code_start)
    return last // segment_size * segment_size >= first


def code_split_by_starts(code_start: np.ndarray, starts: list[np.ndarray]) -> np.ndarray:
    """Whether one of row b's segment ``starts[b]`` falls in the :func:`code_split_span` of its code
    starting at ``code_start [B]``: any cut, sentence segments as well as the grid."""
    spans = zip(starts, *code_split_span(code_start))
    return np.array([np.any((s >= first) & (s <= last)) for s, first, last in spans], bool)


def shift_facts_earlier(
    sample: HaystackSample,
    shift: int,
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    filler_split: str = FILLER_SPLIT,
) -> HaystackSample:
    """The sample with every fact ``shift`` tokens earlier and the same length: ``shift`` filler
    tokens after ``<bos>`` are dropped and as many new ones (a random span of ``filler_split``) go
    right before the question. ``shift`` must not exceed the filler ahead of the first fact."""
    ahead = int(sample.fact_positions[0]) - 1
    if not 0 <= shift <= ahead:
        raise ValueError(f"shift must be in [0, {ahead}] (the filler ahead of the first fact), got {shift}")
    question = _encode(tokenizer, sample.question).size
    extra, _ = _filler(rng, _filler_stream(tokenizer, filler_split), shift)
    ids = np.concatenate(
        [
            sample.ids[:1],
            sample.ids[1 + shift : sample.ids.size - question],
            extra,
            sample.ids[sample.ids.size - question :],
        ]
    )
    return replace(sample, ids=ids, fact_positions=sample.fact_positions - shift)


def split_asked_fact(
    sample: HaystackSample,
    offset: int,
    segment_size: int,
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    filler_split: str = FILLER_SPLIT,
) -> HaystackSample | None:
    """The sample shifted earlier so that a segment starts ``offset`` tokens into the asked fact's code
    (``offset`` in ``[-TOKENS_BEFORE_CODE, CODE_DIGITS)``: from " is" to the last digit, every case
    :func:`code_split_by_boundary` counts), or None where the filler ahead of the first fact is shorter
    than that shift. The new filler before the question is a random span of ``filler_split``."""
    if not -TOKENS_BEFORE_CODE <= offset < CODE_DIGITS:
        raise ValueError(f"offset must be in [{-TOKENS_BEFORE_CODE}, {CODE_DIGITS}), got {offset}")
    shift = (asked_code_start(sample, tokenizer) + offset) % segment_size
    if shift >= sample.fact_positions[0]:
        return None
    return shift_facts_earlier(sample, shift, tokenizer, rng, filler_split)


def make_batch(
    seed: int,
    batch: int,
    length_tokens: int,
    tokenizer: Tokenizer,
    num_facts: int = 4,
    target_depth: float | None = None,
    shared_word: bool = False,
    filler_split: str = FILLER_SPLIT,
) -> dict[str, np.ndarray]:
    """Stacked samples; sample i is ``make_sample(np.random.default_rng([seed, i]), ...)``.

    Besides the prompt (``ids``), answer, fact offsets and asked fact's index, it holds every fact's
    code digits in position order (``fact_answer_ids`` ``[B, F, CODE_DIGITS]``), whether the asked
    subject shares a word with another fact's (``shares_word`` ``[B]``) and the offset of the asked
    code's first digit (``code_start`` ``[B]``).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    samples = [
        make_sample(
            np.random.default_rng([seed, i]),
            length_tokens,
            tokenizer,
            num_facts=num_facts,
            target_depth=target_depth,
            shared_word=shared_word,
            filler_split=filler_split,
        )
        for i in range(batch)
    ]
    return _stack(samples, tokenizer)


def held_out_batch(
    indices: range,
    length_tokens: int,
    tokenizer: Tokenizer,
    num_facts: int = 4,
    shared_word: bool = False,
    filler_split: str = FILLER_SPLIT,
    split_segment: int | None = None,
    target_depth: float | None = None,
) -> dict[str, np.ndarray]:
    """Held-out evaluation samples ``indices``, stacked as :func:`make_batch` stacks them.

    Sample i is ``make_batch(eval_seed(i), 1, ...)``'s one sample whatever batch it is drawn in, so
    every evaluation with the same sample count scores the same prompts, at any batch size.
    ``target_depth`` places each asked fact at that relative depth (:func:`make_sample`); the same
    index then keeps its filler, subjects and codes at every depth, so depths compare sample by sample.
    With ``split_segment``, sample i is instead that sample after :func:`split_asked_fact` at a random
    offset (segments of ``split_segment`` tokens): a boundary always separates its asked subject from
    its code's last digit. Where its asked fact lies too early to shift, sample i is drawn again from
    another seed with the asked fact at mid depth.
    """
    if not len(indices):
        raise ValueError("indices must not be empty")
    if split_segment is not None and target_depth is not None:
        raise ValueError(
            "split_segment shifts the asked fact, so it cannot keep a target_depth: give one of them"
        )
    make = functools.partial(
        make_sample,
        length_tokens=length_tokens,
        tokenizer=tokenizer,
        num_facts=num_facts,
        shared_word=shared_word,
        filler_split=filler_split,
        target_depth=target_depth,
    )
    samples = [make(np.random.default_rng([eval_seed(i), 0])) for i in indices]
    if split_segment is not None:
        samples = [
            _held_out_split(s, i, split_segment, make, tokenizer, filler_split)
            for s, i in zip(samples, indices)
        ]
    return _stack(samples, tokenizer)


def _held_out_split(
    sample: HaystackSample,
    index: int,
    segment_size: int,
    make: functools.partial,
    tokenizer: Tokenizer,
    filler_split: str,
) -> HaystackSample:
    """Held-out sample ``index`` split by a segment boundary (see :func:`held_out_batch`)."""
    rng = np.random.default_rng([eval_seed(index), 1])
    offset = int(rng.integers(-TOKENS_BEFORE_CODE, CODE_DIGITS))
    split = split_asked_fact(sample, offset, segment_size, tokenizer, rng, filler_split)
    if split is None:
        split = split_asked_fact(
            make(np.random.default_rng([eval_seed(index), 2]), target_depth=0.5),
            offset,
            segment_size,
            tokenizer,
            rng,
            filler_split,
        )
    if split is None:
        raise ValueError(
            f"a sample of {sample.ids.size} tokens is too short to split at a boundary of "
            f"{segment_size}-token segments"
        )
    return split


def _stack(samples: list[HaystackSample], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """Samples as arrays with a leading batch axis, plus every fact's code ids and near-miss flag."""
    return {
        "ids": np.stack([s.ids for s in samples]),
        "answer_ids": np.stack([s.answer_ids for s in samples]),
        "fact_positions": np.stack([s.fact_positions for s in samples]),
        "target_fact": np.array([s.target_fact for s in samples], dtype=np.int32),
        "fact_answer_ids": np.stack([[_code_ids(tokenizer, c) for c in s.codes] for s in samples]),
        "shares_word": np.array([shares_word(s) for s in samples]),
        "code_start": np.array([asked_code_start(s, tokenizer) for s in samples], dtype=np.int32),
    }


def shares_word(sample: HaystackSample) -> bool:
    """Whether another fact's subject has the asked subject's colour or object ("blue box", "blue jar")."""
    asked = set(sample.subjects[sample.target_fact].split())
    return any(asked & set(s.split()) for k, s in enumerate(sample.subjects) if k != sample.target_fact)


# --- chat form: the haystack as a user turn, the answer as the assistant's --------------------------
_DOCUMENT = "\x00document\x00"  # stands for the document while the chat template renders


@dataclass(frozen=True)
class ChatFrame:
    """A chat template's frame around a haystack: the document and its question are the user's turn,
    the answer ("The code of the blue box is 4711") the assistant's, so the digits are supervised
    where a chat model answers."""

    head: np.ndarray  # int32, the template's tokens before the user's text (system turn, user turn start)
    tail: np.ndarray  # int32, its tokens after the user's text, up to the assistant's first token
    document_break: int  # the token that separates corpus documents ("\n\n") inside the user's text
    overhead: int  # most tokens a chat prompt has beyond its plain sample (over all subjects)


def chat_question_text(subject: str, noun: str = DEFAULT_NOUN) -> str:
    """The user's question about ``subject`` (after the document)."""
    return f"\nWhat is the {noun} of the {subject}?"


def answer_prefix_text(subject: str, noun: str = DEFAULT_NOUN) -> str:
    """The assistant's words before the code digits; it ends as a fact's text does (" is ")."""
    return f"The {noun} of the {subject} is "


def chat_frame(tokenizer: Any, noun: str = DEFAULT_NOUN) -> ChatFrame:
    """The frame of ``tokenizer``'s chat template (a `ChatTokenizer`) around facts that say ``noun``; a
    ValueError when it has none or "\\n\\n" is not one token."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat haystacks need a tokenizer with a chat template (the model's own)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _DOCUMENT}], add_generation_prompt=True)
    before, found, after = text.partition(_DOCUMENT)
    if not found:
        raise ValueError("the chat template does not keep the user's text as it is")
    document_break = _encode(tokenizer, "\n\n")
    if document_break.size != 1:
        raise ValueError(f'the tokenizer encodes "\\n\\n" as {document_break.size} tokens, not one')
    head, tail = _encode(tokenizer, before), _encode(tokenizer, after)
    extra = max(
        _encode(tokenizer, chat_question_text(s, noun)).size
        + _encode(tokenizer, answer_prefix_text(s, noun)).size
        - _encode(tokenizer, question_text(s, noun)).size
        for s in (f"{c} {o}" for c in COLOURS for o in OBJECTS)
    )
    return ChatFrame(head, tail, int(document_break[0]), head.size + tail.size - 1 + extra)


def chat_prompt(sample: HaystackSample, frame: ChatFrame, tokenizer: Any) -> np.ndarray:
    """The chat prompt (int32 ``[P]``, at most ``sample.ids.size + frame.overhead`` tokens) of a plain
    sample: its document (without ``<bos>``, documents separated by ``frame.document_break``) and the
    question as the user's turn, then the assistant's turn up to the code's first digit."""
    subject = sample.subjects[sample.target_fact]
    document = sample.ids[1 : sample.ids.size - _encode(tokenizer, sample.question).size]
    document = np.where(document == EOS_ID, frame.document_break, document).astype(np.int32)
    return np.concatenate(
        [
            frame.head,
            document,
            _encode(tokenizer, chat_question_text(subject, sample.noun)),
            frame.tail,
            _encode(tokenizer, answer_prefix_text(subject, sample.noun)),
        ]
    )
