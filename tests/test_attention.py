"""The blocked (flash-style) causal prefill attention and the decode attention (cache + own key) equal plain masked
attention over the whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.model.attention import (
    PREFILL_KEY_BLOCK,
    PREFILL_QUERY_BLOCK,
    attention,
    causal_prefill_attention,
    decode_attention,
)


def _prefill_inputs(t: int, seed: int = 0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (2, t, 4, 8)) * 2.0  # large scores: the online softmax must rescale
    k = jax.random.normal(kk, (2, t, 2, 8))
    v = jax.random.normal(kv, (2, t, 2, 8))
    valid = np.ones((2, t), bool)
    valid[1, :70] = False  # left padding longer than a key tile
    valid[1, -9:] = False  # and right padding
    return q, k, v, jnp.asarray(valid)


@pytest.mark.parametrize(
    "t, chunk, key_block",
    [
        (
            2 * PREFILL_QUERY_BLOCK + 37,
            PREFILL_QUERY_BLOCK,
            PREFILL_KEY_BLOCK,
        ),  # the defaults, last block short
        (200, 64, 32),  # key tiles smaller than query blocks
        (200, 48, 64),  # block sizes that do not divide each other
    ],
)
def test_blocked_prefill_equals_full_attention(t, chunk, key_block):
    q, k, v, valid = _prefill_inputs(t)
    slots = jnp.broadcast_to(jnp.arange(t), (2, t))
    blocked = np.asarray(causal_prefill_attention(q, k, v, valid, chunk=chunk, key_block=key_block))
    full = np.asarray(attention(q, k, v, slots, valid))
    # padding queries see no key at all; their (unused) output is an average of values in both paths
    seen = np.asarray(valid) & (np.cumsum(np.asarray(valid), axis=1) > 0)
    np.testing.assert_allclose(blocked[seen], full[seen], atol=1e-5)
    assert np.isfinite(blocked).all()


@pytest.mark.parametrize("offset", [0, 37, 130])
def test_blocked_prefill_of_a_chunk_at_an_offset_equals_full_attention(offset):
    """A chunk of 40 queries at slots offset + t over a longer key buffer (the chunked prefill's):
    the same as `attention` with those query slots; key tiles past the chunk are skipped."""
    q, k, v, valid = _prefill_inputs(200, seed=5)
    q = q[:, offset : offset + 40]
    slots = jnp.broadcast_to(offset + jnp.arange(40), (2, 40))
    at = jnp.int32(offset)
    blocked = causal_prefill_attention(q, k, v, valid, chunk=16, key_block=32, offset=at)
    full = attention(q, k, v, slots, valid)
    seen = np.asarray(jnp.take_along_axis(jnp.cumsum(valid, axis=1) > 0, slots, axis=1))
    np.testing.assert_allclose(np.asarray(blocked)[seen], np.asarray(full)[seen], atol=1e-5)


def test_blocked_prefill_gradients_equal_full_attention():
    t = 150
    q, k, v, valid = _prefill_inputs(t, seed=3)
    slots = jnp.broadcast_to(jnp.arange(t), (2, t))
    weight = jax.random.normal(jax.random.key(9), (2, t, 4, 8)) * jnp.asarray(valid)[:, :, None, None]

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weight)

    blocked = jax.grad(
        loss(lambda q, k, v: causal_prefill_attention(q, k, v, valid, chunk=32, key_block=64)),
        argnums=(0, 1, 2),
    )(q, k, v)
    full = jax.grad(loss(lambda q, k, v: attention(q, k, v, slots, valid)), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(blocked, full):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def test_decode_attention_equals_attention_over_the_written_cache():
    b, k_heads, groups, slots, hd, slot = 3, 2, 3, 40, 8, 29
    kq, kk, kv, kn, kw = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(kq, (b, 1, k_heads * groups, hd))
    cache_k = (
        jax.random.normal(kk, (b, k_heads, slots, hd)) * 3.0
    )  # large scores: the joint softmax must rescale
    cache_v = jax.random.normal(kv, (b, k_heads, slots, hd))
    k_new, v_new = (jax.random.normal(key, (b, 1, k_heads, hd)) for key in (kn, kw))
    valid = np.ones((b, slots), bool)
    valid[1, :7] = False  # left padding
    valid[2, :slot] = False  # nothing cached: only its own key is visible
    valid[:, slot] = True
    valid = jnp.asarray(valid)
    # stale values in the new token's slot and beyond must not be read
    written_k = cache_k.at[:, :, slot].set(k_new[:, 0])
    written_v = cache_v.at[:, :, slot].set(v_new[:, 0])
    expected = attention(q, written_k, written_v, jnp.full((b, 1), slot), valid, heads_major=True)
    visible = valid & (jnp.arange(slots) < slot)[None]
    got = decode_attention(q, cache_k, cache_v, k_new, v_new, visible)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(got[2, 0]), np.repeat(np.asarray(v_new[2, 0]), groups, axis=0), atol=1e-6
    )
