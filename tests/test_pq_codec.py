"""PQ codec, batched k-means and codebook storage (jaxlongctx.kvcache)."""

from __future__ import annotations

import importlib
import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.kvcache import (
    Codebooks,
    cache_bytes,
    decode,
    encode,
    fake_quantize,
    kmeans,
    load_codebooks,
    save_codebooks,
    train_codebooks,
)
from jaxlongctx.kvcache import codebooks as codebooks_module
from jaxlongctx.kvcache.kmeans import _assign, _lloyd_step
from pallas_kernels import kmeans_assign_cpu

kmeans_module = importlib.import_module(
    "jaxlongctx.kvcache.kmeans"
)  # the package exports the function as `kmeans`


@pytest.fixture(params=[True, False], ids=["native", "xla"])
def native(request, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a k-means test through the C++ assignment kernel and through the XLA path."""
    if request.param:
        error = kmeans_assign_cpu.native_kernel_error()
        if error is not None and error.startswith("no C++ compiler"):
            pytest.skip(error)  # only where no compiler exists; a failed build fails the test
        assert error is None, error
    monkeypatch.setattr(kmeans_assign_cpu, "use_native_kernel", lambda: request.param)
    return request.param


def _brute_force_codes(x: np.ndarray, cent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest centroid per subspace in float64: x[N, D], cent[M, C, ds] -> (codes[N, M], dists[N, M, C])."""
    m, _c, ds = cent.shape
    sub = x.reshape(-1, m, 1, ds).astype(np.float64)
    d = np.sum((sub - cent[None].astype(np.float64)) ** 2, axis=-1)  # [N, M, C]
    return d.argmin(-1), d


def _assert_nearest(codes: np.ndarray, x: np.ndarray, cent: np.ndarray) -> None:
    """codes pick a nearest centroid (ties within float32 rounding allowed) and mostly equal brute force."""
    ref, d = _brute_force_codes(x, cent)
    picked = np.take_along_axis(d, codes.reshape(ref.shape)[..., None].astype(np.int64), -1)[..., 0]
    assert np.all(picked <= d.min(-1) + 1e-5 * (1 + d.min(-1)))
    assert np.mean(codes.reshape(ref.shape) == ref) > 0.999


def test_encode_matches_brute_force_shared(native: bool) -> None:
    rng = np.random.default_rng(0)
    cent = rng.normal(size=(4, 256, 4)).astype(np.float32)  # M=4, C=256, ds=4 -> D=16
    x = rng.normal(size=(2, 37, 16)).astype(np.float32)
    codes = encode(x, cent, chunk_elems=3000)  # several blocks plus a padded one
    assert codes.dtype == jnp.uint8 and codes.shape == (2, 37, 4)
    _assert_nearest(np.asarray(codes).reshape(-1, 4), x.reshape(-1, 16), cent)


def test_encode_matches_brute_force_per_head(native: bool) -> None:
    rng = np.random.default_rng(1)
    kv, m, c, ds = 3, 8, 16, 2
    cent = rng.normal(size=(kv, m, c, ds)).astype(np.float32)
    x = rng.normal(size=(2, kv, 11, m * ds)).astype(np.float32)  # [B, K, T, D]
    codes = np.asarray(encode(x, cent, chunk_elems=100))
    assert codes.shape == (2, kv, 11, m)
    for h in range(kv):
        _assert_nearest(codes[:, h].reshape(-1, m), x[:, h].reshape(-1, m * ds), cent[h])


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_gathers_and_fake_quantize_roundtrip(per_head: bool) -> None:
    rng = np.random.default_rng(2)
    cent = rng.normal(size=(2, 4, 8, 2) if per_head else (4, 8, 2)).astype(np.float32)
    codes = rng.integers(0, 8, size=(3, 2, 5, 4)).astype(np.uint8)  # [B, K, T, M]
    out = np.asarray(decode(codes, cent))
    assert out.shape == (3, 2, 5, 8)
    for b, h, t, mm in np.ndindex(*codes.shape):
        table = cent[h] if per_head else cent
        np.testing.assert_array_equal(out[b, h, t, 2 * mm : 2 * mm + 2], table[mm, codes[b, h, t, mm]])
    # decoded vectors are centroids, so they re-encode to themselves
    np.testing.assert_array_equal(np.asarray(encode(out, cent)), codes)
    np.testing.assert_array_equal(np.asarray(fake_quantize(out, cent)), out)


def test_codec_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="4096"):
        encode(np.zeros((3, 4)), np.zeros((2, 8192, 2)))
    with pytest.raises(ValueError, match="last dim"):
        encode(np.zeros((3, 6)), np.zeros((2, 16, 2)))
    with pytest.raises(ValueError, match="K=2"):
        encode(np.zeros((3, 5, 4)), np.zeros((2, 2, 16, 2)))
    with pytest.raises(ValueError, match="integers"):
        decode(np.zeros((3, 2)), np.zeros((2, 16, 2)))


def _non_increasing(history: np.ndarray) -> bool:
    """Objective histories [P, iters+1] never go up (tolerance: float32 rounding of the start value)."""
    h = np.asarray(history, np.float64)
    return bool(np.all(np.diff(h, axis=1) <= 1e-6 * h[:, :1] + 1e-12))


@pytest.mark.parametrize("init", ["random", "kmeans++"])
def test_kmeans_objective_never_increases(init: str, native: bool) -> None:
    x = jax.random.normal(jax.random.key(0), (3, 2000, 2)) * jnp.array([1.0, 5.0])
    cent, hist = kmeans(x, 32, 12, key=jax.random.key(1), init=init)
    assert cent.shape == (3, 32, 2) and hist.shape == (3, 13)
    assert _non_increasing(hist)
    assert np.all(np.asarray(hist[:, -1]) < 0.8 * np.asarray(hist[:, 0]))


def test_kmeans_empty_clusters_from_duplicates(native: bool) -> None:
    # 6 distinct points (3 with a little spread), each repeated: random init picks duplicate
    # centroids, whose clusters then go empty and must be re-seeded.
    rng = np.random.default_rng(3)
    base = rng.normal(size=(2, 6, 2)).astype(np.float32) * 10
    x = np.repeat(base, 50, axis=1)
    x[:, :150] += 0.05 * rng.normal(size=(2, 150, 2)).astype(np.float32)
    cent, hist = kmeans(x, 16, 15, key=jax.random.key(0))
    assert _non_increasing(hist)
    assert np.all(np.isfinite(np.asarray(cent)))
    # every distinct point ends up with a centroid on top of it
    d = np.sum((x[:, :, None] - np.asarray(cent)[:, None]) ** 2, -1).min(-1)
    assert d.max() < 0.1


def test_kmeans_split_reseeds_empty_clusters(native: bool) -> None:
    # Start with a duplicated centroid and one far away: both go empty and get split off the blob.
    x = jax.random.normal(jax.random.key(2), (1, 600, 2))
    mean = jnp.mean(x, axis=1)
    cent = jnp.stack([mean, mean, mean + 1e3], axis=1)  # [P=1, k=3, ds]
    rms = jnp.sqrt(jnp.mean(x**2, axis=(1, 2)))
    objectives = []
    for _ in range(12):
        cent, obj = _lloyd_step(x, cent, rms, native)
        objectives.append(float(obj[0]))
    assert all(b <= a * (1 + 1e-6) for a, b in itertools.pairwise(objectives))
    assert objectives[-1] < 0.6 * objectives[0]  # three clusters in use, not one
    assert np.abs(np.asarray(cent)).max() < 10


def test_kmeans_recovers_separated_clusters() -> None:
    rng = np.random.default_rng(4)
    centers = rng.permutation(np.stack(np.meshgrid(np.arange(4), np.arange(2)), -1).reshape(8, 2) * 20.0)
    centers = np.stack([centers, centers + 3.0]).astype(np.float32)  # P=2 problems, 8 clusters each
    labels = rng.integers(0, 8, size=(2, 800))
    x = np.take_along_axis(centers, labels[..., None], 1) + 0.1 * rng.normal(size=(2, 800, 2)).astype(
        np.float32
    )
    cent, _ = kmeans(x, 8, 10, key=jax.random.key(5), init="kmeans++")
    for p in range(2):
        dist = np.sqrt(((centers[p][:, None] - np.asarray(cent[p])[None]) ** 2).sum(-1))
        assert dist.min(1).max() < 0.05  # every true center has a centroid on it


@pytest.mark.parametrize("ds", [1, 2, 3, 4])
def test_tiled_assignment_equals_brute_force(ds: int, native: bool) -> None:
    # 1000 points: several tiles or kernel blocks and a ragged last one; ds 3 is the kernel's generic path.
    # 70 problems: more than one XLA tile of problems.
    x = jax.random.normal(jax.random.key(8), (70, 1000, ds))
    cent = jax.random.normal(jax.random.key(9), (70, 40, ds))
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=(1, 2)))
    assign, counts, sums, sse, gain = jax.jit(_assign, static_argnums=3)(x, cent, rms, native)
    xs = np.asarray(x, np.float64)
    d = np.sum((xs[:, :, None] - np.asarray(cent, np.float64)[:, None]) ** 2, axis=-1)  # [P, n, k]
    picked = np.take_along_axis(d, np.asarray(assign)[..., None].astype(np.int64), -1)[..., 0]
    assert np.all(picked <= d.min(-1) * (1 + 1e-5) + 1e-6)  # a nearest centroid (ties within rounding)
    assert np.mean(np.asarray(assign) == d.argmin(-1)) > 0.9999
    np.testing.assert_allclose(np.asarray(sse), d.min(-1).sum(-1), rtol=1e-5)
    one_hot = np.asarray(assign)[..., None] == np.arange(40)  # [P, n, k]
    np.testing.assert_array_equal(np.asarray(counts), one_hot.sum(1))
    np.testing.assert_allclose(np.asarray(sums), np.einsum("pnk,pnd->pkd", one_hot, xs), rtol=1e-5, atol=1e-4)
    if native:  # the kernel's split gains equal the XLA formula's
        means = jnp.where(counts[..., None] > 0, sums / jnp.maximum(counts, 1.0)[..., None], cent)
        alternating = jnp.where(jnp.arange(ds) % 2 == 0, 1.0, -1.0)
        delta = kmeans_module.SPLIT_EPS * (jnp.abs(means) + rms[:, None, None]) * alternating
        want = kmeans_module._split_gain(x, assign, means, delta)
        np.testing.assert_allclose(np.asarray(gain), np.asarray(want), rtol=1e-4, atol=1e-7)
    else:
        assert gain is None


def test_native_and_xla_kmeans_agree() -> None:
    """The same codebooks through either assignment path (same sample, same initial centroids)."""
    if kmeans_assign_cpu.native_kernel_error() is not None:
        pytest.skip(kmeans_assign_cpu.native_kernel_error())
    x = jax.random.normal(jax.random.key(11), (4, 3000, 2)) * jnp.array([1.0, 3.0])
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=(1, 2)))
    a = b = x[:, :64]
    for _ in range(8):
        (a, obj_a), (b, obj_b) = _lloyd_step(x, a, rms, True), _lloyd_step(x, b, rms, False)
        np.testing.assert_allclose(np.asarray(obj_a), np.asarray(obj_b), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_kmeans_stops_at_convergence() -> None:
    x = jax.random.normal(jax.random.key(10), (2, 3000, 2))
    _, full = kmeans(x, 8, 60, key=jax.random.key(1))
    _, early = kmeans(x, 8, 60, key=jax.random.key(1), tol=1e-3)
    assert early.shape[1] < full.shape[1] and _non_increasing(early)
    np.testing.assert_array_equal(np.asarray(early[:, :-1]), np.asarray(full[:, : early.shape[1] - 1]))
    last = np.asarray(early[:, -3:-1], np.float64).sum(0)  # the update that met the tolerance
    assert last[0] - last[1] <= 1e-3 * last[0]


def test_kmeans_subsampling_is_deterministic() -> None:
    x = jax.random.normal(jax.random.key(6), (2, 5000, 2))
    a, ha = kmeans(x, 4, 3, key=jax.random.key(7), max_points_per_centroid=100)
    b, hb = kmeans(x, 4, 3, key=jax.random.key(7), max_points_per_centroid=100)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(ha), np.asarray(hb))
    with pytest.raises(ValueError, match="k must be"):
        kmeans(x[:, :3], 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="init"):
        kmeans(x, 4, key=jax.random.key(0), init="bogus")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def small_kv() -> tuple[np.ndarray, np.ndarray]:
    """Calibration keys/values [L=2, N=64, K=2, D=8]."""
    rng = np.random.default_rng(8)
    return rng.normal(size=(2, 64, 2, 8)).astype(np.float32), rng.normal(size=(2, 64, 2, 8)).astype(
        np.float32
    )


@pytest.mark.parametrize(
    "granularity,layer_shape,stacked_shape",
    [
        ("shared", (4, 16, 2), (2, 4, 16, 2)),
        ("layer", (4, 16, 2), (2, 4, 16, 2)),
        ("layer_head", (2, 4, 16, 2), (2, 2, 4, 16, 2)),
    ],
)
def test_train_codebooks_layouts(
    small_kv, granularity: str, layer_shape: tuple, stacked_shape: tuple
) -> None:
    keys, values = small_kv
    cb = train_codebooks(
        keys, values, 2, 4, granularity, 3, key=jax.random.key(0), progress=False, model_fingerprint="m"
    )
    k1, v1 = cb.for_layer(1)
    assert k1.shape == v1.shape == layer_shape
    ks, vs = cb.stacked()
    assert ks.shape == vs.shape == stacked_shape
    np.testing.assert_array_equal(np.asarray(ks[1]), np.asarray(k1))
    assert cb.model_fingerprint == "m" and cb.metadata["key_mse"] > 0
    # the layer-1 codebook is what encodes layer-1 keys: [N, K, D] -> per-head layout [K, N, D]
    x = np.swapaxes(keys[1], 0, 1) if granularity == "layer_head" else keys[1]
    assert encode(x, k1).shape[-1] == 4
    # pytree: passes through jit, static fields survive
    total = jax.jit(lambda c: c.stacked()[0].sum() + c.ds)(cb)
    np.testing.assert_allclose(float(total), float(np.asarray(ks).sum()) + 2, rtol=1e-5)
    with pytest.raises(ValueError, match="layer"):
        cb.for_layer(2)


def test_codebooks_reject_bad_arguments(small_kv) -> None:
    keys, values = small_kv
    with pytest.raises(ValueError, match="bits must be in"):
        train_codebooks(keys, values, 2, 13, key=jax.random.key(0))
    with pytest.raises(ValueError, match="ds"):
        train_codebooks(keys, values, 3, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="granularity"):
        train_codebooks(keys, values, 2, 4, "head", key=jax.random.key(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key_centroids"):
        Codebooks(jnp.zeros((4, 16, 2)), jnp.zeros((4, 16, 2)), "layer", 2, 4, 8, 2, 2)


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Codebooks, Path]:
    """A small per-(layer, head) codebook saved under tmp_path/cb."""
    rng = np.random.default_rng(9)
    cb = Codebooks(
        jnp.asarray(rng.normal(size=(2, 2, 4, 16, 2)), jnp.float32),
        jnp.asarray(rng.normal(size=(2, 2, 4, 16, 2)), jnp.float32),
        "layer_head",
        2,
        4,
        8,
        2,
        2,
        {"model_fingerprint": "llama-a"},
    )
    return cb, save_codebooks(cb, tmp_path / "cb")


def test_save_load_roundtrip(saved, tmp_path: Path) -> None:
    cb, path = saved
    back = load_codebooks(path, expected_fingerprint="llama-a")
    np.testing.assert_array_equal(np.asarray(back.key_centroids), np.asarray(cb.key_centroids))
    np.testing.assert_array_equal(np.asarray(back.value_centroids), np.asarray(cb.value_centroids))
    assert (back.granularity, back.ds, back.bits, back.head_dim, back.metadata) == (
        cb.granularity,
        cb.ds,
        cb.bits,
        cb.head_dim,
        cb.metadata,
    )
    with pytest.raises(ValueError, match="already exists"):
        save_codebooks(cb, path)
    save_codebooks(back, path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cb"]


def test_load_fingerprint_mismatch(saved) -> None:
    _, path = saved
    with pytest.raises(ValueError, match="made for model 'llama-a', not 'llama-b'"):
        load_codebooks(path, expected_fingerprint="llama-b")


def test_load_missing_and_corrupt_files(saved, tmp_path: Path) -> None:
    _, path = saved
    with pytest.raises(ValueError, match="does not exist"):
        load_codebooks(tmp_path / "nope")
    meta_file = path / "codebooks.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "num_layers": 3}))
    with pytest.raises(ValueError, match="do not match"):
        load_codebooks(path)
    meta_file.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_codebooks(path)
    meta_file.unlink()
    with pytest.raises(ValueError, match=r"missing codebooks\.json"):
        load_codebooks(path)
    meta_file.write_text(json.dumps(meta))
    for f in (path / "arrays").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read arrays"):
        load_codebooks(path)


def test_save_failure_leaves_nothing(saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cb, _ = saved

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(codebooks_module.json, "dumps", broken)
    with pytest.raises(OSError, match="disk full"):
        save_codebooks(cb, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cb"]  # no partial or temp directory


def test_cache_bytes_arithmetic() -> None:
    t, l, kv, d, r = 32768, 32, 8, 128, 128
    ds2 = cache_bytes(t, l, kv, d, 2, 8, r)
    dense = 2 * l * kv * t * d * 2
    assert ds2["dense_bf16_bytes"] == dense
    assert ds2["codes_bytes"] == 2 * l * kv * (t - r) * 64
    assert ds2["window_bytes"] == 2 * l * kv * r * d * 2
    assert ds2["codebook_bytes"] == 2 * 64 * 256 * 2 * 4
    assert ds2["total_bytes"] == ds2["codes_bytes"] + ds2["window_bytes"] + ds2["codebook_bytes"]
    assert 3.9 < ds2["compression"] < 4.0 and 4.0 < ds2["bits_per_element"] < 4.1
    ds4 = cache_bytes(t, l, kv, d, 4, 8, r)
    assert 7.7 < ds4["compression"] < 8.0
    per_head = cache_bytes(t, l, kv, d, 4, 8, r, granularity="layer_head")
    assert per_head["codebook_bytes"] == 2 * l * kv * 32 * 256 * 4 * 4
    assert cache_bytes(100, 1, 1, d, 2, 8, r)["codes_bytes"] == 0  # all tokens still in the window


def test_wide_codes_are_uint16_nearest_and_roundtrip(native: bool) -> None:
    """10-bit codes (1,024 centroids): uint16 codes, the nearest centroid, decode/re-encode stable."""
    rng = np.random.default_rng(3)
    cent = rng.normal(size=(2, 1024, 4)).astype(np.float32)  # M=2, C=1024, ds=4 -> D=8
    x = rng.normal(size=(300, 8)).astype(np.float32)
    codes = np.asarray(encode(x, cent))
    assert codes.dtype == np.uint16 and codes.max() >= 256  # codes past one byte are kept
    _assert_nearest(codes, x, cent)
    out = np.asarray(decode(codes, cent))
    np.testing.assert_array_equal(np.asarray(encode(out, cent)), codes)


def test_ten_bit_codebooks_train_and_the_pq_cache_refuses_them() -> None:
    """train_codebooks makes 10-bit codebooks that fit better than 8-bit ones on the same vectors; the
    cache accounting counts their codes packed; the PQ cache (uint8 codes) refuses them clearly."""
    from jaxlongctx.cache_choice import PQKV

    rng = np.random.default_rng(5)
    keys, values = (rng.normal(size=(1, 4096, 1, 8)).astype(np.float32) for _ in range(2))
    cbs = {
        bits: train_codebooks(keys, values, 4, bits, "layer", 6, key=jax.random.key(0), progress=False)
        for bits in (8, 10)
    }
    assert cbs[10].stacked()[0].shape == (1, 2, 1024, 4)
    assert cbs[10].metadata["key_mse"] < 0.8 * cbs[8].metadata["key_mse"]
    ten = cache_bytes(1000, 1, 1, 8, 4, 10, 0)
    assert ten["codes_bytes"] == -(-2 * 1000 * 2 * 10 // 8)  # K and V, 2 codes per token, 10 bits each
    assert cache_bytes(1000, 1, 1, 8, 4, 6, 0)["codes_bytes"] == 2 * 1000 * 2  # a byte per code up to 8 bits
    with pytest.raises(ValueError, match="8-bit"):
        PQKV(cbs[10])
    PQKV(cbs[8])


def test_four_bit_codes_pack_two_a_byte() -> None:
    """Subspace 2p in byte p's low nibble, 2p + 1 in its high one; unpacking inverts packing; only codes
    of at most 16 centroids over an even M are packed."""
    from pallas_kernels.pq_codes import code_bytes, is_packed, pack_codes, packs, unpack_codes

    codes = jnp.asarray(np.random.default_rng(0).integers(0, 16, (3, 5, 8)), jnp.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (3, 5, 4) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(packed[..., 1], codes[..., 2] + 16 * codes[..., 3])
    np.testing.assert_array_equal(unpack_codes(packed), codes)
    assert packs(16, 8) and not packs(17, 8) and not packs(16, 7)
    assert code_bytes(16, 32) == 16 and code_bytes(256, 32) == 32
    cent = jnp.zeros((8, 16, 2))
    assert is_packed(packed, cent) and not is_packed(codes, cent)
