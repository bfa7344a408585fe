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
from pallas_kernels.pq_codes import code_bytes

pytestmark = [
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
    pytest.mark.jaxmin,
]

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
        loss = lambda x, w: jnp.sum(grouped_matmul(x, w, first, active, backend="pallas").astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    text = _lower_for_h200(
        fwd_and_grads, _sds((groups, tokens, depth), dtype), _sds((16, depth, width), dtype), SCALAR, SCALAR
    )
    assert text.count(TRITON_CALL) == 3  # forward, dx (transposed weights), dw (transposed activations)


def test_grouped_matmul_defaults_are_powers_of_two():
    for rows, cols, depth in itertools.product([1, 17, 100, 5000], repeat=3):
        for dtype in (jnp.float32, jnp.bfloat16):
            b = choose_blocks(rows, cols, depth, dtype)
            assert all(n >= 16 and n & (n - 1) == 0 for n in (b.rows, b.cols, b.depth)), b


def test_non_power_of_two_gemm_block_is_rejected():
    """Proves the lowering really runs the Triton rules: interpret mode would accept a 48-row tile."""
    bad = GemmBlocks(rows=48, cols=32, depth=32, num_warps=4, num_stages=3)
    fn = lambda x, w: grouped_matmul_pallas(x, w, 0, 2, blocks=bad)
    with pytest.raises(ValueError, match="power of 2"):
        _lower_for_h200(fn, _sds((2, 96, 64), jnp.float32), _sds((2, 64, 64), jnp.float32))


def _pq_structs(
    batch, kv_heads, group, head_dim, sub_dim, capacity, window, per_head, q_dtype, cent_dtype, centroids=256
):
    """Abstract arguments of pq_decode_attention; codes of at most 16 centroids packed two a byte."""
    subspaces = head_dim // sub_dim
    cent = (kv_heads, subspaces, centroids, sub_dim) if per_head else (subspaces, centroids, sub_dim)
    codes = _sds((batch, kv_heads, capacity, code_bytes(centroids, subspaces)), jnp.uint8)
    res = _sds((batch, kv_heads, window, head_dim), q_dtype)
    lengths = _sds((batch,), jnp.int32)
    return (
        _sds((batch, kv_heads * group, head_dim), q_dtype),
        codes,
        codes,
        _sds(cent, cent_dtype),
        _sds(cent, cent_dtype),
        lengths,
        res,
        res,
        lengths,
    )


# Every (head_dim, ds, group) the library targets; group 3 pads to 4, 2 and 16 complete the tile sizes.
PQ_CONFIGS = list(itertools.product([64, 128], [2, 4], [1, 2, 3, 4, 8, 16]))


@pytest.mark.parametrize("head_dim, sub_dim, group", PQ_CONFIGS)
def test_pq_attention_lowers(head_dim, sub_dim, group):
    per_head = group % 2 == 0  # alternate codebook sharing and dtypes across the sweep
    q_dtype = jnp.bfloat16 if sub_dim == 4 else jnp.float32
    structs = _pq_structs(3, 8, group, head_dim, sub_dim, 1000, 128, per_head, q_dtype, q_dtype)
    fn = lambda *a: pq_decode_attention(*a, head_dim**-0.5, backend="pallas")
    assert _lower_for_h200(fn, *structs).count(TRITON_CALL) == 1


@pytest.mark.parametrize("head_dim, sub_dim, group", [(64, 2, 3), (128, 2, 8), (64, 4, 1), (128, 4, 16)])
def test_pq_attention_reads_packed_codes_on_the_gpu(head_dim, sub_dim, group):
    """4-bit codes two a byte go into the Triton kernel as they are: no unpacked [.., M] code array."""
    structs = _pq_structs(2, 8, group, head_dim, sub_dim, 1000, 128, group > 1, jnp.bfloat16, jnp.float32, 16)
    fn = lambda *a: pq_decode_attention(*a, head_dim**-0.5, backend="pallas")
    text = _lower_for_h200(fn, *structs)
    assert text.count(TRITON_CALL) == 1
    packed, unpacked = (f"tensor<2x8x1000x{m}xui8>" for m in (head_dim // sub_dim // 2, head_dim // sub_dim))
    assert packed in text and unpacked not in text


def test_pq_default_tiles_cover_every_size():
    picked = {choose_pq_blocks(1, 8, padded_group(g), 131072, d, d // ds).tokens for d, ds, g in PQ_CONFIGS}
    assert picked == {16, 32, 64, 128}
    for d, ds, g in PQ_CONFIGS:
        for batch, capacity in ((1, 1), (4, 128), (1, 131072)):
            b = choose_pq_blocks(batch, 8, padded_group(g), capacity, d, d // ds)
            assert b.num_splits * b.tiles_per_split * b.tokens >= capacity


def test_non_power_of_two_token_tile_is_rejected():
    bad = PQBlocks(tokens=24, tiles_per_split=2, num_splits=2, num_warps=4)
    fn = lambda lut, kc, vc, cent, n: pq_coded_partials_pallas(lut, kc, vc, cent, n, blocks=bad)
    codes = _sds((1, 2, 96, 32), jnp.uint8)
    with pytest.raises(ValueError, match="power of 2"):
        _lower_for_h200(
            fn,
            _sds((1, 2, 4, 32, 256), jnp.float32),
            codes,
            codes,
            _sds((1, 32, 256, 2), jnp.float32),
            _sds((1,), jnp.int32),
        )


def _abstract_armt(dtype):
    """An ARMT model (4 layers, d 256, 8/2 heads, segments of 64 + 16 memory rows) whose parameters are
    shape-only, and its abstract parameters, an empty pipeline for 2 rows and one segment."""
    from flax import nnx

    from jaxlongctx.armt import ARMTConfig, ARMTModel, MemoryState
    from jaxlongctx.armt.diagonal import Pipeline
    from jaxlongctx.armt.params import MemoryParams
    from jaxlongctx.armt.segments import Segments
    from jaxlongctx.checkpoint import abstract_model
    from jaxlongctx.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
    )
    armt_cfg = ARMTConfig(segment_size=64, num_mem_tokens=16, d_mem=32)
    memory = nnx.eval_shape(
        lambda: MemoryParams(
            armt_cfg, cfg.num_layers, cfg.hidden_size, 1.0, dtype=dtype, key=jax.random.key(0)
        )
    )
    model = ARMTModel(abstract_model(cfg, dtype), armt_cfg, memory)
    params = jax.tree.map(lambda x: _sds(x.shape, x.dtype), model.params)
    L, b, dk = cfg.num_layers, 2, armt_cfg.d_key
    pipe = Pipeline(
        _sds((L, b, armt_cfg.rows, cfg.hidden_size), dtype),
        _sds((L, b), jnp.int32),
        _sds((L, b), jnp.bool_),
        MemoryState(_sds((L, b, dk, cfg.hidden_size), jnp.float32), _sds((L, b, dk), jnp.float32)),
    )
    segs = Segments(
        _sds((1, b, armt_cfg.segment_size), jnp.int32), _sds((1, b), jnp.int32), _sds((1, b), jnp.bool_)
    )
    return model, params, pipe, segs


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_grouped_diagonal_step_lowers(dtype):
    """A whole diagonal step with every product on the Pallas grouped GEMM (7 layer + 4 memory products)
    and its gradient (two more kernels per product), for a full step and a ramp-down step (first layer 1)."""
    from jaxlongctx.armt.cpu_execution import CPUExecution
    from jaxlongctx.armt.diagonal import _run_block
    from jaxlongctx.armt.projections import DiagonalProjections

    model, params, pipe, segs = _abstract_armt(dtype)
    pallas = DiagonalProjections("grouped_matmul", "pallas")
    full, ramp_down = ("full", 1), ("steps", ((1, 4, False),))

    def loss(params, pipe, segs, block):
        out, logits = _run_block(model, block, CPUExecution(), pallas, params, pipe, segs)
        return jnp.sum(logits) + jnp.sum(out.memory.A)

    for block in (full, ramp_down):
        step = lambda p, q, s, block=block: _run_block(model, block, CPUExecution(), pallas, p, q, s)
        assert _lower_for_h200(step, params, pipe, segs).count(TRITON_CALL) == 11
    grad = lambda p, q, s: jax.grad(loss)(p, q, s, full)
    assert _lower_for_h200(grad, params, pipe, segs).count(TRITON_CALL) == 33
