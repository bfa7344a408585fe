"""Generation over the PQ cache: logits equal exact attention over the reconstructed cache, long greedy runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx import PQKV, SamplingParams
from jaxlongctx.config import ModelConfig
from jaxlongctx.kvcache import Codebooks, centroid_shape
from jaxlongctx.kvcache.pq_cache import decode_layers, encode_layers, exact_tail
from jaxlongctx.model.llama import decode_hidden, forward_hidden
from jaxlongctx.pq_generate import pq_decode_hidden, pq_prefill

CFG = ModelConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eos_token_id=2,
)


def kv_codebooks(model, granularity: str, bits: int = 4) -> Codebooks:
    """Codebooks of the model's scale (centroids drawn from its own prompt K/V), no k-means needed."""
    ids = np.random.default_rng(7).integers(3, 97, (1, 64)).astype(np.int32)
    _, (k, v) = forward_hidden(model.module, jnp.asarray(ids), jnp.ones(ids.shape, bool), collect_kv=True)
    shape = centroid_shape(granularity, CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 2, bits)
    m, c = shape[-3], shape[-2]

    def pick(x, seed):  # x [L, 1, T, K, D] -> centroids of `shape` from random (token, subspace) pieces
        pieces = np.asarray(x).reshape(-1, m, 2)
        idx = np.random.default_rng(seed).integers(0, pieces.shape[0], (int(np.prod(shape[:-3])), c, m))
        cent = pieces[idx, np.arange(m)]  # [P, C, M, 2]
        return jnp.asarray(np.moveaxis(cent, 2, 1).reshape(shape), jnp.float32)

    return Codebooks(
        pick(k, 0), pick(v, 1), granularity, 2, bits, CFG.head_dim, CFG.num_layers, CFG.num_kv_heads
    )


@pytest.fixture(scope="module")
def model():
    return jaxlongctx.Model.init(CFG, seed=1)


def _fake_quantize_dense(x, cent):
    """decode(encode(x)) of a dense cache x [L, B, S, K, D] with stacked centroids."""
    xt = x.transpose(0, 1, 3, 2, 4)
    return decode_layers(encode_layers(xt, cent), cent).transpose(0, 1, 3, 2, 4).astype(x.dtype)


def _reference_step(model, k_cent, v_cent):
    """A dense decode step over exact k/v `[L, B, S, K, D]` whose `coded [L|1, B, S, K|1]` entries are
    replaced by decode(encode(.)): what a PQ step should compute. Returns logits and the new k/v."""

    @jax.jit
    def step(p, ek, ev, valid, coded, tok, pos, slot):
        ak = jnp.where(coded[..., None], _fake_quantize_dense(ek, k_cent), ek)
        av = jnp.where(coded[..., None], _fake_quantize_dense(ev, v_cent), ev)
        module = model.merge(p)
        heads_major = lambda x: x.transpose(0, 1, 3, 2, 4)
        h, nk, nv = decode_hidden(module, tok, pos, slot, heads_major(ak), heads_major(av), valid)
        nk, nv = heads_major(nk), heads_major(nv)
        at = (jnp.arange(ek.shape[2]) == slot)[None, None, :, None, None]
        return module.head(h)[:, 0], jnp.where(at, nk, ek), jnp.where(at, nv, ev)

    return step


@pytest.mark.parametrize(
    "granularity,keep_tail", [("layer_head", True), pytest.param("shared", False, marks=pytest.mark.slow)]
)
def test_pq_logits_equal_dense_decode_over_reconstructed_cache(model, granularity, keep_tail):
    """Teacher-forced: each PQ step equals a dense decode whose cache holds decode(encode(k/v)) for the
    tokens the PQ cache has coded and exact k/v for its window tokens."""
    cb = kv_codebooks(model, granularity)
    k_cent, v_cent = cb.stacked()
    window, steps, t = 4, 11, 8
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 97, (2, t)).astype(np.int32)
    mask = np.ones((2, t), bool)
    mask[1, :3] = False  # row 1: 5 real tokens, left padded
    toks = rng.integers(3, 97, (2, steps)).astype(np.int32)
    params = model.params

    prefill = jax.jit(lambda p, i, m: pq_prefill(model.merge(p), k_cent, v_cent, 32, window, keep_tail, i, m))
    pq_step = jax.jit(lambda p, c, tok, pos: pq_decode_hidden(model.merge(p), k_cent, v_cent, tok, pos, c))
    logits, cache = prefill(params, ids, mask)

    # reference: dense cache of exact k/v in slots [0, t + steps); coded tokens fake-quantized
    _h, (k, v) = jax.jit(lambda p, i, m: forward_hidden(model.merge(p), i, m, collect_kv=True))(
        params, ids, mask
    )
    np.testing.assert_allclose(logits, model(ids, mask)[np.arange(2), -1], atol=1e-5)
    pad = ((0, 0), (0, 0), (0, steps), (0, 0), (0, 0))
    ek, ev = jnp.pad(k, pad), jnp.pad(v, pad)
    valid = np.concatenate([mask, np.zeros((2, steps), bool)], axis=1)

    ref_step = _reference_step(model, k_cent, v_cent)

    positions = mask.sum(axis=1)
    for i in range(steps):
        h_pq, cache = pq_step(params, cache, toks[:, i : i + 1], (positions + i)[:, None])
        pq_logits = model.module.head(h_pq)[:, 0]
        valid[:, t + i] = True
        total = valid.sum(axis=1)
        lens, wl = np.asarray(cache.lengths), np.asarray(cache.window_lengths)
        np.testing.assert_array_equal(lens + wl, total)
        coded = valid & (np.cumsum(valid, axis=1) <= lens[:, None])
        ref_logits, ek, ev = ref_step(
            params,
            ek,
            ev,
            valid,
            coded[None, :, :, None],
            toks[:, i : i + 1],
            (positions + i)[:, None],
            t + i,
        )
        np.testing.assert_allclose(pq_logits, ref_logits, atol=1e-4, rtol=1e-4)
    # bookkeeping: flush when the window is full, so 1..R tokens stay exact
    n = np.array([8, 5]) + steps
    want_wl = (n - 1) % window + 1 if keep_tail else np.full(2, (steps - 1) % window + 1)
    np.testing.assert_array_equal(cache.window_lengths, want_wl)
    np.testing.assert_array_equal(cache.lengths, n - want_wl)


@pytest.mark.parametrize(
    "sinks, observed, keep_tail, window, extra",
    [(2, 0, False, 4, 8), (1, 3, True, 4, 8), (1, 3, True, 100, 148)],  # last: exact tails of 80 and 77
)
def test_pinned_prompt_tokens_stay_exact_through_decoding(model, sinks, observed, keep_tail, window, extra):
    """Teacher-forced with pinned prompt tokens (sinks, and tokens the prompt's last ones attend to):
    each PQ step equals a dense decode whose cache holds exact k/v for the pinned and window tokens and
    decode(encode(k/v)) for the others, across window flushes; pinned tokens never leave the window."""
    from jaxlongctx.kvcache.observed_tokens import (
        OBSERVE,
        ObservingPrefill,
        observed_slots,
        pinned_prompt_tokens,
    )
    from jaxlongctx.model.llama import forward_with

    cb = kv_codebooks(model, "layer_head")
    k_cent, v_cent = cb.stacked()
    steps, t = 9, OBSERVE + extra
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 97, (2, t)).astype(np.int32)
    mask = np.ones((2, t), bool)
    mask[1, :3] = False  # row 1 left padded
    toks = rng.integers(3, 97, (2, steps)).astype(np.int32)
    params = model.params
    prefill = jax.jit(
        lambda p, i, m: pq_prefill(
            model.merge(p), k_cent, v_cent, 256, window, keep_tail, i, m, sinks, observed
        )
    )
    pq_step = jax.jit(
        lambda p, c, tok, pos: pq_decode_hidden(model.merge(p), k_cent, v_cent, tok, pos, c, recent=window)
    )
    _, cache = prefill(params, ids, mask)
    np.testing.assert_array_equal(cache.pinned, sinks + observed)
    if keep_tail:
        np.testing.assert_array_equal(
            cache.window_lengths, sinks + observed + (mask.sum(axis=1) - 1) % window + 1
        )
    assert cache.window == window + sinks + observed

    attend = ObservingPrefill(jnp.asarray(mask), observed_slots(jnp.asarray(mask), OBSERVE))
    _h, (k, v, q_obs) = forward_with(model.module, jnp.asarray(ids), jnp.asarray(mask), attend)
    if observed:
        tail = exact_tail(jnp.asarray(mask.sum(axis=1)), window) if keep_tail else 0
        pinned = pinned_prompt_tokens(jnp.asarray(mask), sinks, observed, q_obs, k, tail)
    else:
        pinned = pinned_prompt_tokens(jnp.asarray(mask), sinks)
    pinned = np.broadcast_to(np.asarray(pinned), (CFG.num_layers, 2, t, CFG.num_kv_heads))
    np.testing.assert_array_equal(pinned.sum(axis=2), sinks + observed)
    pad = ((0, 0), (0, 0), (0, steps), (0, 0), (0, 0))
    ek, ev = jnp.pad(k, pad), jnp.pad(v, pad)
    pinned = np.pad(pinned, ((0, 0), (0, 0), (0, steps), (0, 0)))  # [L, B, S, K]
    valid = np.concatenate([mask, np.zeros((2, steps), bool)], axis=1)

    ref_step = _reference_step(model, k_cent, v_cent)

    positions = mask.sum(axis=1)
    for i in range(steps):
        h_pq, cache = pq_step(params, cache, toks[:, i : i + 1], (positions + i)[:, None])
        valid[:, t + i] = True
        lens = np.asarray(cache.lengths)
        np.testing.assert_array_equal(lens + np.asarray(cache.window_lengths), valid.sum(axis=1))
        codable = valid[None, :, :, None] & ~pinned  # the coded tokens: the first `lens` of these
        coded = codable & (np.cumsum(codable, axis=2) <= lens[None, :, None, None])
        ref_logits, ek, ev = ref_step(
            params, ek, ev, valid, coded, toks[:, i : i + 1], (positions + i)[:, None], t + i
        )
        np.testing.assert_allclose(model.module.head(h_pq)[:, 0], ref_logits, atol=1e-4, rtol=1e-4)
    n = mask.sum(axis=1) + steps
    recent = (n - 1) % window + 1 if keep_tail else np.full(2, (steps - 1) % window + 1)
    np.testing.assert_array_equal(cache.window_lengths, sinks + observed + recent)


def test_generation_with_every_prompt_token_pinned_is_dense_greedy(model):
    """Sinks covering the prompt and a window the new tokens never fill: nothing is coded, so PQ
    generation gives the dense greedy tokens; a short prompt cannot be observed."""
    cb = kv_codebooks(model, "layer")
    ids = np.random.default_rng(6).integers(3, 97, (1, 12)).astype(np.int32)
    params = SamplingParams(6, stop_ids=())
    dense = jaxlongctx.generate(model, ids, params)
    out = jaxlongctx.generate(model, ids, params, cache=PQKV(cb, window=8, sinks=12))
    np.testing.assert_array_equal(out, dense)
    assert not np.array_equal(jaxlongctx.generate(model, ids, params, cache=PQKV(cb, window=1)), dense)
    # the defaults (tail exact in a 128-token window; a prompt this short has no observed tokens)
    np.testing.assert_array_equal(jaxlongctx.generate(model, ids, params, cache=PQKV(cb)), dense)
    assert not np.array_equal(jaxlongctx.generate(model, ids, params, cache=PQKV.bare(cb, window=1)), dense)
    with pytest.raises(ValueError, match="sinks must be an int"):
        PQKV(cb, sinks=-1)


def test_pq_defaults_keep_answers_and_bare_is_the_reference(model):
    """`PQKV(cb)` keeps sinks, observed tokens and the prompt's tail exact; `PQKV.bare` keeps none. In a
    batch, a prompt too short to be observed has none while a long one has its own: each row decodes
    as it does alone."""
    cb = kv_codebooks(model, "layer")
    default, bare = PQKV(cb), PQKV.bare(cb)
    assert (default.window, default.keep_prompt_tail_exact, default.sinks, default.observed) == (
        128,
        True,
        4,
        256,
    )
    assert (bare.window, bare.keep_prompt_tail_exact, bare.sinks, bare.observed) == (128, False, 0, 0)
    rng = np.random.default_rng(8)
    ids = rng.integers(3, 97, (2, 90)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[0, :80] = False  # row 0: 10 tokens, fewer than the observing ones
    params = SamplingParams(12, stop_ids=())
    cache = PQKV(cb, window=8, sinks=2, observed=6)
    out = jaxlongctx.generate(model, ids, params, cache=cache, attention_mask=mask)
    short = jaxlongctx.generate(model, ids[:1, 80:], params, cache=cache)
    long = jaxlongctx.generate(model, ids[1:], params, cache=cache)
    np.testing.assert_array_equal(out[0, 90:], short[0, 10:])
    np.testing.assert_array_equal(out[1], long[0])


def test_greedy_pq_generation_300_steps_across_flushes(model):
    cb = kv_codebooks(model, "layer")
    ids = np.random.default_rng(4).integers(3, 97, (2, 10)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[0, :4] = False
    params = SamplingParams(300, stop_ids=())
    out = jaxlongctx.generate(model, ids, params, cache=PQKV(cb, window=128), attention_mask=mask)
    assert out.shape == (2, 310) and ((out[:, 10:] >= 0) & (out[:, 10:] < CFG.vocab_size)).all()
    dense = jaxlongctx.generate(model, ids, SamplingParams(1, stop_ids=()), attention_mask=mask)
    np.testing.assert_array_equal(out[:, 10], dense[:, 10])  # prefill attends in full precision
    row = jaxlongctx.generate(model, ids[1:], params, cache=PQKV(cb, window=128))
    np.testing.assert_array_equal(out[1], row[0])  # batch rows are independent


def test_pq_generation_errors(model):
    cb = kv_codebooks(model, "shared")
    ids = np.array([[5, 6, 7]], np.int32)
    params = SamplingParams(2)
    with pytest.raises(ValueError, match="cache must be DenseKV"):
        jaxlongctx.generate(model, ids, params, cache="int4")
    with pytest.raises(ValueError, match="needs codebooks"):
        PQKV(None)
    with pytest.raises(ValueError, match="window"):
        PQKV(cb, window=0)
    other = Codebooks(
        cb.key_centroids,
        cb.value_centroids,
        "shared",
        2,
        4,
        16,
        2,
        2,
        metadata={"model_fingerprint": "0123456789abcdef"},
    )
    with pytest.raises(ValueError, match="calibrated on another model"):
        jaxlongctx.generate(model, ids, params, cache=PQKV(other))
    from jaxlongctx.armt import ARMTConfig, ARMTModel

    armt = ARMTModel.wrap(model, ARMTConfig(segment_size=8, num_mem_tokens=2, d_mem=4), jax.random.key(0))
    with pytest.raises(ValueError, match="full-attention models"):
        jaxlongctx.generate(armt, ids, params, cache=PQKV(cb))
    with pytest.raises(ValueError, match="full-attention models"):
        jaxlongctx.generate(armt, ids, params, cache=jaxlongctx.DenseKV())
