"""KIVI-style uniform fake quantization (jaxlongctx.kvcache.uniform_quant)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.kvcache import effective_bits, fake_quantize_keys, fake_quantize_values


def _group_scale(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Per-element scale of groups along the last axis of x (partial last group on its own)."""
    a = x.shape[-1]
    scale = np.empty_like(x)
    for start in range(0, a, group):
        g = x[..., start : start + group]
        scale[..., start : start + group] = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / (
            2**bits - 1
        )
    return scale


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_within_half_step(bits: int) -> None:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(2, 70, 48)) * rng.uniform(0.1, 10, size=(1, 1, 48))).astype(
        np.float32
    )  # T=70, D=48
    k_hat = np.asarray(fake_quantize_keys(x, bits, scale_dtype=jnp.float32))
    v_hat = np.asarray(fake_quantize_values(x, bits, scale_dtype=jnp.float32))
    k_scale = np.swapaxes(_group_scale(np.swapaxes(x, -1, -2), bits, 32), -1, -2)
    v_scale = _group_scale(x, bits, 32)
    assert np.all(np.abs(x - k_hat) <= k_scale / 2 * (1 + 1e-4) + 1e-6)
    assert np.all(np.abs(x - v_hat) <= v_scale / 2 * (1 + 1e-4) + 1e-6)
    # the default fp16 scale/zero only adds fp16 rounding on top
    k16 = np.asarray(fake_quantize_keys(x, bits))
    assert np.all(np.abs(x - k16) <= k_scale / 2 + 2e-3 * np.abs(x).max())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_at_most_2_to_bits_levels_per_group(bits: int) -> None:
    x = np.random.default_rng(1).normal(size=(64, 32)).astype(np.float32)  # T=64, D=32
    k_hat = np.asarray(fake_quantize_keys(x, bits))
    for start in (0, 32):
        for ch in range(32):
            assert len(np.unique(k_hat[start : start + 32, ch])) <= 2**bits
    v_hat = np.asarray(fake_quantize_values(x, bits))
    assert max(len(np.unique(row)) for row in v_hat) <= 2**bits


def test_8bit_exact_on_small_integer_ranges() -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(-100, 156, size=(3, 45, 40)).astype(np.float32)  # each group spans < 256 integers
    x[..., 0, :] = -100.0  # every key group along T contains the same min and max -> scale exactly 1
    x[..., 1, :] = 155.0
    x[..., 0] = -100.0
    x[..., 1] = 155.0
    np.testing.assert_array_equal(np.asarray(fake_quantize_keys(x[..., :32, :], 8)), x[..., :32, :])
    np.testing.assert_array_equal(np.asarray(fake_quantize_values(x[..., :32], 8)), x[..., :32])


def test_partial_groups_and_constants() -> None:
    x = np.random.default_rng(3).normal(size=(33, 4)).astype(np.float32)
    x[32] = 0.25  # the partial last key group (one token) is constant -> reconstructed exactly
    out = np.asarray(fake_quantize_keys(x, 2))
    np.testing.assert_array_equal(out[32], x[32])
    assert out.shape == x.shape and out.dtype == x.dtype
    v = np.asarray(fake_quantize_values(jnp.asarray(x, jnp.bfloat16), 4))
    assert v.shape == x.shape and v.dtype == jnp.bfloat16


def test_effective_bits_and_validation() -> None:
    assert effective_bits(4) == 5.0 and effective_bits(2) == 3.0 and effective_bits(8, 128) == 8.25
    with pytest.raises(ValueError, match="bits"):
        fake_quantize_keys(np.zeros((4, 4)), 3)
    with pytest.raises(ValueError, match="group"):
        fake_quantize_values(np.zeros((4, 4)), 4, group=0)
    with pytest.raises(ValueError, match=r"\[\.\.\., T, D\]"):
        fake_quantize_keys(np.zeros(4), 4)
