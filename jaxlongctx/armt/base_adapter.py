"""A low-rank base adapter: what an ARMT fine-tune changed in its base, stored small beside the memory.

A fine-tune that trains the base with the memory (at a small learning rate) moves every base weight a
little, and its memory only works on the moved base. Copying 135M base weights into the checkpoint
defeats a memory checkpoint of a few MB, but the change is close to low rank: each weight matrix's
change `delta [..., m, n]` (stacked layers keep their leading `[L]` axis) is stored as its best rank-r
factors `left [..., m, r] @ right [..., r, n]` (truncated SVD), and vectors (norm scales) whole as
`delta`. Loading adds them to the referenced base (see `jaxlongctx.armt.base_reference`), in float32,
then casts to the base's dtype. Tensors the fine-tune left unchanged are not stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from jaxlongctx.checkpoint import CheckpointError

ADAPTER_DIR = "base_adapter"


def fit_base_adapter(
    tuned: dict[str, Any], base: dict[str, Any], rank: int, dtype: Any = jnp.bfloat16
) -> tuple[dict[str, dict[str, np.ndarray]], list[dict[str, Any]]]:
    """The adapter taking `base` to `tuned` (nested parameter dicts of equal structure) at `rank`, its
    factors in `dtype`; and per stored tensor `{name, shape, kind, relative_error}`, the error being
    `|delta - stored| / |delta|` (float32, before the cast to `dtype`)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    flat_tuned, flat_base = (traverse_util.flatten_dict(t, sep="/") for t in (tuned, base))
    if flat_tuned.keys() != flat_base.keys():
        raise ValueError(
            f"tuned and base parameters differ in names: {sorted(flat_tuned.keys() ^ flat_base.keys())}"
        )
    adapter: dict[str, dict[str, np.ndarray]] = {}
    report: list[dict[str, Any]] = []
    for name in sorted(flat_tuned):
        t, b = np.asarray(flat_tuned[name], np.float32), np.asarray(flat_base[name], np.float32)
        if t.shape != b.shape:
            raise ValueError(f"{name}: tuned shape {t.shape} differs from the base's {b.shape}")
        delta = t - b
        if not delta.any():
            continue
        if delta.ndim >= 2 and rank < min(delta.shape[-2:]):
            u, s, vt = np.linalg.svd(delta, full_matrices=False)  # [..., m, k] [..., k] [..., k, n]
            left, right = u[..., :rank] * s[..., None, :rank], vt[..., :rank, :]
            error = float(np.linalg.norm(delta - left @ right) / np.linalg.norm(delta))
            entry, kind = {"left": left, "right": right}, f"rank {rank}"
        else:
            entry, kind, error = {"delta": delta}, "whole", 0.0
        adapter[name] = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in entry.items()}
        report.append({"name": name, "shape": list(t.shape), "kind": kind, "relative_error": error})
    return adapter, report


def adapter_bytes(adapter: dict[str, dict[str, np.ndarray]]) -> int:
    """Bytes the adapter's arrays take."""
    return sum(x.nbytes for entry in adapter.values() for x in entry.values())


def write_adapter(directory: Path, adapter: dict[str, dict[str, np.ndarray]]) -> None:
    """Write `adapter` (from `fit_base_adapter`) under `directory/base_adapter`."""
    tree = {name.replace("/", "."): entry for name, entry in adapter.items()}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / ADAPTER_DIR, tree)


def restore_adapter(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """The adapter stored under `path/base_adapter`."""
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.restore(path / ADAPTER_DIR)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: cannot restore the base adapter ({type(e).__name__}: {e})") from None
    return {
        name.replace(".", "/"): {k: np.asarray(v) for k, v in entry.items()} for name, entry in tree.items()
    }


def _change(name: str, entry: dict[str, np.ndarray], shape: tuple[int, ...], where: Path) -> np.ndarray:
    """The float32 change one adapter entry stores, checked against the base tensor's `shape`."""
    if set(entry) == {"delta"}:
        delta = entry["delta"]
    elif set(entry) == {"left", "right"}:
        left, right = entry["left"], entry["right"]
        if left.ndim != len(shape) or right.ndim != len(shape) or left.shape[-1] != right.shape[-2]:
            raise CheckpointError(
                f"{where}: base adapter {name}: factors {left.shape} @ {right.shape} do not chain"
            )
        delta = left.astype(np.float32) @ right.astype(np.float32)
    else:
        raise CheckpointError(
            f"{where}: base adapter {name}: expected 'delta' or 'left'/'right', got {sorted(entry)}"
        )
    if tuple(delta.shape) != tuple(shape):
        raise CheckpointError(
            f"{where}: base adapter {name}: shape {tuple(delta.shape)}, the base's is {tuple(shape)}"
        )
    return delta.astype(np.float32)


def apply_adapter(
    base: dict[str, Any], adapter: dict[str, dict[str, np.ndarray]], where: Path
) -> dict[str, Any]:
    """`base` (nested parameter dict) with the adapter's changes added in float32 and cast back to each
    tensor's dtype, on its sharding; a CheckpointError (naming `where`) for a tensor the base lacks or a
    shape it does not have."""
    flat = traverse_util.flatten_dict(base, sep="/")
    unknown = sorted(set(adapter) - set(flat))
    if unknown:
        raise CheckpointError(f"{where}: the base adapter changes tensors the base does not have: {unknown}")
    for name, entry in adapter.items():
        x = flat[name]
        changed = (x.astype(jnp.float32) + _change(name, entry, x.shape, where)).astype(x.dtype)
        flat[name] = jax.device_put(changed, x.sharding) if hasattr(x, "sharding") else changed
    return traverse_util.unflatten_dict(flat, sep="/")
