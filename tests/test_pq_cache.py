"""PQ KV cache: prefill encoding, batched window flushes, byte accounting, codebook calibration/loading."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.config import ModelConfig
from jaxlongctx.kvcache import Codebooks, centroid_shape, decode, encode, save_codebooks
from jaxlongctx.kvcache.calibrate import calibrate
from jaxlongctx.kvcache.model_codebooks import check_codebooks, load_codebooks_for, model_fingerprint
from jaxlongctx.kvcache.pq_cache import (
    PQCache,
    decode_layers,
    encode_layers,
    flush_full_rows,
    pq_cache_report,
    write_window,
)
from pallas_kernels.pq_codes import unpack_codes

CFG = ModelConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eos_token_id=2,
)
L, K, D = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim


def random_codebooks(
    granularity: str,
    ds: int = 2,
    bits: int = 4,
    seed: int = 0,
    num_layers: int = L,
    num_kv_heads: int = K,
    head_dim: int = D,
) -> Codebooks:
    shape = centroid_shape(granularity, num_layers, num_kv_heads, head_dim, ds, bits)
    kk, kv = jax.random.split(jax.random.key(seed))
    return Codebooks(
        jax.random.normal(kk, shape),
        jax.random.normal(kv, shape),
        granularity,
        ds,
        bits,
        head_dim,
        num_layers,
        num_kv_heads,
    )


@pytest.fixture(scope="module")
def model():
    return jaxlongctx.Model.init(CFG, seed=1)


@pytest.mark.parametrize("granularity,bits", [("shared", 4), ("layer", 5), ("layer_head", 4)])
def test_encode_layers_matches_codec_per_layer(granularity, bits):
    """4-bit codes are stored two a byte ([..., M/2]), 5-bit ones a byte each."""
    cb = random_codebooks(granularity, bits=bits)
    x = jax.random.normal(jax.random.key(1), (L, 2, K, 5, D))
    k_cent, _ = cb.stacked()
    codes = encode_layers(x, k_cent)
    packed = bits == 4
    assert codes.shape == (L, 2, K, 5, D // 4 if packed else D // 2) and codes.dtype == jnp.uint8
    one_a_byte = unpack_codes(codes) if packed else codes
    for layer in range(L):
        np.testing.assert_array_equal(one_a_byte[layer], encode(x[layer], cb.for_layer(layer)[0]))
    np.testing.assert_array_equal(decode_layers(codes, k_cent)[1], decode(one_a_byte[1], cb.for_layer(1)[0]))


@pytest.mark.parametrize("keep_tail", [False, True])
def test_prefill_compacts_real_tokens_and_fills_window(keep_tail):
    cb = random_codebooks("layer_head")
    k_cent, v_cent = cb.stacked()
    t, window = 8, 3
    k = jax.random.normal(jax.random.key(2), (L, 2, t, K, D))
    v = jax.random.normal(jax.random.key(3), (L, 2, t, K, D))
    mask = np.ones((2, t), bool)
    mask[1, :3] = False  # left padding: row 1 has 5 real tokens
    cache = PQCache.from_prefill(k, v, jnp.asarray(mask), k_cent, v_cent, 16, window, keep_tail)
    lens = np.array([8, 5])
    exact = (lens - 1) % window + 1 if keep_tail else np.zeros(2, int)
    np.testing.assert_array_equal(cache.lengths, lens - exact)
    np.testing.assert_array_equal(cache.window_lengths, exact)
    for b in range(2):
        real = np.asarray(k)[:, b][:, mask[b]].transpose(0, 2, 1, 3)  # L K n D in sequence order
        n = lens[b] - exact[b]
        want = encode_layers(jnp.asarray(real[:, None]), k_cent)[:, 0]
        np.testing.assert_array_equal(cache.k_codes[:, b, :, :n], want[:, :, :n])
        np.testing.assert_array_equal(cache.k_window[:, b, :, : exact[b]], real[:, :, n:])


def test_flush_appends_only_full_rows():
    cb = random_codebooks("layer")
    k_cent, v_cent = cb.stacked()
    window, cap = 2, 8
    cache = PQCache(
        jnp.zeros((L, 2, K, cap, 4), jnp.uint8),  # 4-bit codes of M = 8 subspaces, two a byte
        jnp.zeros((L, 2, K, cap, 4), jnp.uint8),
        jax.random.normal(jax.random.key(4), (L, 2, K, window, D)),
        jax.random.normal(jax.random.key(5), (L, 2, K, window, D)),
        jnp.array([3, 1], jnp.int32),
        jnp.array([2, 1], jnp.int32),
    )
    out = flush_full_rows(cache, k_cent, v_cent)
    np.testing.assert_array_equal(out.lengths, [5, 1])
    np.testing.assert_array_equal(out.window_lengths, [0, 1])
    np.testing.assert_array_equal(out.k_codes[:, 0, :, 3:5], encode_layers(cache.k_window, k_cent)[:, 0])
    np.testing.assert_array_equal(out.v_codes[:, 1, :, :1], 0)  # row 1's valid codes untouched
    same = flush_full_rows(out, k_cent, v_cent)  # nothing full: no change
    np.testing.assert_array_equal(same.lengths, out.lengths)
    win = write_window(cache.k_window[0], jnp.ones((2, K, D)), jnp.array([1, 0]))
    np.testing.assert_array_equal(win[0, :, 1], 1.0)
    np.testing.assert_array_equal(win[1, :, 0], 1.0)
    np.testing.assert_array_equal(win[0, :, 0], cache.k_window[0, 0, :, 0])


def test_cache_bytes_vs_dense_at_32k():
    llama2 = ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
    )
    for ds, want in ((2, 3.9), (4, 7.5)):
        cb = random_codebooks("shared", ds=ds, bits=8, num_layers=32, num_kv_heads=32, head_dim=128)
        report = pq_cache_report(llama2, cb, 32768)
        assert report["compression"] >= want, report
        coded = 32768 - 128
        assert report["codes_bytes"] == 2 * 32 * 32 * coded * (128 // ds)
        assert report["window_bytes"] == 2 * 32 * 32 * 128 * 128 * 2
        assert report["dense_bf16_bytes"] == 2 * 32 * 32 * 32768 * 128 * 2
    for bits, code_bytes in (
        (4, 128 // 4),
        (5, 128 // 2),
    ):  # 4-bit codes packed two a byte, 5-bit a byte each
        cb = random_codebooks("shared", ds=2, bits=bits, num_layers=32, num_kv_heads=32, head_dim=128)
        assert pq_cache_report(llama2, cb, 32768)["codes_bytes"] == 2 * 32 * 32 * (32768 - 128) * code_bytes
    with pytest.raises(ValueError, match="codebooks are for"):
        pq_cache_report(CFG, cb, 10)


@pytest.fixture(scope="module")
def calibrated(model):
    tokens = np.random.default_rng(0).integers(3, 97, 1024)
    return calibrate(
        model, tokens, ds=2, bits=4, granularity="layer_head", iters=2, seq_len=128, max_tokens=512
    )


def test_calibrate_records_fingerprint_and_roundtrips(model, calibrated, tmp_path):
    assert calibrated.granularity == "layer_head" and calibrated.key_centroids.shape == (L, K, 8, 16, 2)
    assert calibrated.model_fingerprint == model_fingerprint(model)
    assert calibrated.metadata["calibration_tokens"] == 512
    path = save_codebooks(calibrated, tmp_path / "cb")
    loaded = load_codebooks_for(model, path)
    np.testing.assert_array_equal(loaded.value_centroids, calibrated.value_centroids)
    other = jaxlongctx.Model.init(CFG, seed=2)
    assert model_fingerprint(other) != model_fingerprint(model)
    with pytest.raises(ValueError, match="were made for model"):
        load_codebooks_for(other, path)
    with pytest.raises(ValueError, match="calibrated on another model"):
        check_codebooks(other, calibrated)


def test_fingerprint_ignores_dtype(model):
    bf16 = jaxlongctx.Model.init(CFG, seed=1, dtype=jnp.bfloat16)
    assert model_fingerprint(bf16) == model_fingerprint(model)


def test_bad_codebook_files_give_clear_errors(model, calibrated, tmp_path):
    path = save_codebooks(calibrated, tmp_path / "cb")
    (path / "codebooks.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_codebooks_for(model, path)
    with pytest.raises(ValueError, match="does not exist"):
        load_codebooks_for(model, tmp_path / "missing")
    path2 = save_codebooks(calibrated, tmp_path / "cb2")
    meta = json.loads((path2 / "codebooks.json").read_text())
    meta["num_kv_heads"] = 4
    (path2 / "codebooks.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="do not match"):
        load_codebooks_for(model, path2)
    wrong_shape = random_codebooks("shared", num_layers=3)
    with pytest.raises(ValueError, match="layers, kv heads, head dim"):
        check_codebooks(model, wrong_shape)


def test_calibrate_rejects_too_little_text(model):
    with pytest.raises(ValueError, match="fewer than one window"):
        calibrate(model, np.arange(3, 50), seq_len=128, max_tokens=512)
    with pytest.raises(ValueError, match="fewer than the 256 centroids"):
        calibrate(
            model,
            np.random.default_rng(0).integers(3, 97, 128),
            bits=8,
            granularity="layer_head",
            seq_len=128,
            max_tokens=128,
        )
