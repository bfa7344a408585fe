"""How the ARMT schedules execute on CPU (accelerators always run the diagonal schedule with every
diagonal batched): `CPUExecution`, the policy an `ARMTModel` carries; `batch_cells`, which the diagonal
schedule asks per diagonal; `diagonal_pays_off`, which `ARMTModel` asks before it runs the diagonal
schedule rather than the same cells in sequential order. Every choice gives the same results.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class CPUExecution(NamedTuple):
    """How the diagonal schedule executes on CPU (accelerators always batch every diagonal).

    On CPU one cell of a few hundred rows already keeps the cores busy; batching more rows than
    `batched_rows` pushes a diagonal's intermediates (MLP activations, attention scores) out of the
    cache, and a partial (ramp) diagonal would first copy its window of the stacked weights: both
    then run slower than the same cells one by one. One-shot inputs with fewer than
    `min_segments_per_layer * L` segments spend most steps in the ramps and run in sequential order.
    The defaults were measured with bench/armt_schedule.py; every choice gives the same results.
    """

    batched_rows: int = 3072
    min_segments_per_layer: int = 3


PIPELINE_ALWAYS = CPUExecution(min_segments_per_layer=0)  # never the sequential-order shortcut


def batch_cells(cpu: CPUExecution, cells: int, num_layers: int, batch: int, rows: int) -> bool:
    """Whether a diagonal of `cells` cells over `batch` segment buffers of `rows` rows runs as one
    vmapped call, or cell after cell inside the same compiled step (see `CPUExecution`)."""
    if jax.default_backend() != "cpu":
        return True
    return cells == num_layers and cells * batch * rows <= cpu.batched_rows


def diagonal_pays_off(model: Any, batch: int, num_segments: int) -> bool:
    """Whether a one-shot input runs through the pipeline rather than in sequential order (see
    `CPUExecution`; always on accelerators)."""
    L, cpu = model.config.num_layers, model.cpu_execution
    if jax.default_backend() != "cpu":
        return True
    return batch_cells(cpu, L, L, batch, model.armt.rows) and num_segments >= cpu.min_segments_per_layer * L
