"""The memory parameters in an ARMT checkpoint: an orbax tree under `armt_memory/`, written beside the
base weights (a full checkpoint) or alone (a memory-only checkpoint, whose config.json names its base;
see `jaxlongctx.armt.base_reference`)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.params import MemoryParams
from jaxlongctx.checkpoint import CheckpointError, check_stored_tensors, on_device
from jaxlongctx.config import ModelConfig
from jaxlongctx.parallel import fit_mesh, memory_shardings

MEMORY_DIR = "armt_memory"


def write_memory(directory: Path, memory: MemoryParams) -> None:
    """Write the memory parameters (`[M, D]` tokens, `[L, ...]` projections) under `directory/armt_memory`."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / MEMORY_DIR, nnx.to_pure_dict(nnx.state(memory)))


def restore_memory(
    path: Path,
    config: ModelConfig,
    armt: ARMTConfig,
    stored_dtype: jnp.dtype,
    dtype: jnp.dtype | None = None,
    mesh: Mesh | None = None,
) -> MemoryParams:
    """The memory parameters of the checkpoint at `path` (stored as `stored_dtype`), checked against
    the shapes `config` and `armt` imply, cast to `dtype` if given, each restored into its shard on
    `mesh` if given."""
    skeleton = nnx.eval_shape(
        lambda: MemoryParams(
            armt, config.num_layers, config.hidden_size, 1.0, dtype=stored_dtype, key=jax.random.key(0)
        )
    )
    graphdef, state = nnx.split(skeleton)
    target = nnx.to_pure_dict(state)
    if mesh is not None:
        shardings = memory_shardings(fit_mesh(mesh, config), target)
        target = {
            name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[name])
            for name, x in target.items()
        }
    check_stored_tensors(path / MEMORY_DIR, target)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path / MEMORY_DIR, on_device(target))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"{path}: cannot restore ARMT memory parameters ({type(e).__name__}: {e})"
        ) from None
    if dtype is not None:
        restored = {name: x.astype(dtype) for name, x in restored.items()}
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
