"""Grouped GEMM: Pallas interpret mode and its VJP against the plain-jnp reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul
from pallas_kernels.grouped_matmul import grouped_matmul_reference

pytestmark = [
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
    pytest.mark.jaxmin,
]

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def _inputs(groups: int, tokens: int, depth: int, width: int, layers: int, dtype, seed: int = 0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (groups, tokens, depth), jnp.float32).astype(dtype)  # [G T K]
    w = (jax.random.normal(kw, (layers, depth, width), jnp.float32) / np.sqrt(depth)).astype(dtype)  # [L K N]
    return x, w


@functools.partial(jax.jit, static_argnames="backend")
def _gmm(x, w, first_layer, num_active, backend):
    return grouped_matmul(x, w, first_layer, num_active, backend=backend)


def _close(got, want, dtype):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_interpret_matches_reference_every_num_active(dtype):
    # T, K, N deliberately not multiples of any block (16/32/64): exercises masked edges.
    x, w = _inputs(4, 20, 40, 24, 4, dtype)
    for num_active in range(1, 5):  # traced scalars: one compile for the sweep
        got = _gmm(x, w, jnp.int32(0), jnp.int32(num_active), "interpret")
        assert got.dtype == dtype and got.shape == (4, 20, 24)
        _close(got, grouped_matmul_reference(x, w, 0, num_active), dtype)
        assert not np.any(np.asarray(got[num_active:], np.float32))  # skipped rows are zero


def test_interpret_first_layer_offset_and_dtype_mix():
    x, w = _inputs(3, 33, 17, 70, 6, jnp.float32, seed=1)
    for first, active in ((2, 3), (3, 2), (5, 1)):
        got = _gmm(x, w, jnp.int32(first), jnp.int32(active), "interpret")
        for g in range(3):
            want = x[g] @ w[first + g] if g < active else jnp.zeros((33, 70))
            np.testing.assert_allclose(got[g], want, atol=1e-4, rtol=1e-4)
    got = _gmm(x, w.astype(jnp.bfloat16), jnp.int32(1), jnp.int32(3), "interpret")  # mixed: out in x.dtype
    assert got.dtype == jnp.float32
    _close(got, grouped_matmul_reference(x, w.astype(jnp.bfloat16), 1, 3), jnp.bfloat16)


def test_traced_scalars_from_scan():
    """first_layer / num_active come from a lax.scan over diagonal steps, as in the ARMT schedule."""
    x, w = _inputs(4, 16, 32, 16, 4, jnp.float32, seed=2)

    def run(backend):
        def step(carry, n):
            return carry, grouped_matmul(x, w, jnp.int32(0), n, backend=backend)

        return jax.lax.scan(step, 0, jnp.arange(1, 5, dtype=jnp.int32))[1]  # [S G T N]

    np.testing.assert_allclose(
        jax.jit(lambda: run("interpret"))(), jax.jit(lambda: run("xla"))(), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vjp_matches_grad_of_reference(dtype):
    x, w = _inputs(3, 18, 20, 36, 5, dtype, seed=3)
    cot = jax.random.normal(jax.random.PRNGKey(9), (3, 18, 36), jnp.float32)

    def loss(x, w, backend):
        y = grouped_matmul(x, w, jnp.int32(1), jnp.int32(2), backend=backend)
        return jnp.sum(y.astype(jnp.float32) * cot)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    (dx, dw), (dx_ref, dw_ref) = grad(x, w, "interpret"), grad(x, w, "xla")
    assert dx.dtype == dtype and dw.dtype == dtype and dw.shape == w.shape
    _close(dx, dx_ref, dtype)
    _close(dw, dw_ref, dtype)
    assert not np.any(np.asarray(dw[jnp.array([0, 3, 4])], np.float32))  # untouched layers get zero
    assert not np.any(np.asarray(dx[2], np.float32))  # inactive row group gets zero


def test_float32_output_from_bf16_inputs():
    """out_dtype=float32 keeps the fp32 accumulator (ARMT's memory projections); the VJP runs through it."""
    x, w = _inputs(3, 18, 20, 36, 4, jnp.bfloat16, seed=4)
    cot = jax.random.normal(jax.random.PRNGKey(8), (3, 18, 36), jnp.float32)

    def loss(x, w, backend):
        y = grouped_matmul(x, w, jnp.int32(1), jnp.int32(3), backend=backend, out_dtype=jnp.float32)
        return jnp.sum(y * cot), y

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (dx, dw), y = grad(x, w, "interpret")
    (dx_ref, dw_ref), y_ref = grad(x, w, "xla")
    assert y.dtype == jnp.float32 and dx.dtype == dw.dtype == jnp.bfloat16
    exact = jnp.einsum("gtk,gkn->gtn", x.astype(jnp.float32), w[1:4].astype(jnp.float32))
    np.testing.assert_allclose(y, exact, atol=1e-5, rtol=1e-5)  # not rounded to bf16
    np.testing.assert_allclose(y_ref, exact, atol=1e-5, rtol=1e-5)
    _close(dx, dx_ref, jnp.bfloat16)
    _close(dw, dw_ref, jnp.bfloat16)
    with pytest.raises(ValueError, match="out_dtype must be"):
        grouped_matmul(x, w, 0, 1, backend="xla", out_dtype=jnp.int32)


def test_auto_is_xla_on_cpu_and_bad_backend_named():
    x, w = _inputs(2, 4, 8, 8, 2, jnp.float32)
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(grouped_matmul(x, w, 0, 2), grouped_matmul(x, w, 0, 2, backend="xla"))
    with pytest.raises(ValueError, match="'triton'"):
        grouped_matmul(x, w, 0, 2, backend="triton")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda x, w: (x[0], w, 0, 1), "x must be"),
        (lambda x, w: (x, w[:, :4], 0, 1), "contraction mismatch"),
        (lambda x, w: (x.astype(jnp.int32), w, 0, 1), "x must be float32 or bfloat16"),
        (lambda x, w: (x, w, jnp.zeros(2, jnp.int32), 1), "first_layer must be an integer scalar"),
        (lambda x, w: (x, w, 0, 1.5), "num_active must be an integer scalar"),
        (lambda x, w: (x, w, 1, 2), "first_layer \\+ num_active <= L=2"),
    ],
)
def test_bad_inputs_raise_clear_errors(make, match):
    x, w = _inputs(2, 4, 8, 8, 2, jnp.float32)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(*make(x, w), backend="xla")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_pallas_matches_reference(dtype):
    x, w = _inputs(16, 200, 256, 384, 16, dtype)
    for first, active in ((0, 16), (0, 1), (3, 7)):
        got = _gmm(x, w, jnp.int32(first), jnp.int32(active), "pallas")
        _close(got, grouped_matmul_reference(x, w, first, active), dtype)
    loss = lambda x, w, b: jnp.sum(grouped_matmul(x, w, 2, 9, backend=b).astype(jnp.float32) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for got, want in zip(grad(x, w, "pallas"), grad(x, w, "xla")):
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(got, np.float32) / scale, np.asarray(want, np.float32) / scale, atol=TOL[dtype] * 4
        )
