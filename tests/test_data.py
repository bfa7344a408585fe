"""Tests of the data side: corpus splits, tokenizer asset, haystack retrieval samples."""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np
import pytest

from jaxlongctx.data import corpus, haystack, tokenizer
from jaxlongctx.data.corpus import SPLITS, load_corpus
from jaxlongctx.data.haystack import CODE_DIGITS, make_batch, make_sample
from jaxlongctx.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, load_default_tokenizer

MANIFEST = json.loads(tokenizer.MANIFEST_PATH.read_text(encoding="utf-8"))
same_python = pytest.mark.skipif(
    sys.version.split()[0] != MANIFEST["python_version"],
    reason=f"assets were built with Python {MANIFEST['python_version']}",
)


@pytest.fixture(scope="module")
def tok():
    return load_default_tokenizer()


# ----------------------------------------------------------------------------- corpus


def test_modules_list_is_sorted_and_unique():
    assert list(corpus.MODULES) == sorted(set(corpus.MODULES))


def test_splits_are_disjoint_and_nonempty():
    docs = load_corpus()
    ids = corpus.document_identities()
    assert set(docs) == set(SPLITS)
    for split in SPLITS:
        assert docs[split] and len(docs[split]) == len(ids[split])
        assert all(corpus.split_of(identity) == split for identity in ids[split])
    for a, b in [("train", "validation"), ("train", "calibration"), ("validation", "calibration")]:
        assert not set(docs[a]) & set(docs[b])
        assert not set(ids[a]) & set(ids[b])


def test_corpus_is_cached_and_a_copy():
    first = load_corpus()
    first["train"].clear()
    assert load_corpus()["train"]


def test_documents_are_normalised():
    for doc in load_corpus()["validation"]:
        assert doc == doc.strip() and "\t" not in doc and "\n\n\n" not in doc
        assert all(line == line.rstrip() for line in doc.splitlines())


def test_split_by_hash_is_stable():
    # sha1("json.dumps") % 100 etc. never changes: the rule is the contract, not the corpus.
    for identity in ["json.dumps", "pydoc_data.topics:if", "typing.TypeVar"]:
        bucket = int(hashlib.sha1(identity.encode()).hexdigest(), 16) % 100
        expected = "train" if bucket < 90 else "validation" if bucket < 95 else "calibration"
        assert corpus.split_of(identity) == expected


@same_python
def test_corpus_matches_manifest():
    stats = corpus.corpus_stats()
    assert stats["modules"] == MANIFEST["modules"]
    for split in SPLITS:
        assert corpus.split_sha1(split) == MANIFEST["splits"][split]["sha1"]
        assert stats["splits"][split]["characters"] == MANIFEST["splits"][split]["characters"]


def test_split_sha1_rejects_unknown_split():
    with pytest.raises(ValueError, match="unknown split"):
        corpus.split_sha1("test")


# -------------------------------------------------------------------------- tokenizer


def test_special_tokens_and_vocab(tok):
    assert tok.get_vocab_size() == 4096
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [PAD_ID, BOS_ID, EOS_ID]


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n\treturn x ** 2  # trailing  ",
        "naïve café, Straße, 東京, Ωμέγα, emoji 🤖🎉, zero\u200bwidth, \r\n crlf",
        "The code of the blue box is 0471.",
    ],
)
def test_tokenizer_round_trips(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_digits_are_single_tokens(tok):
    enc = tok.encode(" is 4711 and 000099", add_special_tokens=False)
    assert enc.tokens[1:6] == ["Ġ", "4", "7", "1", "1"]
    assert enc.tokens[-6:] == list("000099")


@same_python
def test_retraining_reproduces_the_asset():
    retrained = tokenizer.train_tokenizer(load_corpus()["train"])
    assert retrained.to_str(pretty=True) == tokenizer.TOKENIZER_PATH.read_text(encoding="utf-8")


def test_train_tokenizer_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer.train_tokenizer(["abc"], vocab_size=100)


def test_encode_corpus(tok):
    ids = tokenizer.encode_corpus("validation")
    assert ids.dtype == np.int32 and not ids.flags.writeable
    assert ids is tokenizer.encode_corpus("validation")
    docs = load_corpus()["validation"]
    assert int((ids == EOS_ID).sum()) == len(docs) - 1
    first = ids[: int(np.argmax(ids == EOS_ID))]
    assert tok.decode(first.tolist()) == docs[0]
    with pytest.raises(ValueError, match="unknown split"):
        tokenizer.encode_corpus("test")


# --------------------------------------------------------------------------- haystack


def _check_sample(sample: haystack.HaystackSample, tok, length: int, num_facts: int) -> None:
    """Exact length, facts decodable at their positions, answer right after the prompt."""
    assert sample.ids.dtype == np.int32 and sample.ids.shape == (length,)
    assert sample.ids[0] == BOS_ID
    assert len(sample.facts) == len(sample.fact_positions) == num_facts
    assert np.all(np.diff(sample.fact_positions) >= 0)
    for fact, pos in zip(sample.facts, sample.fact_positions):
        n = len(tok.encode(fact, add_special_tokens=False).ids)
        assert tok.decode(sample.ids[pos : pos + n].tolist()) == fact
    assert sample.facts == tuple(
        f" The code of the {s} is {c}." for s, c in zip(sample.subjects, sample.codes)
    )
    fixed = 1 + sum(
        len(tok.encode(text, add_special_tokens=False).ids) for text in (*sample.facts, sample.question)
    )
    assert sample.filler_tokens == length - fixed
    target = sample.facts[sample.target_fact]
    assert target.endswith(f" is {sample.answer}.")
    subject = target.removeprefix(" The code of the ").split(" is ")[0]
    assert sample.question == (f"\nWhat is the code of the {subject}? The code of the {subject} is ")
    q = len(tok.encode(sample.question, add_special_tokens=False).ids)
    assert tok.decode(sample.ids[-q:].tolist()) == sample.question
    assert sample.answer_ids.shape == (CODE_DIGITS,)
    assert tok.decode(sample.answer_ids.tolist()) == sample.answer
    # The answer tokens inside the target fact are exactly the tokens to predict.
    prefix = len(tok.encode(target.split(" is ")[0] + " is ", add_special_tokens=False).ids)
    start = sample.fact_positions[sample.target_fact] + prefix
    np.testing.assert_array_equal(sample.ids[start : start + CODE_DIGITS], sample.answer_ids)
    # Re-tokenizing the fact on its own gives the spliced tokens.
    fact_ids = tok.encode(target, add_special_tokens=False).ids
    pos = sample.fact_positions[sample.target_fact]
    assert sample.ids[pos : pos + len(fact_ids)].tolist() == fact_ids


@pytest.mark.parametrize("length,num_facts", [(512, 4), (1000, 1), (4096, 8), (2048, 16)])
def test_sample_structure(tok, length, num_facts):
    for seed in range(3):
        _check_sample(make_sample(seed, length, tok, num_facts=num_facts), tok, length, num_facts)


def test_noun_renames_facts_and_question_and_keeps_the_codes(tok):
    plain = make_sample(5, 1024, tok, num_facts=3)
    named = make_sample(5, 1024, tok, num_facts=3, noun="secret number")
    assert (named.subjects, named.codes, named.answer) == (plain.subjects, plain.codes, plain.answer)
    assert named.ids.size == 1024 and named.noun == "secret number" and plain.noun == "code"
    assert named.facts == tuple(
        f" The secret number of the {s} is {c}." for s, c in zip(named.subjects, named.codes)
    )
    subject = named.subjects[named.target_fact]
    assert (
        named.question
        == f"\nWhat is the secret number of the {subject}? The secret number of the {subject} is "
    )
    for fact in range(3):
        start = int(named.fact_positions[fact]) + haystack.code_offset(named, fact, tok)
        assert tok.decode(named.ids[start : start + CODE_DIGITS].tolist()) == named.codes[fact]
    for bad in ("", "secret  number", "code 7", "secret\nnumber"):
        with pytest.raises(ValueError, match="noun"):
            make_sample(5, 1024, tok, noun=bad)


def test_sample_is_deterministic(tok):
    a, b = make_sample(7, 2048, tok), make_sample(np.random.default_rng(7), 2048, tok)
    np.testing.assert_array_equal(a.ids, b.ids)
    assert (a.facts, a.target_fact, a.answer) == (b.facts, b.target_fact, b.answer)
    assert not np.array_equal(a.ids, make_sample(8, 2048, tok).ids)


def test_subjects_unique_within_sample(tok):
    sample = make_sample(3, 4096, tok, num_facts=30)
    subjects = [f.split(" is ")[0] for f in sample.facts]
    assert len(set(subjects)) == 30


def test_shared_word_samples_are_near_misses(tok):
    colours, objects = [], []
    for seed in range(20):
        sample = make_sample(seed, 1024, tok, shared_word=True)
        _check_sample(sample, tok, 1024, 4)
        asked = sample.subjects[sample.target_fact].split()
        others = [s.split() for k, s in enumerate(sample.subjects) if k != sample.target_fact]
        assert all(o[0] == asked[0] or o[1] == asked[1] for o in others) and haystack.shares_word(sample)
        colours.append(asked[0])
        objects.append(asked[1])
    assert len(set(colours)) > 4 and len(set(objects)) > 4  # the asked subject itself stays random
    most = haystack.MAX_SHARED_WORD_FACTS
    full = make_sample(4, 4096, tok, num_facts=most, shared_word=True)
    asked = full.subjects[full.target_fact].split()
    assert len(set(full.subjects)) == most and all(
        asked[0] in s.split() or asked[1] in s.split() for s in full.subjects
    )
    again = make_sample(4, 4096, tok, num_facts=most, shared_word=True)
    assert again.subjects == full.subjects and np.array_equal(again.ids, full.ids)
    with pytest.raises(ValueError, match="with shared_word"):
        make_sample(0, 4096, tok, num_facts=most + 1, shared_word=True)
    batch = make_batch(haystack.eval_seed(0), 6, 512, tok, shared_word=True)
    assert batch["shares_word"].all()


def test_facts_at_different_depths(tok):
    depths = []
    for seed in range(40):
        s = make_sample(seed, 4096, tok)
        depths.append(s.fact_positions[s.target_fact] / 4096)
    assert min(depths) < 0.2 and max(depths) > 0.8
    for depth in (0.0, 0.5, 1.0):
        s = make_sample(1, 8192, tok, target_depth=depth)
        _check_sample(s, tok, 8192, 4)
        assert abs(s.fact_positions[s.target_fact] / 8192 - depth) < 0.1


def test_code_offset_and_split_by_boundary(tok):
    sample = make_sample(4, 2048, tok, num_facts=3)
    batch = make_batch(4, 1, 2048, tok, num_facts=3)
    for fact in range(len(sample.facts)):
        start = int(sample.fact_positions[fact]) + haystack.code_offset(sample, fact, tok)
        assert tok.decode(sample.ids[start : start + CODE_DIGITS].tolist()) == sample.codes[fact]
        head = tok.decode(sample.ids[sample.fact_positions[fact] : start].tolist())
        assert head.strip() == f"The code of the {sample.subjects[fact]} is"
    asked = make_sample(np.random.default_rng([4, 0]), 2048, tok, num_facts=3)
    assert batch["code_start"][0] == asked.fact_positions[asked.target_fact] + haystack.code_offset(
        asked, asked.target_fact, tok
    )
    # segments of 8: the boundary at 16 splits codes starting at 13..18 (from " is" at 16 to the last digit at 16)
    split = haystack.code_split_by_boundary(np.arange(11, 21), 8)
    assert np.flatnonzero(split).tolist() == [2, 3, 4, 5, 6, 7] and split.shape == (10,)
    # any cut: the grid's starts give the same split; a start at 15 splits only codes from 12 (last digit at
    # 15) to 17 (" is" at 15)
    grid = [np.arange(0, 24, 8)] * 10
    assert (haystack.code_split_by_starts(np.arange(11, 21), grid) == split).all()
    moved = haystack.code_split_by_starts(np.arange(11, 21), [np.array([0, 15])] * 10)
    assert np.flatnonzero(moved).tolist() == [1, 2, 3, 4, 5, 6]


def test_shift_facts_earlier_keeps_facts_and_length(tok):
    sample = make_sample(6, 4096, tok, num_facts=3)
    shift = int(sample.fact_positions[0]) - 1
    moved = haystack.shift_facts_earlier(sample, shift, tok, np.random.default_rng(0))
    _check_sample(moved, tok, 4096, 3)
    np.testing.assert_array_equal(moved.fact_positions, sample.fact_positions - shift)
    assert moved.fact_positions[0] == 1  # the first fact now follows <bos>
    question = len(tok.encode(sample.question, add_special_tokens=False).ids)
    np.testing.assert_array_equal(
        moved.ids[1 : -question - shift], sample.ids[1 + shift : -question]
    )  # same text, moved
    assert not np.array_equal(
        moved.ids[-question - shift : -question], sample.ids[1 : 1 + shift]
    )  # new filler
    assert (
        haystack.shift_facts_earlier(sample, 0, tok, np.random.default_rng(0)).ids.tolist()
        == sample.ids.tolist()
    )
    with pytest.raises(ValueError, match="shift"):
        haystack.shift_facts_earlier(sample, shift + 1, tok, np.random.default_rng(0))


def test_split_asked_fact_puts_a_boundary_inside_the_fact(tok):
    """Every offset from " is" to the last digit puts a segment start there, keeping the sample's text."""
    sample = make_sample(8, 2048, tok, num_facts=2)
    asked = sample.target_fact
    code_at = int(sample.fact_positions[asked]) + haystack.code_offset(sample, asked, tok)
    for offset in range(-haystack.TOKENS_BEFORE_CODE, haystack.CODE_DIGITS):
        split = haystack.split_asked_fact(sample, offset, 16, tok, np.random.default_rng(offset + 2))
        _check_sample(split, tok, 2048, 2)
        moved_code = int(split.fact_positions[asked]) + haystack.code_offset(split, asked, tok)
        assert (moved_code + offset) % 16 == 0 and haystack.code_split_by_boundary(np.array(moved_code), 16)
        assert 0 <= code_at - moved_code < 16
    first = haystack.shift_facts_earlier(
        sample, int(sample.fact_positions[0]) - 1, tok, np.random.default_rng(0)
    )
    code_at = int(first.fact_positions[asked]) + haystack.code_offset(first, asked, tok)
    offset = next(o for o in range(-haystack.TOKENS_BEFORE_CODE, haystack.CODE_DIGITS) if (code_at + o) % 16)
    assert (
        haystack.split_asked_fact(first, offset, 16, tok, np.random.default_rng(0)) is None
    )  # no filler ahead
    with pytest.raises(ValueError, match="offset"):
        haystack.split_asked_fact(sample, haystack.CODE_DIGITS, 16, tok, np.random.default_rng(0))


def test_held_out_split_batch_splits_every_asked_fact(tok):
    """split_segment: every held-out sample has a boundary inside its asked fact, even those whose fact lay
    too early to shift (drawn again), and sample i stays the same in any batch."""
    plain = haystack.held_out_batch(range(12), 512, tok, num_facts=1)
    whole = haystack.held_out_batch(range(12), 512, tok, num_facts=1, split_segment=128)
    redrawn = (whole["answer_ids"] != plain["answer_ids"]).any(axis=1)  # asked fact too early to shift
    assert 0 < redrawn.sum() < 12
    assert haystack.code_split_by_boundary(whole["code_start"], 128).all() and whole["ids"].shape == (12, 512)
    parts = [
        haystack.held_out_batch(r, 512, tok, num_facts=1, split_segment=128) for r in (range(5), range(5, 12))
    ]
    for key, value in whole.items():
        np.testing.assert_array_equal(value, np.concatenate([p[key] for p in parts]))
    with pytest.raises(ValueError, match="too short"):
        haystack.held_out_batch(range(1), 40, tok, num_facts=1, split_segment=128)


def test_minimum_length(tok):
    # Facts and question depend only on the seed, so zero filler is reachable exactly.
    probe = make_sample(5, 512, tok)
    overhead = 1 + sum(
        len(tok.encode(text, add_special_tokens=False).ids) for text in (*probe.facts, probe.question)
    )
    _check_sample(make_sample(5, overhead, tok), tok, overhead, 4)
    with pytest.raises(ValueError, match="too small"):
        make_sample(5, overhead - 1, tok)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_facts": 0}, "num_facts"),
        ({"num_facts": 1000}, "num_facts"),
        ({"target_depth": 1.5}, "target_depth"),
        ({"length_tokens": 30}, "too small"),
    ],
)
def test_bad_arguments(tok, kwargs, match):
    args = {"length_tokens": 512} | kwargs
    with pytest.raises(ValueError, match=match):
        make_sample(0, tokenizer=tok, **args)


def test_64k_sample_is_fast(tok):
    make_sample(0, 1024, tok)  # warm the per-tokenizer caches
    start = time.perf_counter()
    sample = make_sample(11, 65536, tok, num_facts=8)
    assert time.perf_counter() - start < 0.5
    _check_sample(sample, tok, 65536, 8)


def test_batch(tok):
    batch = make_batch(haystack.train_seed(3), 4, 1024, tok)
    assert batch["ids"].shape == (4, 1024) and batch["ids"].dtype == np.int32
    assert batch["answer_ids"].shape == (4, CODE_DIGITS)
    assert batch["fact_positions"].shape == (4, 4) and batch["target_fact"].shape == (4,)
    single = make_sample(np.random.default_rng([3, 2]), 1024, tok)
    np.testing.assert_array_equal(batch["ids"][2], single.ids)
    assert batch["fact_answer_ids"].shape == (4, 4, CODE_DIGITS)
    np.testing.assert_array_equal(batch["fact_answer_ids"][2, single.target_fact], single.answer_ids)
    assert [tok.decode(list(map(int, code))) for code in batch["fact_answer_ids"][2]] == list(single.codes)
    subjects = [s.split() for s in single.subjects]
    asked = subjects[single.target_fact]
    expected = any(w in asked for k, other in enumerate(subjects) if k != single.target_fact for w in other)
    assert batch["shares_word"][2] == expected
    again = make_batch(3, 4, 1024, tok)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)
    with pytest.raises(ValueError, match="batch"):
        make_batch(0, 0, 1024, tok)


def _occurs_in(span: np.ndarray, tokens: np.ndarray) -> bool:
    """Whether `span` is a contiguous run of `tokens`."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens, span.size)
    return bool((windows == span).all(axis=1).any())


def test_filler_split_changes_the_filler_only(tok):
    val, train = make_sample(5, 2048, tok), make_sample(5, 2048, tok, filler_split="train")
    assert (val.codes, val.subjects, val.question) == (train.codes, train.subjects, train.question)
    first = lambda s: s.ids[1 : s.fact_positions[0]][:64]  # filler before the first fact
    assert first(val).size == first(train).size == 64
    assert _occurs_in(first(val), tokenizer.encode_corpus("validation", tok))
    assert _occurs_in(first(train), tokenizer.encode_corpus("train", tok))
    assert not _occurs_in(first(train), tokenizer.encode_corpus("validation", tok))
    batch = make_batch(3, 2, 1024, tok, filler_split="train")
    np.testing.assert_array_equal(
        batch["ids"][1], make_sample(np.random.default_rng([3, 1]), 1024, tok, filler_split="train").ids
    )
    with pytest.raises(ValueError, match="unknown split"):
        make_sample(0, 512, tok, filler_split="test")


def test_train_and_eval_seeds_are_disjoint(tok):
    assert haystack.train_seed(haystack.SEED_SPACE - 1) < haystack.eval_seed(0)
    assert haystack.eval_seed(0) == haystack.EVAL_SEED_BASE
    for bad in (-1, haystack.SEED_SPACE):
        with pytest.raises(ValueError, match="seed index"):
            haystack.train_seed(bad)
        with pytest.raises(ValueError, match="seed index"):
            haystack.eval_seed(bad)
    train = make_batch(haystack.train_seed(0), 2, 512, tok)
    held_out = make_batch(haystack.eval_seed(0), 2, 512, tok)
    assert not np.array_equal(train["ids"], held_out["ids"])


def test_held_out_sample_is_the_same_in_any_batch(tok):
    """Evaluation sample i does not depend on the batch it is drawn in (scores are batch-size free)."""
    whole = haystack.held_out_batch(range(5), 512, tok, num_facts=2)
    parts = [haystack.held_out_batch(r, 512, tok, num_facts=2) for r in (range(0, 2), range(2, 5))]
    one = make_batch(haystack.eval_seed(3), 1, 512, tok, num_facts=2)
    for key, value in whole.items():
        np.testing.assert_array_equal(value, np.concatenate([p[key] for p in parts]))
        np.testing.assert_array_equal(value[3:4], one[key])
    assert len(np.unique(whole["ids"], axis=0)) == 5
    with pytest.raises(ValueError, match="empty"):
        haystack.held_out_batch(range(0), 512, tok)


def test_held_out_samples_at_a_target_depth_keep_their_codes_and_move_the_asked_fact(tok):
    """`target_depth` moves only the facts: sample i keeps its subjects and codes, and its asked fact
    lands near that share of the prompt (at the filler's nearest sentence end: a long sentence-free
    stretch, such as a table, can move it by a few percent of a short prompt)."""
    near, far = (
        haystack.held_out_batch(range(6), 2048, tok, num_facts=3, target_depth=d) for d in (0.9, 0.1)
    )
    np.testing.assert_array_equal(near["answer_ids"], far["answer_ids"])
    np.testing.assert_array_equal(
        np.sort(near["fact_answer_ids"], axis=1), np.sort(far["fact_answer_ids"], axis=1)
    )
    for batch, depth in ((near, 0.9), (far, 0.1)):
        asked = batch["fact_positions"][np.arange(6), batch["target_fact"]] / 2048
        off = np.abs(asked - depth)
        assert np.median(off) < 0.03 and off.max() < 0.15, asked
    with pytest.raises(ValueError, match="target_depth"):
        haystack.held_out_batch(range(1), 512, tok, num_facts=1, split_segment=128, target_depth=0.5)
