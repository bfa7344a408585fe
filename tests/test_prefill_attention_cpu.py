"""The native causal prefill attention against XLA's flash-style path (`causal_prefill_attention`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.model.attention import causal_prefill_attention
from pallas_kernels import prefill_attention_cpu
from pallas_kernels.prefill_attention_cpu import prefill_attention

pytestmark = pytest.mark.jaxmin


@pytest.fixture(autouse=True)
def _require_native():
    """Skip only where no C++ compiler exists; a compiler whose build fails is a test failure."""
    error = prefill_attention_cpu.native_kernel_error()
    if error is not None and error.startswith("no C++ compiler"):
        pytest.skip(error)
    assert error is None, error


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "batch, length, kv_heads, group, head_dim",
    [
        (1, 300, 3, 3, 64),  # SmolLM2's heads; a partial query block and key tile, a diagonal tile
        (2, 97, 2, 4, 32),  # left-padded rows (key_valid), rows not a multiple of the micro-tile's
        (1, 40, 1, 1, 16),  # one head, head_dim below a panel's width on AVX-512
    ],
)
def test_equals_the_xla_path(dtype, tol, batch, length, kv_heads, group, head_dim):
    rng = np.random.default_rng(length)
    q = jnp.asarray(rng.standard_normal((batch, length, kv_heads * group, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((batch, length, kv_heads, head_dim)), dtype) for _ in range(2))
    valid = np.ones((batch, length), bool)
    valid[1:, :7] = False  # the second row is left-padded
    got = jax.jit(prefill_attention)(q, k, v, jnp.asarray(valid))
    want = jax.jit(lambda *a: causal_prefill_attention(*a, chunk=64, key_block=128))(
        q, k, v, jnp.asarray(valid)
    )
    got, want = (np.asarray(x.astype(jnp.float32)) for x in (got, want))
    real = valid[:, :, None, None]  # pad queries see no key: the kernel gives 0 there
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=tol, atol=tol)
    assert not np.any(np.where(real, 0, got))


def test_bad_shapes_are_refused():
    q = jnp.zeros((1, 8, 4, 16))
    with pytest.raises(ValueError, match="prefill_attention"):
        prefill_attention(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)), jnp.ones((1, 8), bool))
