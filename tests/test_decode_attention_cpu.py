"""The in-place CPU decode attention over a stacked dense cache: equal to the XLA path on the layer's slices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.model.attention import decode_attention
from pallas_kernels import decode_attention_cpu
from pallas_kernels.decode_attention_cpu import cached_decode_attention

pytestmark = pytest.mark.jaxmin


@pytest.fixture(autouse=True)
def _require_native():
    """Skip only where no C++ compiler exists; a compiler whose build fails is a test failure."""
    error = decode_attention_cpu.native_kernel_error()
    if error is not None and error.startswith("no C++ compiler"):
        pytest.skip(error)
    assert error is None, error


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "layers, batch, kv_heads, group, slots, head_dim",
    [
        (3, 1, 3, 3, 1024, 64),  # SmolLM2's heads, one split per (row, kv head)
        (2, 2, 2, 4, 3000, 32),  # several token splits, a chunk tail
        (2, 3, 1, 1, 70, 16),  # one query head per kv head, fewer slots than a chunk
        (1, 2, 2, 2, 301, 128),  # Llama's head size; slots not a multiple of 4
    ],
)
def test_equals_the_xla_path_on_the_layer_slice(dtype, tol, layers, batch, kv_heads, group, slots, head_dim):
    rng = np.random.default_rng(slots)
    cache = lambda: jnp.asarray(rng.standard_normal((layers, batch, kv_heads, slots, head_dim)), dtype)
    ck, cv = cache(), cache()
    q = jnp.asarray(rng.standard_normal((batch, 1, kv_heads * group, head_dim)), dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((batch, 1, kv_heads, head_dim)), dtype) for _ in range(2))
    visible = rng.random((batch, slots)) < 0.7
    visible[0, : slots // 2] = False  # a long masked run: whole chunks and splits see nothing
    visible[0, slots * 7 // 8 :] = False  # not yet full: the splits share the slots up to the last seen
    if batch > 1:
        visible[-1] = False  # a row that sees only its own token
    run = jax.jit(
        lambda ck, cv, i: jax.lax.map(
            lambda l: cached_decode_attention(q, ck, cv, visible, l, k_new, v_new), i
        )
    )
    got = np.asarray(run(ck, cv, jnp.arange(layers)).astype(jnp.float32))
    for layer in range(layers):
        want = np.asarray(
            decode_attention(q, ck[layer], cv[layer], k_new, v_new, jnp.asarray(visible)), np.float32
        )
        np.testing.assert_allclose(got[layer], want, rtol=tol, atol=tol)
    if batch > 1:  # only its own value
        np.testing.assert_allclose(
            got[0, -1].reshape(kv_heads, group, head_dim),
            np.repeat(np.asarray(v_new[-1, 0], np.float32)[:, None], group, axis=1),
            rtol=tol,
            atol=tol,
        )


def test_unsupported_head_layouts_are_refused():
    assert decode_attention_cpu.supports(9, 3, 64) and not decode_attention_cpu.supports(9, 3, 40)
    assert not decode_attention_cpu.supports(9, 3, 48) and not decode_attention_cpu.supports(34, 2, 64)
    q = jnp.ones((1, 1, 2, 40))
    cache = jnp.ones((1, 1, 1, 8, 40))
    with pytest.raises(ValueError, match="not supported"):
        cached_decode_attention(
            q, cache, cache, jnp.ones((1, 8), bool), 0, jnp.ones((1, 1, 1, 40)), jnp.ones((1, 1, 1, 40))
        )
