"""The in-place CPU products for decode steps: kernel numerics, errors, and the decode paths that use them
(with the in-place attention of `test_decode_attention_cpu`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx import PQKV, SamplingParams
from jaxlongctx.config import ModelConfig
from jaxlongctx.decode_loop import Request
from jaxlongctx.generate import _compiled
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.model import llama
from pallas_kernels import decode_attention_cpu, layer_matvec_cpu, prefill_attention_cpu
from pallas_kernels.layer_matvec_cpu import layer_matvec, layer_matvecs

pytestmark = pytest.mark.jaxmin


@pytest.fixture(autouse=True)
def _require_native():
    """Skip only where no C++ compiler exists; a compiler whose build fails is a test failure."""
    error = layer_matvec_cpu.native_kernel_error()
    if error is not None and error.startswith("no C++ compiler"):
        pytest.skip(error)
    assert error is None, error


def _reference(x: np.ndarray, w: np.ndarray, layer: int, transposed: bool) -> np.ndarray:
    wl = w[layer].astype(np.float64)
    return x.astype(np.float64) @ (wl.T if transposed else wl)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "rows, k, n, transposed",
    [
        (1, 576, 192, False),
        (3, 37, 70, False),  # no full 32-column step in a tail, odd K (rows beyond the unroll of 4)
        (5, 64, 2100, False),  # two column blocks, the second with a scalar tail
        (16, 130, 96, False),
        (40, 37, 70, False),  # the GEMM path (> 16 rows): a partial micro-tile of rows and of columns
        (211, 600, 96, False),  # three K passes of the AVX2 tier's GEMM, two blocks of rows
        (1, 70, 300, True),  # transposed: K not a multiple of 16, a partial last tile of rows
        (4, 576, 1000, True),
    ],
)
def test_matches_a_float64_reference(dtype, rows, k, n, transposed):
    rng = np.random.default_rng(rows * 1000 + k)
    layers = 3
    w = jnp.asarray(rng.standard_normal((layers, n, k) if transposed else (layers, k, n)), dtype)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    # every layer through a scan with a traced index: the kernel offsets into the stack itself
    run = jax.jit(lambda x, w: jax.lax.map(lambda i: layer_matvec(x, w, i, transposed), jnp.arange(layers)))
    got = np.asarray(run(jnp.asarray(x), w))
    w64 = np.asarray(w.astype(jnp.float32))
    for layer in range(layers):
        want = _reference(x, w64, layer, transposed)
        np.testing.assert_allclose(got[layer], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_several_weight_stacks_in_one_call():
    """q/k/v-like stacks of different widths share x: each result equals its own product."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    stacks = tuple(jnp.asarray(rng.standard_normal((4, 96, n)), jnp.bfloat16) for n in (96, 32, 32, 2100))
    got = jax.jit(lambda x, i: layer_matvecs(x, stacks, i))(jnp.asarray(x), 3)
    for y, w in zip(got, stacks):
        np.testing.assert_allclose(
            np.asarray(y), np.asarray(layer_matvec(jnp.asarray(x), w, 3)), rtol=1e-6, atol=1e-5
        )
    with pytest.raises(ValueError, match="of one dtype"):
        layer_matvecs(jnp.asarray(x), (stacks[0], stacks[1].astype(jnp.float32)), 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_normalised_input_equals_the_norm_then_the_product(dtype):
    """`norm=(gain, eps)`: the kernel's RMSNorm prologue equals `rms_norm` (rounded to bf16 where the model
    is bf16) followed by the product, value and gradients."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 96)) * 4.0, dtype)
    gain = jnp.asarray(rng.uniform(0.5, 1.5, 96), dtype)
    stacks = tuple(jnp.asarray(rng.standard_normal((2, 96, n)), dtype) for n in (64, 40))
    got = jax.jit(lambda x, g: layer_matvecs(x, stacks, 1, norm=(g, 1e-5)))(x, gain)
    normed = layer_matvec_cpu.rms_norm(x, gain, 1e-5)
    for y, w in zip(got, stacks):
        want = np.asarray(normed, np.float64) @ np.asarray(w[1], np.float64)
        tol = 2e-5 if dtype == jnp.float32 else 1e-2  # bf16: the result is rounded to bf16
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())
    cot = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    ours = lambda x, g: jnp.sum(layer_matvecs(x, stacks[:1], 1, norm=(g, 1e-5))[0].astype(jnp.float32) * cot)
    plain = lambda x, g: jnp.sum(
        (layer_matvec_cpu.rms_norm(x, g, 1e-5) @ stacks[0][1]).astype(jnp.float32) * cot
    )
    x32, g32 = x.astype(jnp.float32), gain.astype(jnp.float32)
    for got_grad, want_grad in zip(jax.grad(ours, (0, 1))(x32, g32), jax.grad(plain, (0, 1))(x32, g32)):
        np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="norm gain"):
        layer_matvecs(x, stacks, 0, norm=(gain[:10], 1e-5))


@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_are_those_of_the_plain_product(transposed):
    """Training through a few-row head or step: d/dx and d/dw equal XLA's product's."""
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.standard_normal((3, 20, 12) if transposed else (3, 12, 20)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 1, 12)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((2, 1, 20)), jnp.float32)

    def plain(x, w):
        wl = w[1].T if transposed else w[1]
        return jnp.sum((x @ wl) * cot)

    ours = lambda x, w: jnp.sum(layer_matvec(x, w, 1, transposed) * cot)
    for got, want in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_keeps_leading_axes_and_the_input_dtype():
    x = jnp.ones((2, 1, 8), jnp.bfloat16)
    w = jnp.full((1, 8, 5), 0.5, jnp.bfloat16)
    y = layer_matvec(x, w, 0)
    assert y.shape == (2, 1, 5) and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), 4.0)


def test_bad_operands_are_refused():
    x = jnp.ones((1, 8), jnp.float32)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        layer_matvec(x, jnp.ones((1, 8, 4), jnp.float16), 0)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        layer_matvec(x, jnp.ones((8, 4), jnp.float32), 0)
    with pytest.raises(ValueError, match="x has 8 features, the weights 6"):
        layer_matvec(x, jnp.ones((1, 6, 4), jnp.float32), 0)


CFG = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eos_token_id=2,
)


def _generate_both_ways(model, ids, **kwargs):
    """Tokens and decode-step logits with weights read in place and with XLA's dot."""
    outs = {}
    for in_place in (False, True):
        llama.IN_PLACE_DECODE = in_place
        try:
            outs[in_place] = np.asarray(
                jaxlongctx.generate(model, ids, SamplingParams(8, stop_ids=()), **kwargs)
            )
        finally:
            llama.IN_PLACE_DECODE = True
    return outs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_decode_reads_weights_in_place_with_the_same_tokens(dtype):
    model = jaxlongctx.Model.init(CFG, seed=3, dtype=dtype)
    ids = np.random.default_rng(0).integers(3, 97, (2, 9)).astype(np.int32)
    outs = _generate_both_ways(model, ids)
    np.testing.assert_array_equal(outs[True], outs[False])
    # the step really calls the kernel (and XLA's path does not)
    static = Request.parse(model, ids, SamplingParams(8, stop_ids=()), None).static_key
    cache = DenseCache.allocate(CFG, 2, 32, dtype)
    args = (model.params, cache, jnp.zeros((2, CFG.vocab_size)), jax.random.key(0), jnp.zeros((2,), bool))
    texts = {}
    for in_place in (False, True):
        llama.IN_PLACE_DECODE = in_place
        try:
            _, step = _compiled(model, 32, *static)
            texts[in_place] = step.lower(*args, jnp.full((2,), 9, jnp.int32), jnp.int32(9)).as_text()
        finally:
            llama.IN_PLACE_DECODE = True
    for target in (layer_matvec_cpu.TARGET, decode_attention_cpu.TARGET):
        assert target in texts[True] and target not in texts[False]


def test_pq_decode_reads_weights_in_place_with_the_same_tokens():
    model = jaxlongctx.Model.init(CFG, seed=4)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 97, (1, 40)).astype(np.int32)
    codebooks = jaxlongctx.calibrate(model, rng.integers(3, 97, 512), iters=2, seq_len=128, max_tokens=256)
    outs = _generate_both_ways(model, ids, cache=PQKV(codebooks, window=8))
    np.testing.assert_array_equal(outs[True], outs[False])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_reads_weights_in_place_with_the_same_hidden_states(dtype):
    """An inference prefill of >= IN_PLACE_PREFILL_ROWS rows (the GEMM path and the native attention) equals
    XLA's path on every real token, and calls the kernels only when asked (`in_place`)."""
    m = jaxlongctx.Model.init(CFG, seed=5, dtype=dtype)
    model = m.merge(m.params)
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 97, (2, 40)), jnp.int32)  # 80 rows
    mask = jnp.ones(ids.shape, bool).at[1, :5].set(False)
    runs = {
        in_place: jax.jit(
            lambda ids, mask, p=in_place: llama.forward_hidden(model, ids, mask, True, in_place=p)
        )
        for in_place in (False, True)
    }
    (h0, (k0, _)), (h1, (k1, _)) = runs[False](ids, mask), runs[True](ids, mask)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    real = np.asarray(mask)  # pad tokens see no key: the native attention leaves them 0, XLA's a mean
    for got, want in ((h1[real], h0[real]), (k1[:, real], k0[:, real])):
        want = np.asarray(want.astype(jnp.float32))
        np.testing.assert_allclose(
            np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol * np.abs(want).max()
        )
    texts = {p: run.lower(ids, mask).as_text() for p, run in runs.items()}
    for target in (layer_matvec_cpu.TARGET, prefill_attention_cpu.TARGET):
        assert target in texts[True] and target not in texts[False]
