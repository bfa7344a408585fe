"""The decoder layer's one entry point: every attention strategy computes the same layer output for the
same token, and hands back the K/V or cache its schedule needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlongctx.config import ModelConfig
from jaxlongctx.model.attention_strategies import (
    CachedDecode,
    CausalPrefill,
    KVTransformed,
    RecentExactKV,
    SlotAttention,
    SlotWriteDecode,
)
from jaxlongctx.model.layers import DecoderLayer
from jaxlongctx.model.rope import inverse_frequencies, rope_tables

CFG = ModelConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
B, T = 2, 7


def _inputs(seed: int = 0):
    """A random layer, hidden states `[B, T, D]`, RoPE tables and a left-padded key mask `[B, T]`."""
    layer = DecoderLayer(CFG, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    h = jax.random.normal(jax.random.key(seed + 1), (B, T, CFG.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    cos, sin = rope_tables(positions, inverse_frequencies(CFG))
    valid = jnp.ones((B, T), bool).at[1, :2].set(False)
    return layer, h, cos, sin, valid


def test_decode_strategies_match_prefill_on_the_last_token():
    """The last token through `CachedDecode` / `SlotWriteDecode` over a cache filled with the prefill's
    collected K/V gives the prefill's output, and their aux holds that token's K/V in the cache layout."""
    layer, h, cos, sin, valid = _inputs()
    last = lambda x: x[:, T - 1 :]

    @jax.jit
    def run(h, cos, sin, valid):
        full, (k, v) = layer(h, cos, sin, CausalPrefill(valid, collect_kv=True))  # k/v: B T K hd
        cache_k, cache_v = (x.swapaxes(1, 2).at[:, :, T - 1].set(0.0) for x in (k, v))  # B K T hd
        visible = valid & (jnp.arange(T) < T - 1)[None]  # the last slot is not cached yet
        cached = layer(last(h), last(cos), last(sin), CachedDecode(cache_k, cache_v, visible))
        hit = jnp.broadcast_to(jnp.arange(T) == T - 1, (B, T))
        slot_write = SlotWriteDecode(cache_k, cache_v, hit, jnp.full((B,), T - 1), valid)
        written = layer(last(h), last(cos), last(sin), slot_write)
        return full, (k, v), cached, written

    full, (k, v), (out, (k_new, v_new)), (out2, (ck, cv)) = run(h, cos, sin, valid)
    assert k.shape == (B, T, CFG.num_kv_heads, CFG.head_dim)
    for o in (out, out2):
        np.testing.assert_allclose(o, last(full), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k_new[:, :, 0], k[:, T - 1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v_new[:, :, 0], v[:, T - 1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ck, k.swapaxes(1, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cv, v.swapaxes(1, 2), rtol=1e-6, atol=1e-6)


def test_slot_attention_grouped_axis_and_kv_transform_match_causal_prefill():
    """`SlotAttention` at slots 0..T-1 equals the causal prefill; a leading group axis `G` before `B`
    (ARMT's grouped step) is folded into the batch, each group equal to its own call; `KVTransformed`
    attends over the transformed K/V, `RecentExactKV` over the exact K/V inside its recent window."""
    layer, h, cos, sin, valid = _inputs(1)
    slots = jnp.broadcast_to(jnp.arange(T), (B, T))
    zero_v = lambda k, v: (k, 0.0 * v)

    @jax.jit
    def run(h, cos, sin, valid):
        full, (k, v) = layer(h, cos, sin, CausalPrefill(valid, collect_kv=True))
        by_slot, none = layer(h, cos, sin, SlotAttention(slots, valid))
        grouped, _ = layer(
            jnp.stack([h, 2.0 * h]), cos[None], sin[None], CausalPrefill(jnp.stack([valid] * 2))
        )
        doubled, _ = layer(2.0 * h, cos, sin, CausalPrefill(valid))
        zeroed, (k0, v0) = layer(h, cos, sin, KVTransformed(CausalPrefill(valid, collect_kv=True), zero_v))
        recent = [layer(h, cos, sin, RecentExactKV(valid, zero_v, r))[0] for r in (T, 1)]
        return full, (k, v), by_slot, none, grouped, doubled, zeroed, (k0, v0), recent

    full, (k, v), by_slot, none, grouped, doubled, zeroed, (k0, v0), recent = run(h, cos, sin, valid)
    assert none is None
    real = np.asarray(valid)  # padded query rows see no key; their outputs are not compared
    np.testing.assert_allclose(np.asarray(by_slot)[real], np.asarray(full)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grouped[0], full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grouped[1], doubled, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(k0, k)
    assert float(jnp.abs(v0).max()) == 0.0 < float(jnp.abs(v).max())
    assert float(jnp.abs(zeroed - full).max()) > 1e-3  # the attention output changed with v
    np.testing.assert_allclose(np.asarray(recent[0])[real], np.asarray(full)[real], rtol=1e-5, atol=1e-5)
    own_exact = np.asarray(recent[1])[real]  # each query reads its own value exactly, older ones zeroed
    assert np.abs(own_exact - np.asarray(full)[real]).max() > 1e-3
    assert np.abs(own_exact - np.asarray(zeroed)[real]).max() > 1e-3
