"""PQ decode attention: Pallas interpret mode and the XLA path against the dequantize-then-attend oracle."""

from __future__ import annotations

import itertools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native_build, pq_attention, pq_attention_cpu, pq_decode_attention
from pallas_kernels.pq_attention import lookup_tables, merge_partials
from pallas_kernels.pq_attention_kernel import PQBlocks, pq_coded_partials_pallas
from pallas_kernels.pq_attention_reference import pq_decode_attention_reference
from pallas_kernels.pq_codes import is_packed, pack_codes, unpack_codes

pytestmark = [
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
    pytest.mark.jaxmin,
]

CENTROIDS = 256


def _case(
    *,
    batch=3,
    kv_heads=2,
    group=4,
    head_dim=64,
    sub_dim=2,
    capacity=50,
    window=8,
    lengths=(0, 23, 50),
    res_lengths=(1, 8, 3),
    per_head=False,
    dtype=jnp.float32,
    seed=0,
    centroids=CENTROIDS,
    packed=False,
):
    """Random PQ cache + query; returns the positional arguments of pq_decode_attention (scale last);
    `packed`: 4-bit codes two a byte, as the PQ cache stores them."""
    rng = np.random.default_rng(seed)
    subspaces = head_dim // sub_dim
    cent_shape = (kv_heads, subspaces, centroids, sub_dim) if per_head else (subspaces, centroids, sub_dim)
    arr = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    pack = pack_codes if packed else lambda c: c
    codes = lambda: pack(
        jnp.asarray(rng.integers(0, centroids, (batch, kv_heads, capacity, subspaces)), jnp.uint8)
    )
    return (
        arr((batch, kv_heads * group, head_dim)),
        codes(),
        codes(),
        arr(cent_shape),
        arr(cent_shape),
        jnp.asarray(lengths, jnp.int32),
        arr((batch, kv_heads, window, head_dim)),
        arr((batch, kv_heads, window, head_dim)),
        jnp.asarray(res_lengths, jnp.int32),
        head_dim**-0.5,
    )


def _run(args, backend):
    fn = jax.jit(lambda *a: pq_decode_attention(*a, args[-1], backend=backend))
    return fn(*args[:-1])


@jax.jit
def _oracle(q, k_codes, v_codes, k_cent, *args):
    """The dequantize-then-attend reference, on unpacked codes."""
    if is_packed(k_codes, k_cent):
        k_codes, v_codes = unpack_codes(k_codes), unpack_codes(v_codes)
    return pq_decode_attention_reference(q, k_codes, v_codes, k_cent, *args)


def _check(args, backend, tol=2e-5):
    got, want = _run(args, backend), _oracle(*args)
    assert got.shape == want.shape and got.dtype == args[0].dtype
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


SWEEP = [  # (head_dim, sub_dim, group, per_head): every value of each axis appears at least once
    (64, 2, 1, False),
    (64, 4, 4, True),
    (128, 2, 8, False),
    (128, 4, 4, False),
    (64, 2, 8, True),
]


@pytest.mark.parametrize("head_dim, sub_dim, group, per_head", SWEEP)
def test_interpret_matches_oracle(head_dim, sub_dim, group, per_head):
    # batch 3 with mixed lengths: empty, not a multiple of any tile, full; residual 1, R and in between
    _check(
        _case(head_dim=head_dim, sub_dim=sub_dim, group=group, per_head=per_head, kv_heads=1 + per_head),
        "interpret",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_dim, sub_dim, group, per_head", list(itertools.product([64, 128], [2, 4], [1, 4, 8], [False, True]))
)
def test_interpret_matches_oracle_full_sweep(head_dim, sub_dim, group, per_head):
    _check(
        _case(
            head_dim=head_dim,
            sub_dim=sub_dim,
            group=group,
            per_head=per_head,
            capacity=77,
            lengths=(77, 0, 45),
            res_lengths=(8, 1, 0),
        ),
        "interpret",
    )


@pytest.mark.parametrize("head_dim, sub_dim, group, per_head", SWEEP)
def test_xla_path_matches_oracle(head_dim, sub_dim, group, per_head):
    _check(_case(head_dim=head_dim, sub_dim=sub_dim, group=group, per_head=per_head), "xla")


def _require_native():
    """Skip only where no C++ compiler exists; a compiler whose build fails is a test failure."""
    error = pq_attention_cpu.native_kernel_error()
    if error is not None and error.startswith("no C++ compiler"):
        pytest.skip(error)
    assert error is None, error


def _native_case(head_dim, sub_dim, group, per_head):
    return {
        "head_dim": head_dim,
        "sub_dim": sub_dim,
        "group": group,
        "per_head": per_head,
        "kv_heads": 1 + per_head,
    }


NATIVE_CASES = [  # one lane block and two; SmolLM2's group (3 of 4 lanes) on long rows; an odd M (tail paths)
    _native_case(*SWEEP[0]),
    _native_case(*SWEEP[2]),
    # several 256-token chunks per split and several splits, rows empty, odd and full
    {"group": 3, "kv_heads": 3, "capacity": 3000, "lengths": (0, 2999, 1301), "res_lengths": (5, 0, 128)},
    {"head_dim": 48, "sub_dim": 16, "group": 5, "kv_heads": 2, "per_head": True},
]


# Packed 4-bit codes (at most 16 centroids) take the kernel's register path: ds 1, 2 and 4 (32, 16 and 8
# code bytes; 12 at head dim 48 takes the scalar transpose); 1 to 4 heads in a lane block; rows ending
# inside a 16-token tile, several 128-token chunks per split, an empty row; 16 centroids and fewer.
SMALL_CODEBOOK_CASES = [
    {"centroids": 16, "sub_dim": 2, "group": 3, "kv_heads": 3, "capacity": 3000, "lengths": (0, 2999, 1301)},
    {"centroids": 16, "sub_dim": 1, "group": 5, "kv_heads": 2, "per_head": True, "capacity": 300},
    {"centroids": 11, "sub_dim": 4, "group": 2, "capacity": 129, "lengths": (129, 17, 1)},
    {"centroids": 16, "sub_dim": 2, "group": 8, "head_dim": 128, "capacity": 200, "lengths": (200, 0, 15)},
    {"centroids": 7, "sub_dim": 2, "group": 1, "head_dim": 48, "capacity": 70, "lengths": (70, 33, 16)},
]


@pytest.mark.parametrize("case", SMALL_CODEBOOK_CASES)
def test_native_register_path_matches_oracle(case):
    _require_native()
    _check(_case(window=128, res_lengths=(5, 0, 128), packed=True, **case), "native", 5e-5)


@pytest.mark.parametrize("backend", ["native", "xla", "interpret"])
def test_packed_codes_on_every_path(backend):
    """Every backend takes packed codes: read as they are by native (ds 1, 2, 4) and Pallas, unpacked
    first by XLA and by native at ds 8; the same codes one a byte give the same output."""
    if backend == "native":
        _require_native()
    for sub_dim in (2, 8) if backend == "native" else (2,):
        args = _case(centroids=16, sub_dim=sub_dim, group=3, kv_heads=3, capacity=40, lengths=(40, 7, 0))
        packed = (args[0], pack_codes(args[1]), pack_codes(args[2]), *args[3:])
        _check(packed, backend)
        np.testing.assert_allclose(_run(packed, backend), _run(args, backend), atol=2e-5, rtol=2e-5)


def _check_bf16_register_path(args, sub_dim):
    """bf16 queries over packed ds 1 and 2 codes: where the CPU has AVX512-BF16 the kernel rounds q, the
    centroids and the softmax weights to bf16 (as the model's bf16 attention does) and sums in float32:
    within the weights' rounding of the oracle on bf16 q and centroids, and not the float32 path."""
    q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale = args
    to_bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    run = lambda q: pq_attention_cpu.pq_decode_attention_native(
        q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale
    )
    got = np.asarray(run(q.astype(jnp.bfloat16)))  # float32 out: no rounding of the result
    rounded = (to_bf16(q), k_codes, v_codes, to_bf16(k_cent), to_bf16(v_cent), *args[5:])
    want = np.asarray(_oracle(*rounded))
    # each weight is off by at most 2^-9 of itself, in the coded partial and in its log-sum-exp
    bound = 2.0**-7 * float(jnp.abs(v_cent).max())
    assert np.all(np.isfinite(got)) and np.abs(got - want).max() <= bound
    float32_path = np.asarray(run(to_bf16(q)))
    if pq_attention_cpu.bf16_register_path(sub_dim):
        assert np.abs(got - float32_path).max() > 1e-6
    else:
        np.testing.assert_array_equal(got, float32_path)


@pytest.mark.parametrize("sub_dim", [1, 2])
def test_native_bf16_register_path(sub_dim):
    _require_native()
    case = _case(
        centroids=16,
        sub_dim=sub_dim,
        group=3,
        kv_heads=3,
        capacity=700,
        lengths=(700, 17, 0),
        window=128,
        res_lengths=(5, 0, 128),
        packed=True,
    )
    _check_bf16_register_path(case, sub_dim)


def _rising_keys_case(sub_dim):
    """4-bit codes whose scores grow along 2K-token rows (the running max moves chunk after chunk)."""
    q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale = _case(
        group=3,
        kv_heads=3,
        capacity=2048,
        lengths=(2048, 1000, 2047),
        centroids=16,
        sub_dim=sub_dim,
        packed=True,
    )
    ramp = jnp.arange(k_codes.shape[2], dtype=jnp.int32)[None, None, :, None] * 16 // k_codes.shape[2]
    k_cent = k_cent + jnp.arange(16, dtype=jnp.float32)[None, :, None] * 0.8
    k_codes = pack_codes(jnp.broadcast_to(ramp, (*k_codes.shape[:3], 2 * k_codes.shape[3])))
    return q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale


def test_native_register_path_with_moving_max():
    """The register path rescales its sums per chunk, in float32 and in bf16."""
    _require_native()
    _check(_rising_keys_case(2), "native", 1e-4)
    for sub_dim in (1, 2):
        _check_bf16_register_path(_rising_keys_case(sub_dim), sub_dim)


@pytest.mark.parametrize("case", NATIVE_CASES)
def test_native_path_matches_oracle(case):
    _require_native()
    _check(_case(window=128 if "res_lengths" in case else 8, **case), "native")


@pytest.mark.slow
@pytest.mark.parametrize("head_dim, sub_dim, group, per_head", SWEEP)
def test_native_path_matches_oracle_sweep(head_dim, sub_dim, group, per_head):
    _require_native()
    _check(_case(**_native_case(head_dim, sub_dim, group, per_head)), "native")


def test_native_long_rows_with_moving_max():
    """Keys whose scores grow along the row: every chunk raises the running max (rescaled histogram)."""
    _require_native()
    q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale = _case(
        group=3, kv_heads=3, capacity=2048, lengths=(2048, 1000, 2047)
    )
    ramp = jnp.arange(k_codes.shape[2], dtype=jnp.int32)[None, None, :, None] * 256 // k_codes.shape[2]
    k_cent = k_cent + jnp.arange(256, dtype=jnp.float32)[None, :, None] * 0.05  # larger code, larger key
    k_codes = jnp.broadcast_to(ramp, k_codes.shape).astype(jnp.uint8)
    _check((q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale), "native", 1e-4)


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_layer_of_stacked_codes_equals_its_slice(backend):
    """`layer=`: every layer's codes `[L, B, K, T, M]` in one buffer (read in place by the native kernel,
    sliced by the others) give the answer of that layer's codes alone."""
    if backend == "native":
        _require_native()
    q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale = _case(
        group=3, kv_heads=3, capacity=700, lengths=(700, 3, 0)
    )
    rng = np.random.default_rng(3)
    stacks = [
        jnp.asarray(rng.integers(0, 256, (3, *c.shape)), jnp.uint8).at[1].set(c) for c in (k_codes, v_codes)
    ]
    rest = (k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale)
    want = jax.jit(lambda: pq_decode_attention(q, k_codes, v_codes, *rest, backend=backend))()
    run = jax.jit(lambda i: pq_decode_attention(q, *stacks, *rest, backend=backend, layer=i))
    np.testing.assert_allclose(np.asarray(run(1)), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(run(2)), np.asarray(want))
    with pytest.raises(ValueError, match="with a layer"):
        pq_decode_attention(q, k_codes, v_codes, *rest, backend=backend, layer=0)


def test_native_bf16_inputs():
    _require_native()
    _check(_case(dtype=jnp.bfloat16, group=3, kv_heads=3, capacity=700, lengths=(700, 3, 0)), "native", 2e-2)


def test_auto_backend_on_cpu(monkeypatch):
    """auto is the native kernel on CPU when it builds and falls back to XLA when it cannot."""
    _require_native()
    assert pq_attention._resolve_pq_backend("auto") == "native"
    monkeypatch.setattr(pq_attention, "native_kernel_error", lambda: "no C++ compiler 'c++' on PATH")
    assert pq_attention._resolve_pq_backend("auto") == "xla"
    with pytest.raises(ValueError, match="backend 'native' is unavailable: no C\\+\\+ compiler"):
        pq_attention._resolve_pq_backend("native")


def test_native_kernel_reports_a_missing_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert (
        pq_attention_cpu.native_kernel_error.__wrapped__()
        == "no C++ compiler 'no-such-compiler-xyz' on PATH (set CXX)"
    )


@pytest.mark.slow
def test_native_build_is_cached(tmp_path, monkeypatch):
    """A fresh cache builds once; the second build call reuses the library."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("JAXLONGCTX_KERNEL_CACHE", str(tmp_path))
    compiler = os.environ.get("CXX", "g++")
    lib = native_build.build(pq_attention_cpu.SOURCE, compiler)
    stamp = lib.stat().st_mtime_ns
    assert native_build.build(pq_attention_cpu.SOURCE, compiler) == lib and lib.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary file left behind


@pytest.mark.parametrize("backend", ["xla", "interpret", "native"])
def test_edge_lengths(backend):
    if backend == "native":
        _require_native()
    # no coded tokens but a full window; everything empty -> zeros (no NaN); non-power-of-two group
    _check(_case(lengths=(0, 0, 0), res_lengths=(8, 8, 8)), backend)
    _check(_case(group=3, lengths=(50, 7, 1), res_lengths=(0, 0, 8)), backend)
    empty = _case(lengths=(0, 0, 0), res_lengths=(0, 0, 0))
    np.testing.assert_array_equal(_run(empty, backend), 0.0)
    _check(_case(capacity=0, lengths=(0, 0, 0)), backend)  # code buffer not allocated yet


def test_interpret_bf16_inputs():
    _check(_case(dtype=jnp.bfloat16, per_head=True, kv_heads=2), "interpret", tol=2e-2)


def test_split_k_tiling_and_merge():
    """Several tiles per split and several splits, with lengths ending mid-tile and mid-split."""
    q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, _, scale = _case(
        capacity=100, lengths=(100, 37, 64), per_head=True
    )
    empty = jnp.zeros((3,), jnp.int32)
    want = pq_decode_attention_reference(
        q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, empty, scale
    )
    lut = lookup_tables(q, k_cent, 2, 4, scale)  # [B K G M C]
    outs, lses = pq_coded_partials_pallas(
        lut,
        k_codes,
        v_codes,
        v_cent,
        lengths,
        interpret=True,
        blocks=PQBlocks(tokens=16, tiles_per_split=2, num_splits=4, num_warps=4),
    )
    got = merge_partials(outs.reshape(*outs.shape[:4], 64), lses).reshape(want.shape)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_split_k_tiling_reads_packed_codes():
    """The Pallas kernel on codes two a byte, several tiles and splits: the same partials as unpacked."""
    q, k_codes, v_codes, k_cent, v_cent, lengths, *_, scale = _case(
        capacity=100, lengths=(100, 37, 64), per_head=True, centroids=16, sub_dim=4
    )
    lut = lookup_tables(q, k_cent, 2, 4, scale)  # [B K G M C]
    blocks = PQBlocks(tokens=16, tiles_per_split=2, num_splits=4, num_warps=4)
    run = lambda kc, vc: pq_coded_partials_pallas(lut, kc, vc, v_cent, lengths, interpret=True, blocks=blocks)
    (want_out, want_lse), (got_out, got_lse) = (
        run(k_codes, v_codes),
        run(pack_codes(k_codes), pack_codes(v_codes)),
    )
    np.testing.assert_allclose(got_out, want_out, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(got_lse, want_lse, atol=1e-6, rtol=1e-6)  # the sums in another order
    with pytest.raises(ValueError, match="do not hold"):
        run(k_codes[..., :3], v_codes[..., :3])


def test_bad_backend_and_inputs():
    args = _case()
    with pytest.raises(ValueError, match="'cuda'"):
        pq_decode_attention(*args, backend="cuda")
    q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale = args
    bad = {
        "k_codes must be uint8": (q, k_codes.astype(jnp.int32), v_codes, k_cent, v_cent, lengths),
        "multiple of kv heads": (q[:, :7], k_codes, v_codes, k_cent, v_cent, lengths),
        "v_cent must be": (q, k_codes, v_codes, k_cent, v_cent[:, :, :1], lengths),
        "lengths must be an integer vector": (q, k_codes, v_codes, k_cent, v_cent, lengths[:2]),
    }
    for match, head in bad.items():
        with pytest.raises(ValueError, match=match):
            pq_decode_attention(*head, k_res, v_res, res_lengths, scale, backend="xla")
    q6, kc6, vc6, kcent6, vcent6, *rest = _case(head_dim=48, sub_dim=2)  # M = 24: not a power of two
    with pytest.raises(ValueError, match="power-of-two subspaces M"):
        pq_decode_attention(q6, kc6, vc6, kcent6, vcent6, *rest, backend="interpret")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize(
    "head_dim, sub_dim, group, per_head", list(itertools.product([64, 128], [2, 4], [1, 4, 8], [False, True]))
)
def test_gpu_pallas_matches_oracle(head_dim, sub_dim, group, per_head):
    _check(
        _case(
            head_dim=head_dim,
            sub_dim=sub_dim,
            group=group,
            per_head=per_head,
            kv_heads=2,
            capacity=3000,
            lengths=(3000, 0, 1234),
            window=128,
            res_lengths=(128, 1, 77),
        ),
        "pallas",
        tol=1e-4,
    )
