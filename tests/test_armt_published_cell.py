"""The published ARMT cell's options (sink, sliding window, memory heads, gating, version options) on
tiny random models: the diagonal schedule equals the sequential one (gradients included), streaming
equals the one-shot call, generation equals the forward pass step by step, defaults are unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_armt_utils import VOCAB, tiny_config

from jaxlongctx.armt import ARMTConfig, ARMTModel, DiagonalProjections
from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS
from jaxlongctx.armt.segments import compact, segment
from jaxlongctx.model.model import Model
from jaxlongctx.sampling import SamplingParams

RNG = np.random.default_rng(1)
PUBLISHED = dict(sink=True, sliding_window=True, normalize_features=True, gamma_eps=0.0)


def published_armt(
    layers: int = 3, segment_size: int = 4, mem: int = 3, seed: int = 0, **options
) -> ARMTModel:
    """A tiny ARMT with the published cell (and `options`) and random memory weights."""
    model = Model.init(tiny_config(layers), seed=seed)
    model.module.embed[...] = 0.5 * jax.random.normal(jax.random.key(seed + 7), model.module.embed.shape)
    cfg = ARMTConfig(segment_size, mem, d_mem=8, **{**PUBLISHED, **options})
    armt = ARMTModel.wrap(model, cfg, jax.random.key(seed + 1))
    armt.cpu_execution = PIPELINE_ALWAYS
    return armt.randomize_memory_params(jax.random.key(seed + 2), 1.0)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _padded_segments(armt, lengths, width):
    ids = RNG.integers(0, VOCAB, (len(lengths), width))
    mask = np.arange(width)[None] < np.asarray(lengths)[:, None]
    return segment(*compact(ids, mask)[:2], armt.armt.segment_size)


def _forward_and_grads(armt, segs, schedule):
    def loss(params):
        state, logits = armt.run_segments(params, segs, schedule)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(segs.ids)[..., None], -1)), (logits, state)

    (_, (logits, state)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(armt.params)
    return logits, state, grads


@pytest.mark.parametrize(
    "options, projections",
    [
        (dict(mem_heads=2, gating=True), "vmap"),
        pytest.param(
            dict(mem_heads=2), DiagonalProjections("grouped_matmul", "interpret"), marks=pytest.mark.slow
        ),
        pytest.param(dict(use_denom=False, mem_mem_mask="all"), "vmap", marks=pytest.mark.slow),
    ],
)
def test_published_diagonal_equals_sequential_with_gradients(options, projections):
    """Sink, window, heads and gating on the diagonal pipeline: a row of 3 segments (more than the 2
    layers, short last segment) beside a row of 1 (fewer; then padding segments, which must leave
    the window alone): logits, memory state with the window, and parameter gradients."""
    armt = published_armt(layers=2, **options)
    armt.projections = projections
    segs = _padded_segments(armt, [11, 3], 11)
    (lw, sw, gw), (lg, sg, gg) = (_forward_and_grads(armt, segs, s) for s in ("sequential", "diagonal"))
    assert float(jnp.abs(lg - lw).max()) <= 1e-4
    for got, want in zip(sg, sw, strict=True):
        assert _rel(got, want) <= 1e-5
    assert float(jnp.abs(sw.A).max()) > 0 and np.array_equal(sw.wn, [[3, 3]] * 2)  # last segments' tokens
    for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gw), strict=True):
        assert _rel(a, b) <= 1e-4


@pytest.mark.slow  # the fixtures run the grouped step (interpreted kernel) in the default run
def test_published_grouped_step_equals_sequential():
    """The grouped-GEMM step (kernel's XLA reference) with the window, heads and a sink: S = L segments."""
    armt = published_armt(mem_heads=2)
    ids = RNG.integers(0, VOCAB, (2, 12))
    ls, ss = armt.run(ids, schedule="sequential")
    armt.projections = DiagonalProjections("grouped_matmul", "xla")
    ld, sd = armt.run(ids, schedule="diagonal")
    assert float(jnp.abs(ls - ld).max()) <= 1e-4 and _rel(sd.wk, ss.wk) <= 1e-6


@pytest.mark.slow  # the fixtures pin the reference's options; this checks the others take effect
def test_version_options_change_the_model():
    """Each version option (spec/armt_published.md 9) changes the logits after segment 0 only where it
    applies, and the window matters."""
    ids = RNG.integers(0, VOCAB, (1, 12))
    base = published_armt(layers=2)(ids, schedule="sequential")
    for options in (
        dict(mem_mem_mask="all"),
        dict(window_mem="none"),
        dict(window_token_offset=1),
        dict(sliding_window=False),
        dict(use_denom=False),
        dict(correction=False),
    ):
        other = published_armt(layers=2, **options)(ids, schedule="sequential")
        assert float(jnp.abs(other - base).max()) > 1e-3, options
        if "mem_mem_mask" in options or "window_mem" in options or "use_denom" in options:
            assert float(jnp.abs(other[:, :4] - base[:, :4]).max()) == 0.0, (
                options
            )  # segment 0: no memory yet


@pytest.mark.parametrize("schedule", ["diagonal", pytest.param("sequential", marks=pytest.mark.slow)])
def test_published_stream_equals_one_shot(schedule):
    """Streaming carries the window: chunks of any size equal the one-shot call; a new document starts
    without the previous one's window."""
    armt = published_armt(layers=2)
    ids = RNG.integers(0, VOCAB, (2, 19))
    want = armt(ids, schedule="sequential")
    state, outs = armt.init_state(2, schedule), [[], []]
    for a, b in ((0, 3), (3, 11), (11, 19)):
        state, per_row = armt.feed(state, ids[:, a:b])
        for r in range(2):
            outs[r].append(per_row[r])
    state, per_row = armt.flush(state)
    for r in range(2):
        got = jnp.concatenate(outs[r] + [per_row[r]])
        assert float(jnp.abs(got - want[r]).max()) <= 1e-4
    state, first = armt.feed(state, ids[:, :8], end_document=True)  # a new document after the flush
    state, rest = armt.flush(state)
    alone = armt(ids[:, :8], schedule="sequential")
    got = jnp.concatenate([first[0], rest[0]])
    assert float(jnp.abs(got - alone[0]).max()) <= 1e-4


def test_published_generation_equals_forward_each_step():
    """Each step's logits equal the forward's last row: batch 2, left padding, a prompt whose open
    segment commits twice while generating (S = 4; prompts of 5 and 3 tokens, 9 new tokens)."""
    armt = published_armt(mem_heads=2)
    ids = RNG.integers(3, VOCAB, (2, 5))
    mask = np.ones((2, 5), bool)
    mask[1, :2] = False  # row 1: 3 real tokens, left-padded
    steps: list = []
    out = armt.generate(ids, SamplingParams(max_new_tokens=9), attention_mask=mask, step_logits=steps)
    full_mask = np.concatenate([mask, np.ones((2, 9), bool)], axis=1)
    forward = armt(out, full_mask, schedule="sequential")  # [2, 14, V]
    for i, logits in enumerate(steps):
        assert float(jnp.abs(logits - forward[:, 4 + i]).max()) <= 1e-4, i
    assert np.array_equal(out[:, 5:], np.asarray(jnp.argmax(forward[:, 4:13], -1)))
    sampled = armt.generate(ids, SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=3))
    again = armt.generate(ids, SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=3))
    assert sampled.shape == (2, 8) and np.array_equal(sampled, again)  # seeded sampling


def test_defaults_unchanged():
    """Default options keep the spec/armt.md cell and the checkpoint metadata written before them."""
    cfg = ARMTConfig(8, 4, d_mem=8)
    assert cfg.to_dict() == {"segment_size": 8, "num_mem_tokens": 4, "d_mem": 8, "state_dtype": "float32"}
    assert cfg.rows == 12 and cfg.plain_mask and not cfg.sink
    pub = ARMTConfig(8, 4, d_mem=8, **PUBLISHED, mem_heads=2)
    assert ARMTConfig.from_dict(pub.to_dict()) == pub and pub.rows == 13
    with pytest.raises(ValueError, match="mem_heads"):
        ARMTConfig(8, 4, d_mem=7, mem_heads=2)
    with pytest.raises(ValueError, match="window_mem"):
        ARMTConfig(8, 4, window_mem="some")
