"""ARMT: sequential schedule vs a float64 numpy spec implementation; diagonal vs sequential."""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_armt_utils import VOCAB, make_armt, numpy_armt, shared_armt, tiny_config

from jaxlongctx.armt import ARMTConfig, ARMTModel, DiagonalProjections
from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS, CPUExecution
from jaxlongctx.armt.diagonal import computed_cells, fixed_buffer_waste, plan
from jaxlongctx.armt.segments import compact, segment
from jaxlongctx.armt.sequential import TRACES
from jaxlongctx.model.model import Model

RNG = np.random.default_rng(0)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_sequential_matches_numpy_spec():
    armt = shared_armt()
    ids = RNG.integers(0, VOCAB, 29)  # 3 full segments + a short one of 5 tokens
    logits, state = armt.run(ids[None], schedule="sequential")
    ref, A, z = numpy_armt(armt, ids)
    assert np.abs(np.asarray(logits[0]) - ref).max() <= 1e-4
    for l in range(armt.config.num_layers):
        assert _rel(state.A[l, 0], A[l]) <= 1e-4 and _rel(state.z[l, 0], z[l]) <= 1e-4
    # the memory matters: later segments differ from a run without memory, the first one does not
    plain, _, _ = numpy_armt(armt, ids, use_memory=False)
    assert np.abs(plain[:8] - ref[:8]).max() < 1e-9
    assert np.abs(plain[8:] - ref[8:]).max() > 1e-2


@pytest.mark.parametrize("length", [16, 24, 45, 90], ids=["S<L", "S=L", "S>L-short-last", "S>L-chunked"])
def test_diagonal_equals_sequential(length):
    armt = shared_armt()
    ids = RNG.integers(0, VOCAB, (1, length))
    ls, ss = armt.run(ids, schedule="sequential")
    ld, sd = armt.run(ids, schedule="diagonal")
    assert ls.shape == (1, length, VOCAB)
    assert float(jnp.abs(ls - ld).max()) <= 1e-4
    assert _rel(sd.A, ss.A) <= 1e-5 and _rel(sd.z, ss.z) <= 1e-5
    assert float(jnp.abs(ss.A).max()) > 0  # the memory was written


def test_batch_with_padding_equals_rows_alone():
    armt = shared_armt()
    lengths = [37, 8, 20]
    ids = RNG.integers(0, VOCAB, (3, 37))
    mask = np.arange(37)[None] < np.asarray(lengths)[:, None]
    ld, sd = armt.run(ids, mask, schedule="diagonal")
    ls, ss = armt.run(ids, mask, schedule="sequential")
    assert float(jnp.abs(ls - ld).max()) <= 1e-4
    assert _rel(sd.A, ss.A) <= 1e-5
    for r, n in enumerate(lengths):
        alone, st = armt.run(ids[r : r + 1, :n], schedule="sequential")
        assert float(jnp.abs(ld[r, :n] - alone[0]).max()) <= 1e-4
        assert n == 37 or float(jnp.abs(ld[r, n:]).max()) == 0.0
        assert _rel(sd.A[:, r], st.A[:, 0]) <= 1e-5  # padding segments never wrote the memory


def test_left_padding_is_the_row_alone():
    armt = shared_armt()
    ids = RNG.integers(0, VOCAB, (1, 21))
    mask = np.arange(21)[None] >= 4
    got = armt(ids, mask)
    alone = armt(ids[:, 4:], schedule="sequential")
    assert float(jnp.abs(got[0, 4:] - alone[0]).max()) <= 1e-4


def test_gradients_match():
    armt = shared_armt()
    ids = RNG.integers(0, VOCAB, (1, 30))  # ramp-up, one full step, ramp-down
    segs = segment(*compact(ids, np.ones(ids.shape, bool))[:2], armt.armt.segment_size)

    def loss(params, schedule):
        _, logits = armt.run_segments(params, segs, schedule)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(segs.ids)[..., None], -1))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    gs, gd = grad(armt.params, "sequential"), grad(armt.params, "diagonal")
    for a, b in zip(jax.tree.leaves(gd), jax.tree.leaves(gs)):
        assert _rel(a, b) <= 1e-4
    mem_grads = jax.tree.leaves(gs[1])
    assert all(float(jnp.abs(g).max()) > 0 for g in mem_grads)


def test_no_recompilation_across_lengths():
    armt = shared_armt()
    TRACES.clear()
    for length in (25, 40, 63, 88, 130):  # 4 to 17 segments: ramp, 8-chunks, single steps, drain
        armt(RNG.integers(0, VOCAB, (1, length)))
    diagonal = sum(v for k, v in TRACES.items() if k != "sequential")
    assert diagonal <= 4, TRACES  # ramp-up, full chunk of 8, single full step, ramp-down
    TRACES.clear()
    armt(RNG.integers(0, VOCAB, (1, 101)))
    assert not TRACES


def test_cpu_execution_choices_agree():
    """Diagonals batched or cell by cell, and the sequential-order shortcut the default takes on CPU
    for inputs with few segments, all give the sequential schedule's logits and memory."""
    armt = make_armt()  # 3 layers: the default shortcut applies below 3 * 3 segments
    cases = {
        "batched": PIPELINE_ALWAYS,
        "cell by cell": CPUExecution(batched_rows=0, min_segments_per_layer=0),
        "default": CPUExecution(),
    }
    for length, pipeline_by_default in ((37, False), (77, True)):  # 5 and 10 segments
        ids = RNG.integers(0, VOCAB, (2, length))
        want, want_state = armt.run(ids, schedule="sequential")
        for name, cpu in cases.items():
            armt.cpu_execution = cpu
            TRACES.clear()
            got, state = armt.run(ids, schedule="diagonal")
            assert float(jnp.abs(got - want).max()) <= 1e-4, (name, length)
            assert _rel(state.A, want_state.A) <= 1e-5, (name, length)
            took_pipeline = any(k != "sequential" for k in TRACES)
            if name == "default":
                assert took_pipeline == pipeline_by_default, (length, TRACES)
            else:
                assert took_pipeline or not TRACES, (
                    name,
                    TRACES,
                )  # compiled earlier, or traced as the pipeline


def test_ramp_waste():
    L = 8
    for n_seg in (2, 7, 8, 9, 40):
        blocks, left = plan(None, n_seg, True, L)
        assert left is None
        assert computed_cells(blocks, L) == n_seg * L  # exact widths: no wasted cell
    assert fixed_buffer_waste(8, 8) == pytest.approx(7 / 15)


@cache
def _bf16_models():
    """A default-initialised model (std 0.02 weights, unit norms) with random memory weights, in bf16
    and the same bf16-rounded weights in fp32. Memory scale 0.2: with scale 1 the random memory
    dynamics are chaotic and bf16 and fp32 trajectories drift apart after ~4K tokens whatever the
    schedule (fp32 diagonal still equals fp32 sequential exactly)."""
    model = Model.init(tiny_config(), seed=3)
    low = (
        ARMTModel.wrap(model, ARMTConfig(8, 4, d_mem=8), jax.random.key(3))
        .randomize_memory_params(jax.random.key(4), 0.2)
        .astype(jnp.bfloat16)
    )
    return low, low.astype(jnp.float32)


def _bf16_error(length: int) -> float:
    """Relative L2 logit error of bf16 weights + fp32 state (diagonal) vs the same weights in fp32
    (sequential)."""
    ids = np.random.default_rng(length).integers(0, VOCAB, (1, length))
    low, exact_model = _bf16_models()
    exact = np.asarray(exact_model(ids, schedule="sequential"), np.float64)
    got = np.asarray(low(ids, schedule="diagonal"), np.float64)
    return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def test_bf16_weights_fp32_state_close_to_fp32():
    assert _bf16_error(100) < 0.01


@pytest.mark.slow
def test_bf16_32k_tokens():
    assert _bf16_error(32768) < 0.01


@pytest.mark.slow
def test_bf16_state_schedules_agree():
    armt = make_armt(state_dtype=jnp.bfloat16)
    ids = RNG.integers(0, VOCAB, (1, 61))
    ls, ss = armt.run(ids, schedule="sequential")
    ld, sd = armt.run(ids, schedule="diagonal")
    assert sd.A.dtype == jnp.bfloat16
    assert float(jnp.abs(ls - ld).max()) <= 1e-3
    assert _rel(sd.A, ss.A) <= 1e-2


# --- the grouped-GEMM diagonal step (jaxlongctx.armt.projections) -------------------------------------
GROUPED_INTERPRET = DiagonalProjections(
    "grouped_matmul", "interpret"
)  # the Pallas kernel, interpreted on CPU


def _forward_and_grads(armt, segs, schedule):
    """Logits, final memory and parameter gradients of a next-token loss, in one compiled call."""

    def loss(params):
        state, logits = armt.run_segments(params, segs, schedule)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(segs.ids)[..., None], -1)), (logits, state)

    (_, (logits, state)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(armt.params)
    return logits, state, grads


def _assert_schedules_agree(got, want):
    (lg, sg, gg), (lw, sw, gw) = got, want
    assert float(jnp.abs(lg - lw).max()) <= 1e-4
    assert _rel(sg.A, sw.A) <= 1e-5 and _rel(sg.z, sw.z) <= 1e-5
    assert float(jnp.abs(sw.A).max()) > 0  # the memory was written
    for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gw), strict=True):
        assert _rel(a, b) <= 1e-4


@pytest.mark.jaxmin  # the GPU image's jax runs this path
def test_grouped_matmul_diagonal_equals_sequential():
    """The Pallas grouped GEMM (interpreted) in every product of the diagonal step and its backward: 2
    layers, a ramp-up step (layer 0 alone), a full step and a ramp-down step (first layer 1); the second
    row is one short segment, so its second segment is padding; logits, memory and gradients equal the
    sequential schedule's."""
    armt = make_armt(layers=2)
    ids = RNG.integers(0, VOCAB, (2, 13))
    segs = segment(*compact(ids, np.arange(13)[None] < np.array([[13], [6]]))[:2], armt.armt.segment_size)
    want = _forward_and_grads(armt, segs, "sequential")
    armt.projections = GROUPED_INTERPRET
    _assert_schedules_agree(_forward_and_grads(armt, segs, "diagonal"), want)


@pytest.mark.parametrize(
    "length", [45, pytest.param(16, marks=pytest.mark.slow), pytest.param(90, marks=pytest.mark.slow)]
)
def test_grouped_structure_equals_sequential(length):
    """The grouped step with the kernel's XLA reference (fast to compile): group slicing, first layers
    and the per-layer vectors broadcast over the group axis, on 3 layers: S > L with a short last
    segment (ramp-up, full and ramp-down steps), S < L, and full steps in scanned chunks."""
    armt = shared_armt()
    ids = RNG.integers(0, VOCAB, (2, length))
    ls, ss = armt.run(ids, schedule="sequential")
    armt.projections = DiagonalProjections("grouped_matmul", "xla")
    try:
        ld, sd = armt.run(ids, schedule="diagonal")
    finally:
        armt.projections = "auto"
    assert float(jnp.abs(ls - ld).max()) <= 1e-4
    assert _rel(sd.A, ss.A) <= 1e-5 and _rel(sd.z, ss.z) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("length", [16, 24, 45, 90])
def test_grouped_matmul_diagonal_sweep(length):
    armt = make_armt()
    ids = RNG.integers(0, VOCAB, (2, length))
    segs = segment(*compact(ids, np.ones(ids.shape, bool))[:2], armt.armt.segment_size)
    want = _forward_and_grads(armt, segs, "sequential")
    armt.projections = GROUPED_INTERPRET
    _assert_schedules_agree(_forward_and_grads(armt, segs, "diagonal"), want)


@pytest.mark.slow
def test_grouped_matmul_bf16_stream_equals_one_shot():
    """bf16 weights through the interpreted kernel: streaming equals the one-shot call, and both stay
    close to the vmapped path (the products round the same way, only the summation order differs)."""
    armt = make_armt(dtype=jnp.bfloat16)
    ids = RNG.integers(0, VOCAB, (1, 40))
    vmapped = armt(ids)
    armt.projections = GROUPED_INTERPRET
    one_shot = armt(ids)
    state, outs = armt.init_state(1), []
    for start in range(0, 40, 11):
        state, out = armt.feed(state, ids[:, start : start + 11])
        outs.append(np.asarray(out[0]))
    outs.append(np.asarray(armt.flush(state)[1][0]))
    assert float(jnp.abs(jnp.asarray(np.concatenate(outs)) - one_shot[0]).max()) <= 1e-4
    assert float(jnp.abs(one_shot - vmapped).max()) <= 0.1 * float(jnp.abs(vmapped).max())


def test_projection_choice():
    assert DiagonalProjections().resolve(on_mesh=False) == (
        "grouped_matmul" if jax.default_backend() == "gpu" else "vmap"
    )
    assert DiagonalProjections("auto", "interpret").resolve(on_mesh=False) == "vmap"  # auto: real Pallas only
    assert DiagonalProjections("auto", "pallas").resolve(on_mesh=False) == "grouped_matmul"
    assert DiagonalProjections("auto", "pallas").resolve(on_mesh=True) == "vmap"
    assert GROUPED_INTERPRET.resolve(on_mesh=False) == "grouped_matmul"
    with pytest.raises(ValueError, match="one device only"):
        GROUPED_INTERPRET.resolve(on_mesh=True)
    with pytest.raises(ValueError, match="'einsum'"):
        DiagonalProjections("einsum")
    with pytest.raises(ValueError, match="'triton'"):
        DiagonalProjections("grouped_matmul", "triton")
    armt = shared_armt()
    armt.projections = "vmap"
    try:
        assert (
            armt.projections == DiagonalProjections("vmap")
            and armt.astype(jnp.float32).projections.method == "vmap"
        )
    finally:
        armt.projections = "auto"
