"""ARMT streaming, multi-document pipelines, generation, checkpoints and memory accounting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_armt_utils import VOCAB, shared_armt, tiny_config

from jaxlongctx.armt import ARMTConfig, ARMTModel
from jaxlongctx.cache_choice import ARMTMemory
from jaxlongctx.checkpoint import load_module
from jaxlongctx.generate import generate
from jaxlongctx.sampling import SamplingParams

RNG = np.random.default_rng(1)


def _max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("schedule", ["diagonal", "sequential"])
def test_stream_chunks_equal_one_shot(schedule):
    armt = shared_armt()
    ids = RNG.integers(0, VOCAB, (1, 45))
    expected = armt(ids, schedule="sequential")[0]
    state = armt.init_state(1, schedule)
    pieces, start = [], 0
    for size in (3, 10, 1, 0, 17, 14):
        state, out = armt.feed(state, ids[:, start : start + size])
        pieces.append(out[0])
        start += size
    state, out = armt.flush(state)
    got = jnp.concatenate(pieces + [out[0]])
    assert got.shape == expected.shape
    assert _max_diff(got, expected) <= 1e-4


def test_documents_back_to_back_without_draining():
    armt = shared_armt()
    d00, d01 = RNG.integers(0, VOCAB, 12), RNG.integers(0, VOCAB, 20)  # row 0: two documents
    d10, d11 = RNG.integers(0, VOCAB, 22), RNG.integers(0, VOCAB, 10)  # row 1: two documents
    state = armt.init_state(2, "diagonal")
    outs = [[], []]
    feeds = [
        (np.stack([d00, d10[:12]]), [True, False]),
        (np.stack([d01[:10], d10[12:]]), [False, True]),
        (np.stack([d01[10:], d11]), [True, False]),
    ]
    for chunk, ends in feeds:
        state, out = armt.feed(state, chunk, end_document=ends)
        assert state.occupied is not None  # the pipeline kept segments in flight between calls
        for r in range(2):
            outs[r].append(out[r])
    state, out = armt.flush(state)
    assert state.occupied is None
    for r, docs in enumerate([(d00, d01), (d10, d11)]):
        got = jnp.concatenate(outs[r] + [out[r]])
        expected = jnp.concatenate([armt(d[None], schedule="sequential")[0] for d in docs])
        assert _max_diff(got, expected) <= 1e-4
    # the final memory of row 0 is that of its last document alone
    _, alone = armt.run(d01[None], schedule="sequential")
    mem = state.current_memory()
    assert float(jnp.abs(mem.A[:, 0] - alone.A[:, 0]).max() / jnp.abs(alone.A).max()) <= 1e-5


def test_greedy_generation_equals_repeated_generation_logits():
    armt = shared_armt()  # segment size 8
    ids = RNG.integers(0, VOCAB, (2, 29))
    lengths = [29, 24]  # 3 whole segments + 5 tokens; 3 whole segments (the window opens on the last one)
    mask = np.arange(29)[None] < np.asarray(lengths)[:, None]
    new = 15  # both windows (rows 0 / 1: [24, 40) / [16, 32)) fill: two commits, then a fresh segment
    params = SamplingParams(new, stop_ids=())
    got = {
        s: generate(armt, ids, params, cache=ARMTMemory(schedule=s), attention_mask=mask)
        for s in ("diagonal", "sequential")
    }
    np.testing.assert_array_equal(got["diagonal"], got["sequential"])
    timings = {}
    np.testing.assert_array_equal(
        generate(armt, ids, params, attention_mask=mask, timings=timings), got["diagonal"]
    )
    assert timings["decode_steps"] == new and timings["prefill_s"] > 0 and timings["decode_s"] > 0
    for r, n in enumerate(lengths):
        seq = list(ids[r, :n])
        for _ in range(new):
            logits = armt.generation_logits(np.asarray(seq)[None], n, schedule="sequential")
            seq.append(int(jnp.argmax(logits[0, -1])))
        assert got["diagonal"][r, 29:].tolist() == seq[n:]


def test_generation_logits_keep_the_question_in_view():
    armt = shared_armt()  # segment size 8
    ids = RNG.integers(0, VOCAB, (2, 44))
    plain = armt(ids, schedule="sequential")
    # a window that stays inside the prompt's last segment is that segment of the plain forward
    inside = armt.generation_logits(ids[:, :32], 29, schedule="diagonal")
    assert _max_diff(inside, plain[:, :32]) <= 1e-4
    # a prompt of whole segments: later tokens join its last segment instead of starting a new one
    joined = armt.generation_logits(ids[:, :28], 24)
    assert _max_diff(joined[:, :24], plain[:, :24]) <= 1e-4
    assert _max_diff(joined[:, 24:], plain[:, 24:28]) > 1e-2
    # past the 2S window everything is committed again: plain segments
    past = armt.generation_logits(ids, 24)
    assert _max_diff(past[:, :28], joined) <= 1e-4 and _max_diff(past[:, 32:], plain[:, 32:]) <= 1e-4
    for bad in (0, 45, 2.0):
        with pytest.raises(ValueError, match="prompt_length"):
            armt.generation_logits(ids, bad)


def test_save_load_roundtrip(tmp_path):
    armt = shared_armt()
    ids = RNG.integers(0, VOCAB, (1, 29))
    path = armt.save(tmp_path / "ckpt")
    loaded = ARMTModel.load(path)
    assert loaded.armt == armt.armt
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(armt.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _max_diff(loaded(ids, schedule="sequential"), armt(ids, schedule="sequential")) == 0.0
    assert load_module(path).config == armt.config  # the base weights stay a plain checkpoint
    with pytest.raises(ValueError, match="already exists"):
        armt.save(path)


def test_memory_accounting():
    armt = shared_armt()
    cfg, ac = armt.config, armt.armt
    state = cfg.num_layers * ac.d_key * (cfg.hidden_size + 1) * 4  # A and z in float32
    assert armt.state_bytes() == state + ac.num_mem_tokens * cfg.hidden_size * 4
    assert (
        armt.full_attention_kv_bytes(1000) == 2 * cfg.num_layers * 1000 * cfg.num_kv_heads * cfg.head_dim * 2
    )


def test_reference_init_and_errors():
    from jaxlongctx.model.model import Model

    model = Model.init(tiny_config(2))
    armt = ARMTModel.wrap(model, ARMTConfig(8, 4, d_mem=8), jax.random.key(0))
    assert float(jnp.abs(armt.memory.wv[...]).max()) == 0.0  # reference: W_mv zeros
    emb_std = float(jnp.std(model.module.embed[...]))
    assert abs(float(jnp.std(armt.memory.memory[...])) - emb_std) < 0.5 * emb_std
    with pytest.raises(ValueError, match="segment_size"):
        ARMTConfig(0, 4)
    with pytest.raises(ValueError, match="state_dtype"):
        ARMTConfig(8, 4, state_dtype=jnp.int32)
    with pytest.raises(ValueError, match="schedule"):
        armt(np.zeros((1, 4), np.int32), schedule="zigzag")
    with pytest.raises(ValueError, match="rows"):
        armt.feed(armt.init_state(2), np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="expected shape"):
        armt.set_memory_params(wv=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="vocabulary"):
        armt(np.full((1, 4), VOCAB))
