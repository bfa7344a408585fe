"""The diagonal schedule (spec 2): all cells `(s, l)` with `s + l = t` run as ONE vmapped call of the
single-layer cell over the stacked layer weights, one diagonal per step.

The pipeline keeps, per layer slot `l`, the segment buffer that layer `l` processes next
(`h [L, B, R, D]`, its token counts and first flags) and the layer's memory state `A, z` (with a sliding
window also the layer's previous-segment token K/V, which cell (s, l) takes from cell (s - 1, l)
alone, so the schedule stays exact; spec/armt_published.md 8). A step runs the
occupied window of layers `[a, b)` (a static slice of the stacked weights), moves every output one
slot down and emits the segment leaving the last layer to the head. Steps with every layer busy are
a `jax.lax.scan` in fixed-size chunks; ramp-up and ramp-down steps run only their active layers
(exact widths, so no cell is wasted). Compiled pieces depend on the step plan only, never on the
input length (one-shot: ramp-up, full chunks of `chunk_sizes`, ramp-down; inputs with fewer than
L - 1 segments compile one plan per segment count).

On accelerators every diagonal is one batched call: a vmapped cell or, where the grouped GEMM kernel
runs (see `jaxlongctx.armt.projections`), one grouped cell whose products read the stacked weights in
place. On CPU (`jaxlongctx.armt.cpu_execution`) a vmapped diagonal is batched only while that is
faster than running its cells one by one inside the same step; whether a one-shot input is worth the
pipeline at all is decided by `ARMTModel.run_segments`, which chooses the schedule.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.armt.cell import cell, embed_segment
from jaxlongctx.armt.cpu_execution import CPUExecution, batch_cells
from jaxlongctx.armt.memory import MemoryState, zero_state
from jaxlongctx.armt.projections import DiagonalProjections, grouped_products, grouped_weights
from jaxlongctx.armt.segments import Segments, chunk_sizes
from jaxlongctx.armt.sequential import TRACES, remat_cell, sink_row, token_part
from jaxlongctx.sharding import batch_sharding

Step = tuple[int, int, bool]  # layers [a, b) run; whether a new segment enters slot 0 first
Block = tuple[str, Any]  # ("full", count) or ("steps", tuple[Step, ...])


class Pipeline(NamedTuple):
    """In-flight segments per layer slot (h `[L, B, R, D]`, n `[L, B]`, first `[L, B]`) and the
    per-layer memory state (A, z and, with a sliding window, each layer's window: layer l's slot
    holds what cell (s, l) needs from cell (s - 1, l))."""

    h: jnp.ndarray
    n: jnp.ndarray
    first: jnp.ndarray
    memory: MemoryState


def empty_pipeline(model: Any, state: MemoryState) -> Pipeline:
    """A pipeline with no segment in flight, holding the memory state `state`."""
    cfg, armt = model.config, model.armt
    L, b = cfg.num_layers, state.A.shape[1]
    h, n, first = (
        jnp.zeros((L, b, armt.rows, cfg.hidden_size), model.dtype),
        jnp.zeros((L, b), jnp.int32),
        jnp.zeros((L, b), bool),
    )
    mesh = model.base.mesh
    if mesh is not None:  # segment rows split like the memory state's rows
        h, n, first = (jax.device_put(x, batch_sharding(mesh, x.shape, axis=1)) for x in (h, n, first))
    return Pipeline(h, n, first, state)


def plan(
    occupied: tuple[int, int] | None, inputs: int, drain: bool, num_layers: int
) -> tuple[list[Block], tuple[int, int] | None]:
    """Steps that push `inputs` segments into a pipeline whose slots `[lo, hi)` are occupied (None:
    empty), then drain it if asked; consecutive all-layer steps are grouped into scanned chunks.
    Returns the blocks and the new occupancy."""
    L = num_layers
    steps: list[Step] = []
    for _ in range(inputs):
        if occupied is not None and occupied[0] != 1:
            raise ValueError("cannot feed a partially drained pipeline")
        window = (0, 1 if occupied is None else occupied[1])
        steps.append((*window, True))
        occupied = (1, min(window[1] + 1, L)) if L > 1 else None
    while drain and occupied is not None:
        steps.append((*occupied, False))
        occupied = (occupied[0] + 1, min(occupied[1] + 1, L)) if occupied[0] + 1 < L else None
    blocks: list[Block] = []
    for step in steps:
        if step == (0, L, True):
            if blocks and blocks[-1][0] == "full":
                blocks[-1] = ("full", blocks[-1][1] + 1)
            else:
                blocks.append(("full", 1))
        elif blocks and blocks[-1][0] == "steps":
            blocks[-1] = ("steps", blocks[-1][1] + (step,))
        else:
            blocks.append(("steps", (step,)))
    out: list[Block] = []
    for kind, arg in blocks:
        out.extend([("full", c) for c in chunk_sizes(arg)] if kind == "full" else [(kind, arg)])
    return out, occupied


def block_inputs(block: Block) -> int:
    """Segments a block consumes."""
    return block[1] if block[0] == "full" else sum(s[2] for s in block[1])


def _step(
    model: Any,
    cpu: CPUExecution,
    projections: DiagonalProjections,
    graphdef: nnx.GraphDef,
    layer_state: Any,
    memory_weights: Any,
    memory_tokens: jnp.ndarray,
    sink: jnp.ndarray | None,
    base: Any,
    pipe: Pipeline,
    a: int,
    b: int,
    seg: tuple | None,
) -> tuple[Pipeline, jnp.ndarray | None]:
    """One diagonal: layers `[a, b)` as one grouped or vmapped cell call; returns the pipeline and the
    logits `[B, S, V]` of the segment leaving the last layer (None if none leaves)."""
    armt, L = model.armt, model.config.num_layers
    h, n, first, mem = pipe
    if seg is not None:
        ids, seg_n, seg_first = seg
        h = h.at[0].set(embed_segment(base, memory_tokens, ids, sink))
        n, first = n.at[0].set(seg_n), first.at[0].set(seg_first)
    window = lambda x: x[a:b]
    active = jax.tree.map(window, mem)  # the active layers' memory state

    @functools.partial(remat_cell, model)
    def one(ls, mw, hh, mm, nn, ff):
        return cell(armt, model.inv_freq, nnx.merge(graphdef, ls), mw, hh, mm, nn, ff)

    def layer_cell(xs):  # one layer's cell, its weights read in place from the stacked ones
        layer, *rest = xs
        return one(
            jax.tree.map(lambda w: w[layer], layer_state),
            jax.tree.map(lambda w: w[layer], memory_weights),
            *rest,
        )

    if projections.resolve(model.base.mesh is not None) == "grouped_matmul":
        layer, mem_weights = grouped_weights(graphdef, layer_state, memory_weights, a, b)
        dense, proj = grouped_products(a, b - a, projections.kernel)
        out, new = cell(
            armt, model.inv_freq, layer, mem_weights, h[a:b], active, n[a:b], first[a:b], dense, proj
        )
    elif batch_cells(
        cpu, b - a, L, h.shape[1], armt.rows
    ):  # [a, b) is a static window of the stacked weights
        out, new = jax.vmap(one)(
            jax.tree.map(window, layer_state),
            jax.tree.map(window, memory_weights),
            h[a:b],
            active,
            n[a:b],
            first[a:b],
        )
    else:
        out, new = jax.lax.map(layer_cell, (jnp.arange(a, b), h[a:b], active, n[a:b], first[a:b]))
    mem = jax.tree.map(lambda x, y: x.at[a:b].set(y), mem, new)
    hi = min(b + 1, L)
    h = h.at[a + 1 : hi].set(out[: hi - a - 1])
    n, first = n.at[a + 1 : hi].set(n[a : hi - 1]), first.at[a + 1 : hi].set(first[a : hi - 1])
    logits = base.head(token_part(armt, out[-1])) if b == L else None
    return Pipeline(h, n, first, mem), logits


def _run_block(
    model: Any,
    block: Block,
    cpu: CPUExecution,
    projections: DiagonalProjections,
    params: Any,
    pipe: Pipeline,
    segs: Segments,
) -> tuple[Pipeline, jnp.ndarray]:
    TRACES[("diagonal", block)] += 1
    base, memory_params = model.merge(params)
    graphdef, layer_state = nnx.split(base.layers)
    memory_weights, memory_tokens = memory_params.layers(), memory_params.memory[...]
    args = (
        model,
        cpu,
        projections,
        graphdef,
        layer_state,
        memory_weights,
        memory_tokens,
        sink_row(memory_params),
        base,
    )
    L = model.config.num_layers
    if block[0] == "full":
        return jax.lax.scan(lambda p, seg: _step(*args, p, 0, L, seg), pipe, tuple(segs))
    outs, used = [], 0
    for a, b, takes in block[1]:
        seg = (segs.ids[used], segs.n[used], segs.first[used]) if takes else None
        used += takes
        pipe, logits = _step(*args, pipe, a, b, seg)
        if logits is not None:
            outs.append(logits)
    b_, s = pipe.h.shape[1], model.armt.segment_size
    empty = jnp.zeros((0, b_, s, model.config.vocab_size), jnp.float32)
    return pipe, jnp.stack(outs) if outs else empty


# (model, block, cpu, projections, params, pipe, segs)
run_block = jax.jit(_run_block, static_argnums=(0, 1, 2, 3))


def run_blocks(
    model: Any, params: Any, pipe: Pipeline, blocks: list[Block], segs: Segments
) -> tuple[Pipeline, list[jnp.ndarray]]:
    """Run planned blocks, feeding `segs` in order; returns the pipeline and the emitted logits."""
    outs, start = [], 0
    for block in blocks:
        k = block_inputs(block)
        chunk = segs[start : start + k].place(model.base.mesh)
        pipe, logits = run_block(model, block, model.cpu_execution, model.projections, params, pipe, chunk)
        if logits.shape[0]:  # ramp-up blocks emit nothing
            outs.append(logits)
        start += k
    return pipe, outs


def diagonal_forward(
    model: Any, params: Any, segs: Segments, state: MemoryState | None = None
) -> tuple[MemoryState, jnp.ndarray]:
    """Run segments `[nS, B, S]` through an empty pipeline and drain it; returns the final state
    and logits `[nS, B, S, V]` (equal to `sequential_forward` up to float reassociation)."""
    state = zero_state(model, segs.ids.shape[1]) if state is None else state
    blocks, _ = plan(None, segs.count, True, model.config.num_layers)
    pipe, outs = run_blocks(model, params, empty_pipeline(model, state), blocks, segs)
    return pipe.memory, jnp.concatenate(outs, axis=0)


def computed_cells(blocks: list[Block], num_layers: int) -> int:
    """Layer cells (per batch row) a plan computes; useful cells are `segments * num_layers`."""
    return sum(num_layers * arg if kind == "full" else sum(b - a for a, b, _ in arg) for kind, arg in blocks)


def fixed_buffer_waste(num_segments: int, num_layers: int) -> float:
    """Wasted fraction of a static L-row buffer run at full width on every diagonal: (L-1)/(S+L-1)."""
    return (num_layers - 1) / (num_segments + num_layers - 1)
