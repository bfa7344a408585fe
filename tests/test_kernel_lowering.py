"""CUDA lowering of every kernel configuration the defaults can pick, against an abstract H200 (no GPU needed).

Lowering runs the Pallas -> Triton IR lowering rules (power-of-two tensor sizes, supported ops, pointer
gathers); it does not run Triton's own PTX compiler, which only happens when XLA compiles on a real GPU.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels import grouped_matmul, pq_decode_attention
from pallas_kernels.grouped_matmul_kernel import GemmBlocks, choose_blocks, grouped_matmul_pallas
from pallas_kernels.pq_attention_kernel import PQBlocks, padded_group, pq_coded_partials_pallas
from pallas_kernels.pq_attention_kernel import choose_blocks as choose_pq_blocks

pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"), pytest.mark.jaxmin]

TRITON_CALL = "__gpu$xla.gpu.triton"
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "cuda"))


def _lower_for_h200(fn, *structs) -> str:
    """Trace and lower `fn` for CUDA on an abstract H200; returns the StableHLO text."""
    with use_abstract_mesh(H200):
        return jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


SCALAR = _sds((), jnp.int32)
# (G, T, K, N): smallest tiles, Llama-3.2-1B diagonal step (largest tiles), ragged edges
GEMM_SHAPES = [(2, 3, 5, 7), (16, 1152, 2048, 8192), (3, 40, 100, 70)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", GEMM_SHAPES)
def test_grouped_matmul_forward_and_vjp_lower(shape, dtype):
    groups, tokens, depth, width = shape

    def fwd_and_grads(x, w, first, active):
        loss = lambda x, w: jnp.sum(grouped_matmul(x, w, first, active, backend="pallas").astype(jnp.float32))  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    text = _lower_for_h200(fwd_and_grads, _sds((groups, tokens, depth), dtype), _sds((16, depth, width), dtype),
                           SCALAR, SCALAR)
    assert text.count(TRITON_CALL) == 3  # forward, dx (transposed weights), dw (transposed activations)


def test_grouped_matmul_defaults_are_powers_of_two():
    for rows, cols, depth in itertools.product([1, 17, 100, 5000], repeat=3):
        for dtype in (jnp.float32, jnp.bfloat16):
            b = choose_blocks(rows, cols, depth, dtype)
            assert all(n >= 16 and n & (n - 1) == 0 for n in (b.rows, b.cols, b.depth)), b


def test_non_power_of_two_gemm_block_is_rejected():
    """Proves the lowering really runs the Triton rules: interpret mode would accept a 48-row tile."""
    bad = GemmBlocks(rows=48, cols=32, depth=32, num_warps=4, num_stages=3)
    fn = lambda x, w: grouped_matmul_pallas(x, w, 0, 2, blocks=bad)  # noqa: E731
    with pytest.raises(ValueError, match="power of 2"):
        _lower_for_h200(fn, _sds((2, 96, 64), jnp.float32), _sds((2, 64, 64), jnp.float32))


def _pq_structs(batch, kv_heads, group, head_dim, sub_dim, capacity, window, per_head, q_dtype, cent_dtype):
    subspaces = head_dim // sub_dim
    cent = (kv_heads, subspaces, 256, sub_dim) if per_head else (subspaces, 256, sub_dim)
    codes = _sds((batch, kv_heads, capacity, subspaces), jnp.uint8)
    res = _sds((batch, kv_heads, window, head_dim), q_dtype)
    lengths = _sds((batch,), jnp.int32)
    return (_sds((batch, kv_heads * group, head_dim), q_dtype), codes, codes, _sds(cent, cent_dtype),
            _sds(cent, cent_dtype), lengths, res, res, lengths)


# Every (head_dim, ds, group) the library targets; group 3 pads to 4, 2 and 16 complete the tile sizes.
PQ_CONFIGS = list(itertools.product([64, 128], [2, 4], [1, 2, 3, 4, 8, 16]))


@pytest.mark.parametrize("head_dim, sub_dim, group", PQ_CONFIGS)
def test_pq_attention_lowers(head_dim, sub_dim, group):
    per_head = group % 2 == 0  # alternate codebook sharing and dtypes across the sweep
    q_dtype = jnp.bfloat16 if sub_dim == 4 else jnp.float32
    structs = _pq_structs(3, 8, group, head_dim, sub_dim, 1000, 128, per_head, q_dtype, q_dtype)
    fn = lambda *a: pq_decode_attention(*a, head_dim ** -0.5, backend="pallas")  # noqa: E731
    assert _lower_for_h200(fn, *structs).count(TRITON_CALL) == 1


def test_pq_default_tiles_cover_every_size():
    picked = {choose_pq_blocks(1, 8, padded_group(g), 131072, d, d // ds).tokens for d, ds, g in PQ_CONFIGS}
    assert picked == {16, 32, 64, 128}
    for d, ds, g in PQ_CONFIGS:
        for batch, capacity in ((1, 1), (4, 128), (1, 131072)):
            b = choose_pq_blocks(batch, 8, padded_group(g), capacity, d, d // ds)
            assert b.num_splits * b.tiles_per_split * b.tokens >= capacity


def test_non_power_of_two_token_tile_is_rejected():
    bad = PQBlocks(tokens=24, tiles_per_split=2, num_splits=2, num_warps=4)
    fn = lambda lut, kc, vc, cent, n: pq_coded_partials_pallas(lut, kc, vc, cent, n, blocks=bad)  # noqa: E731
    codes = _sds((1, 2, 96, 32), jnp.uint8)
    with pytest.raises(ValueError, match="power of 2"):
        _lower_for_h200(fn, _sds((1, 2, 4, 32, 256), jnp.float32), codes, codes,
                        _sds((1, 32, 256, 2), jnp.float32), _sds((1,), jnp.int32))
