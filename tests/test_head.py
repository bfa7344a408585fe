"""The LM head's few-token paths on CPU (the in-place kernel; without it, vocabulary tiles for bf16
weights) give the plain product's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.model import llama
from jaxlongctx.model.llama import HEAD_TILE_MAX_TOKENS, HEAD_VOCAB_TILE, vocab_logits
from pallas_kernels import layer_matvec_cpu


def _uses_tiles(x, w, axis) -> bool:
    return "scan" in str(jax.make_jaxpr(_fresh(axis))(x, w))


def _fresh(axis: int):
    """`vocab_logits` as a new function: traced anew, so that it sees the current IN_PLACE_DECODE."""
    return lambda x, w: vocab_logits(x, w, axis)


def _uses_kernel(x, w, axis) -> bool:
    return layer_matvec_cpu.TARGET in jax.jit(_fresh(axis)).lower(x, w).as_text()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("vocab_axis", [0, 1])
@pytest.mark.parametrize("vocab", [3 * HEAD_VOCAB_TILE, 2 * HEAD_VOCAB_TILE + 77])
def test_few_token_heads_match_the_float32_product(vocab_axis, vocab, in_place, monkeypatch):
    """bf16 weights, 6 tokens: the in-place kernel, or (switched off) the vocabulary tiles."""
    if in_place and layer_matvec_cpu.native_kernel_error() is not None:
        pytest.skip(layer_matvec_cpu.native_kernel_error())
    monkeypatch.setattr(llama, "IN_PLACE_DECODE", in_place)
    d = 96
    shape = (vocab, d) if vocab_axis == 0 else (d, vocab)
    w = (0.1 * jax.random.normal(jax.random.key(0), shape)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 3, d)).astype(jnp.bfloat16)
    on_cpu = jax.default_backend() == "cpu"
    assert _uses_kernel(x, w, vocab_axis) == (on_cpu and in_place)
    assert _uses_tiles(x, w, vocab_axis) == (on_cpu and not in_place)
    spec = "btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv"
    want = np.asarray(jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32)))
    got = np.asarray(jax.jit(_fresh(vocab_axis))(x, w))
    assert got.dtype == np.float32 and got.shape == (2, 3, vocab)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_float32_and_long_inputs_take_the_plain_product(monkeypatch):
    monkeypatch.setattr(llama, "IN_PLACE_DECODE", False)
    w = jnp.zeros((3 * HEAD_VOCAB_TILE, 32), jnp.float32)
    assert not _uses_tiles(jnp.zeros((1, 1, 32), jnp.float32), w, 0)
    many = jnp.zeros((1, HEAD_TILE_MAX_TOKENS + 1, 32), jnp.bfloat16)
    assert not _uses_tiles(many, w.astype(jnp.bfloat16), 0)
