"""The LM head's vocabulary-tiled path (CPU, bf16 weights, few tokens) gives the plain product's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.model.llama import HEAD_TILE_MAX_TOKENS, HEAD_VOCAB_TILE, vocab_logits


def _uses_tiles(x, w, axis) -> bool:
    return "scan" in str(jax.make_jaxpr(vocab_logits, static_argnums=2)(x, w, axis))


@pytest.mark.parametrize("vocab_axis", [0, 1])
@pytest.mark.parametrize("vocab", [3 * HEAD_VOCAB_TILE, 2 * HEAD_VOCAB_TILE + 77])
def test_tiled_head_matches_the_float32_product(vocab_axis, vocab):
    d = 96
    shape = (vocab, d) if vocab_axis == 0 else (d, vocab)
    w = (0.1 * jax.random.normal(jax.random.key(0), shape)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 3, d)).astype(jnp.bfloat16)
    assert _uses_tiles(x, w, vocab_axis) == (jax.default_backend() == "cpu")
    spec = "btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv"
    want = np.asarray(jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32)))
    got = np.asarray(jax.jit(vocab_logits, static_argnums=2)(x, w, vocab_axis))
    assert got.dtype == np.float32 and got.shape == (2, 3, vocab)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_float32_and_long_inputs_take_the_plain_product():
    w = jnp.zeros((3 * HEAD_VOCAB_TILE, 32), jnp.float32)
    assert not _uses_tiles(jnp.zeros((1, 1, 32), jnp.float32), w, 0)
    many = jnp.zeros((1, HEAD_TILE_MAX_TOKENS + 1, 32), jnp.bfloat16)
    assert not _uses_tiles(many, w.astype(jnp.bfloat16), 0)
