"""The blocked causal prefill attention and the decode attention (cache + own key) equal plain masked
attention over the whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.model.attention import PREFILL_CHUNK, attention, causal_prefill_attention, decode_attention


def test_blocked_prefill_equals_full_attention():
    t = 2 * PREFILL_CHUNK + 37  # three blocks, the last one short
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, t, 4, 8))
    k = jax.random.normal(kk, (2, t, 2, 8))
    v = jax.random.normal(kv, (2, t, 2, 8))
    valid = np.ones((2, t), bool)
    valid[1, :5] = False  # left padding
    valid[1, -9:] = False  # and right padding
    valid = jnp.asarray(valid)
    slots = jnp.broadcast_to(jnp.arange(t), (2, t))
    blocked = np.asarray(causal_prefill_attention(q, k, v, valid))
    full = np.asarray(attention(q, k, v, slots, valid))
    # padding queries see no key at all; their (unused) output is a uniform average in both paths
    seen = np.asarray(valid) & (np.cumsum(np.asarray(valid), axis=1) > 0)
    np.testing.assert_allclose(blocked[seen], full[seen], atol=1e-5)
    assert np.isfinite(blocked).all()


def test_decode_attention_equals_attention_over_the_written_cache():
    b, k_heads, groups, slots, hd, slot = 3, 2, 3, 40, 8, 29
    kq, kk, kv, kn, kw = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(kq, (b, 1, k_heads * groups, hd))
    cache_k = jax.random.normal(kk, (b, k_heads, slots, hd)) * 3.0  # large scores: the joint softmax must rescale
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
    np.testing.assert_allclose(np.asarray(got[2, 0]), np.repeat(np.asarray(v_new[2, 0]), groups, axis=0), atol=1e-6)
