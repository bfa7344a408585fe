"""Sentence-aligned segmentation: cut points, batched rows, schedules, generation, shipped tokenizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_armt_utils import NEWLINE, PERIOD, VOCAB, TinyTokenizer, make_armt

import jaxlongctx
from jaxlongctx import ARMTMemory, SamplingParams
from jaxlongctx.armt.generation import window_starts
from jaxlongctx.armt.segments import Segments, pad_segments, segment_at
from jaxlongctx.armt.sentences import SentenceSegmenter
from jaxlongctx.data.haystack import CODE_DIGITS, code_split_by_boundary, held_out_batch
from jaxlongctx.data.tokenizer import load_default_tokenizer
from jaxlongctx.demo import ARMT_MODEL
from jaxlongctx.loading import load
from jaxlongctx.train.armt_finetune import answer_logits, haystack_batch, retrieval_loss

RNG = np.random.default_rng(5)


def _sentence_armt():
    armt = make_armt(3, 8)  # segment size 8
    armt.tokenizer = TinyTokenizer()
    armt.segmentation = "sentences"
    return armt


def _text(sentence_lengths: list[int]) -> np.ndarray:
    """Sentences of the given lengths (the last token of each is ".", the next one starts with a space)."""
    out = []
    for n in sentence_lengths:
        words = RNG.integers(5, VOCAB, n - 1)
        words[0] |= 1  # starts with a space
        out += [*words, PERIOD]
    return np.asarray(out, np.int64)


def test_starts_keep_short_sentences_whole_and_cut_long_ones():
    seg = SentenceSegmenter(TinyTokenizer(), min_fill=0.5)
    row = _text([3, 4, 5, 6, 12, 3])  # 33 tokens; sentences end after 3, 7, 12, 18, 30, 33
    starts = seg.starts(row, 8)
    # 3 + 4 fit a segment of 8, 5 more would not: the next segment starts at 7, then 12 and 18; the
    # 12-token sentence is longer than a segment: cut where the segment is full (26); the rest fits
    assert starts.tolist() == [0, 7, 12, 18, 26]
    ends = np.append(starts[1:], len(row))
    assert np.all(ends - starts <= 8) and np.all(ends - starts >= 1)
    assert np.flatnonzero(seg.may_start(row)).tolist() == [3, 7, 12, 18, 30]
    for k in range(1, len(starts)):  # a prefix that ends at a start is cut as the whole row before it
        assert seg.starts(row[: starts[k]], 8).tolist() == starts[:k].tolist()
    # a stream's cut: decided once S + 1 tokens are in (or the row ends), the same as the whole row's
    assert [seg.first_segment_length(row[:t], 8, final=False) for t in (0, 7, 8, 9)] == [0, 0, 0, 7]
    assert (
        seg.first_segment_length(row[:5], 8, final=True) == 5
        and seg.first_segment_length(row[:0], 8, True) == 0
    )
    assert seg.first_segment_length(row[18:], 8, final=False) == 8  # the long sentence: cut where full
    # a line break ends a sentence too; a period inside a word ("a.b": no space after) does not
    words = np.array([11, 13, NEWLINE, 6, 8, PERIOD, 10, 13, 15, PERIOD, 17])
    assert np.flatnonzero(seg.may_start(words)).tolist() == [3, 10]
    # min_fill: a segment holds at least that share of S (an earlier sentence end is passed over)
    assert SentenceSegmenter(TinyTokenizer(), min_fill=1.0).starts(row, 8).tolist() == [0, 8, 16, 24, 32]
    assert seg.starts(_text([2, 5, 4]), 8).tolist() == [0, 7]  # 2 alone is under min_fill: 2 + 5
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="min_fill"):
            SentenceSegmenter(TinyTokenizer(), bad)
    with pytest.raises(ValueError, match="tokenizer"):
        SentenceSegmenter(None)


def test_segment_at_places_every_token_rejects_bad_starts_and_pads():
    ids = np.arange(1, 21)[None].repeat(2, 0)
    segs, slots = segment_at(ids, np.array([20, 11]), [np.array([0, 7, 15]), np.array([0, 3])], 8)
    assert segs.n.tolist() == [[7, 3], [8, 8], [5, 0]] and segs.first.tolist() == [
        [True, True],
        [False, False],
        [False, False],
    ]
    flat = np.swapaxes(segs.ids, 0, 1).reshape(2, -1)
    valid = slots >= 0
    assert valid.sum(1).tolist() == [20, 11]
    np.testing.assert_array_equal(np.take_along_axis(flat, np.maximum(slots, 0), 1)[valid], ids[valid])
    padded = pad_segments(segs, 4)  # one empty segment more: nothing to read, nothing moves
    assert padded.count == 4 and padded.n[3].tolist() == [0, 0] and not padded.first[3].any()
    np.testing.assert_array_equal(padded.ids[:3], segs.ids)
    assert pad_segments(segs, 3) is segs
    for starts in ([1, 8], [0, 9], [0, 5, 5], []):
        with pytest.raises(ValueError, match="segment starts"):
            segment_at(ids[:1], np.array([20]), [np.array(starts)], 8)


def test_sentence_segments_in_a_batch_and_both_schedules():
    armt = _sentence_armt()
    rows = [_text([3, 4, 2, 7, 5, 6]), _text([6, 6, 6, 2])]  # 27 and 20 tokens, cut differently
    ids = np.zeros((2, 27), np.int64)
    mask = np.zeros((2, 27), bool)
    for r, row in enumerate(rows):
        ids[r, 27 - len(row) :], mask[r, 27 - len(row) :] = row, True  # left padding
    diagonal = armt(ids, mask, schedule="diagonal")
    sequential = armt(ids, mask, schedule="sequential")
    assert float(jnp.abs(diagonal - sequential).max()) <= 1e-4
    for r, row in enumerate(rows):  # each row as if alone, and not the fixed grid's logits
        alone = armt(row[None], schedule="sequential")[0]
        assert float(jnp.abs(diagonal[r][mask[r]] - alone).max()) <= 1e-4
        armt.segmentation = "fixed"
        fixed = armt(row[None], schedule="sequential")[0]
        armt.segmentation = "sentences"
        assert float(jnp.abs(alone - fixed).max()) > 1e-2
    assert float(jnp.abs(diagonal[~mask]).max()) == 0.0
    with pytest.raises(ValueError, match="segmentation"):
        armt.segmentation = "words"


@pytest.mark.parametrize("schedule", ["diagonal", "sequential"])
def test_streams_cut_sentence_segments_as_the_one_shot_call(schedule):
    armt = _sentence_armt()
    first, second, other = (
        _text([3, 4, 2, 7, 5, 6]),
        _text([2, 6, 3]),
        _text([6, 6, 6, 2, 12, 6]),
    )  # 27, 11, 38
    ids = np.stack([np.concatenate([first, second]), other])  # row 0: two documents back to back
    state, outs, at = armt.init_state(2, schedule), [[], []], 0
    for size in (1, 9, 4, 13, 5, 6):  # cuts are often decided mid-chunk; row 0's first document ends at 27
        state, out = armt.feed(state, ids[:, at : at + size], end_document=[at + size == 27, False])
        at += size
        for r in range(2):
            outs[r].append(out[r])
    state, out = armt.flush(state)
    for r, docs in enumerate([(first, second), (other,)]):
        got = jnp.concatenate(outs[r] + [out[r]])
        expected = jnp.concatenate([armt(d[None], schedule="sequential")[0] for d in docs])
        assert got.shape == expected.shape and float(jnp.abs(got - expected).max()) <= 1e-4
    armt.segmentation = "fixed"  # the grid's stream gives other logits
    assert float(jnp.abs(armt(other[None])[0] - expected).max()) > 1e-2


@pytest.mark.slow  # fixed segments: tests/test_armt_stream.py is the fast path
def test_sentence_generation_equals_repeated_generation_logits():
    armt = _sentence_armt()
    rows = [_text([3, 4, 2, 7, 5, 2]), _text([6, 6, 6, 2])]  # windows open at 15 and 12
    n = max(map(len, rows))
    ids = np.zeros((2, n), np.int64)
    mask = np.arange(n)[None] < np.array([len(r) for r in rows])[:, None]
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
    new = 14  # both windows fill: commits, then plain segments
    got = {
        s: jaxlongctx.generate(
            armt, ids, SamplingParams(new, stop_ids=()), cache=ARMTMemory(schedule=s), attention_mask=mask
        )
        for s in ("diagonal", "sequential")
    }
    np.testing.assert_array_equal(got["diagonal"], got["sequential"])
    for r, row in enumerate(rows):
        seq = list(row)
        for _ in range(new):
            logits = armt.generation_logits(np.asarray(seq)[None], len(row), schedule="diagonal")
            seq.append(int(jnp.argmax(logits[0, -1])))
        assert got["diagonal"][r, n:].tolist() == seq[len(row) :]
    # rows whose windows open at different places in one batch: each row as if alone
    pair = np.stack([_text([3, 4, 5, 6, 8]), _text([7, 7, 8, 4])])  # 22-token prompts: windows at 18 and 14
    opens, before = window_starts(armt, pair, np.array([22, 22]))
    assert opens.tolist() == [18, 14]
    assert [b.tolist() for b in before] == [c.tolist() for c in armt.segment_starts(pair, opens)]  # one cut
    both = armt.generation_logits(pair, 22)
    for r in range(2):
        assert float(jnp.abs(both[r] - armt.generation_logits(pair[r : r + 1], 22)[0]).max()) <= 1e-4


def test_shipped_tokenizer_keeps_split_facts_in_one_segment():
    tok = load_default_tokenizer()
    seg = SentenceSegmenter(tok)
    batch = held_out_batch(range(8), 2048, tok, num_facts=1, split_segment=128)
    assert code_split_by_boundary(batch["code_start"], 128).all()  # the fixed grid splits every asked fact
    for r in range(8):
        row, code = batch["ids"][r], batch["code_start"][r]
        fact = batch["fact_positions"][r][batch["target_fact"][r]]
        starts = seg.starts(row, 128)
        ends = np.append(starts[1:], len(row))
        assert np.all(ends - starts <= 128) and np.all(ends[:-1] - starts[:-1] >= 64)
        # no segment starts inside the asked fact (subject ... last code digit)
        assert not np.any((starts > fact) & (starts <= code + CODE_DIGITS - 1))


def test_training_on_sentence_segments_scores_the_tokens_decoding_sees():

    tok = load_default_tokenizer()
    batch = haystack_batch(3, 2, 2048, tok, 128, (2, 4), follow_ups=True, segmenter=SentenceSegmenter(tok))
    count, lengths = batch["seg_ids"].shape[0], batch["lengths"]
    assert count % 2 == 0 and count > 16  # more segments than the grid's 16, padded to a multiple of 16 / 8
    for r, n in enumerate(lengths):  # every token sits at its slot, once; past the row's length none does
        slots = batch["slots"][r]
        assert np.all(slots[n:] == -1) and len(np.unique(slots[:n])) == n
        flat = batch["seg_ids"][:, r].reshape(-1)
        np.testing.assert_array_equal(flat[slots[:n]], batch["ids"][r, :n])
    assert batch["seg_n"].sum(0).tolist() == lengths.tolist()

    armt = load(ARMT_MODEL, "fp32")
    _, seg_logits = armt.run_segments(
        armt.params, Segments(batch["seg_ids"], batch["seg_n"], batch["seg_first"]), "diagonal"
    )
    armt.segmentation = "sentences"  # the reference: the model's own sentence-segmented forward, token order
    mask = np.arange(batch["ids"].shape[1])[None] < lengths[:, None]
    logits = armt(batch["ids"], mask)  # B T V
    answer = answer_logits(seg_logits, batch["answer_pos"], batch["slots"])
    expected = np.take_along_axis(np.asarray(logits), batch["answer_pos"][..., None], axis=1)
    np.testing.assert_allclose(answer, expected, atol=2e-4)
    grid_loss = retrieval_loss(seg_logits, {k: v for k, v in batch.items() if k != "slots"}, 0.5)
    loss = jax.jit(lambda lg, b: retrieval_loss(lg, b, 0.5))(
        seg_logits, batch
    )  # slots traced, as in training
    ce = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(expected), batch["answer_ids"])
    lm = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["ids"][:, 1:])
    real = mask[:, 1:] & mask[:, :-1]
    reference = (ce * batch["answer_mask"]).sum() / batch["answer_mask"].sum() + 0.5 * (
        lm * real
    ).sum() / real.sum()
    np.testing.assert_allclose(loss, reference, rtol=1e-4)
    assert (
        abs(float(grid_loss) - float(loss)) > 1e-2
    )  # reading the segments as a grid scores the wrong tokens


def test_checkpoint_keeps_its_segmentation(tmp_path):
    import json
    import shutil

    armt = load(ARMT_MODEL)
    for name in ("sentences", "fixed"):
        armt.segmentation = name
        assert load(armt.save(tmp_path / name)).segmentation == name
    older = tmp_path / "older"  # a checkpoint written before segmentations were saved: the grid
    shutil.copytree(tmp_path / "sentences", older)
    config = json.loads((older / "config.json").read_text())
    assert config.pop("segmentation") == "sentences"
    (older / "config.json").write_text(json.dumps(config))
    assert load(older).segmentation == "fixed"


@pytest.mark.slow  # fp32 batches as rows: test_armt_schedules is the fast path
def test_shipped_armt_decodes_a_bf16_batch_as_single_rows():
    """bf16 weights with two rows: once failed on CPU with an unsupported bf16 x bf16 = f32 dot."""
    armt = load(ARMT_MODEL, "bf16")
    ids = np.random.default_rng(0).integers(5, 4000, size=(2, 300))
    params = SamplingParams(3, stop_ids=())
    batch = jaxlongctx.generate(armt, ids, params)
    for row in range(2):
        alone = jaxlongctx.generate(armt, ids[row : row + 1], params)
        np.testing.assert_array_equal(batch[row], alone[0])
