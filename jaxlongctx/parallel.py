"""Tensor and data parallelism: meshes, and whole models placed on them.

`make_mesh` builds a `(dp, tp)` mesh with explicit axis types, `fit_mesh` adapts it to a model's kv
heads, `param_shardings` gives every parameter of a model its `NamedSharding` (for placing a loaded
model with `shard_model` or restoring a checkpoint straight into shards), and `shard_memory` places
ARMT memory parameters. The sharding rules themselves (the logical-axis table, the helpers the model
code calls) are `jaxlongctx.sharding`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxlongctx.checkpoint import abstract_model
from jaxlongctx.config import ModelConfig
from jaxlongctx.model.model import Model
from jaxlongctx.sharding import (
    DATA,
    KV_REPLICA,
    MEMORY_PARAM_AXES,
    PARAM_AXES,
    TENSOR,
    logical_spec,
    put,
    tensor_size,
)


def make_mesh(tp: int = 1, dp: int = 1, devices: list[Any] | None = None) -> Mesh:
    """A `(dp, tp)` mesh with explicit axis types over the first `dp * tp` devices."""
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    devices = list(jax.devices() if devices is None else devices)
    if dp * tp > len(devices):
        raise ValueError(
            f"a dp={dp} x tp={tp} mesh needs {dp * tp} devices, but only {len(devices)} are "
            "available (on CPU, fake more with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return jax.make_mesh(
        (dp, tp),
        (DATA, TENSOR),
        axis_types=(AxisType.Explicit, AxisType.Explicit),
        devices=devices[: dp * tp],
    )


def check_divisible(config: ModelConfig, mesh: Mesh) -> None:
    """Refuse configs whose heads or MLP width do not split evenly over the tensor axis, and kv heads
    that neither split over it nor replicate evenly across it."""
    tp = tensor_size(mesh)
    for name, size in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
        if size % tp:
            raise ValueError(f"tensor parallelism tp={tp} needs {name} divisible by {tp}, got {size}")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"tensor parallelism tp={tp} needs num_kv_heads={kv} to divide tp (each kv head then "
            f"replicated on tp / num_kv_heads devices) or to be divisible by it"
        )


def fit_mesh(mesh: Mesh, config: ModelConfig) -> Mesh:
    """`mesh` checked against `config`; with more tensor-parallel devices than kv heads (tp = K * R) the
    same devices as a `(dp, tp=K, kv_rep=R)` mesh, so that each kv head lives on the R devices that
    hold its query heads. Unchanged otherwise."""
    check_divisible(config, mesh)
    tp, kv = tensor_size(mesh), config.num_kv_heads
    if KV_REPLICA in mesh.axis_names or tp <= kv:
        return mesh
    devices = mesh.devices.reshape(mesh.shape[DATA], kv, tp // kv)
    return Mesh(devices, (DATA, TENSOR, KV_REPLICA), axis_types=(AxisType.Explicit,) * 3)


def _vocab_split(config: ModelConfig, mesh: Mesh) -> bool:
    """True when the vocabulary is split over tp (else the embedding and head are replicated)."""
    return config.vocab_size % tensor_size(mesh) == 0


def param_shardings(config: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """`NamedSharding`s matching `nnx.to_pure_dict` of a `Llama` state with this config (on
    `fit_mesh(mesh, config)`)."""
    mesh = fit_mesh(mesh, config)
    pure = nnx.to_pure_dict(nnx.state(abstract_model(config, jnp.float32)))
    split_vocab = _vocab_split(config, mesh)

    def spec(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        name = str(path[-1].key)
        if name not in PARAM_AXES:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no entry in PARAM_AXES")
        axes = PARAM_AXES[name]
        if len(axes) != leaf.ndim:
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} has rank {leaf.ndim}, PARAM_AXES says {axes}"
            )
        if not split_vocab:
            axes = tuple(None if a == "vocab" else a for a in axes)
        return NamedSharding(mesh, logical_spec(axes, mesh=mesh))

    return jax.tree_util.tree_map_with_path(spec, pure)


def shard_model(model: Model, mesh: Mesh) -> Model:
    """A copy of `model` (a `Model`) with every parameter placed in its shard on `mesh`."""
    graphdef, state = nnx.split(model.module)
    shardings = param_shardings(model.config, mesh)
    placed = jax.tree.map(put, nnx.to_pure_dict(state), shardings)
    nnx.replace_by_pure_dict(state, placed)
    return Model(nnx.merge(graphdef, state), tokenizer=model.tokenizer)


def memory_shardings(mesh: Mesh, pure: dict[str, Any]) -> dict[str, NamedSharding]:
    """`NamedSharding`s of ARMT memory parameters (a pure dict keyed by `MEMORY_PARAM_AXES` names) on the
    model's (fitted) mesh."""
    axes = lambda name: (
        MEMORY_PARAM_AXES[name] + (None,) * (len(pure[name].shape) - len(MEMORY_PARAM_AXES[name]))
    )
    return {name: NamedSharding(mesh, logical_spec(axes(name), mesh=mesh)) for name in pure}


def shard_memory(memory: Any, mesh: Mesh) -> None:
    """Place ARMT memory parameters (an `nnx.Module` with `MEMORY_PARAM_AXES` leaves) on `mesh`, in place."""
    state = nnx.state(memory)
    pure = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, jax.tree.map(put, pure, memory_shardings(mesh, pure)))
    nnx.update(memory, state)
