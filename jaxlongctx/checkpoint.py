"""Our checkpoint format: `config.json` + orbax parameter tree (+ optional `tokenizer.json`).

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place
only when complete, so a failed save never leaves a partial checkpoint behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxlongctx.config import ModelConfig
from jaxlongctx.model.llama import Llama

FORMAT = "jaxlongctx-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written."""


@contextlib.contextmanager
def atomic_directory(out: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success rename it to `out`, on error delete it."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: output already exists (pass overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def abstract_model(config: ModelConfig, dtype: jnp.dtype) -> Llama:
    """A model skeleton whose parameters are `ShapeDtypeStruct`s (no memory allocated)."""
    return nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))


def save_params(directory: Path, params: Any) -> None:
    """Write a parameter pytree (jax or numpy leaves) with orbax under `directory/params`."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", params)


def write_metadata(directory: Path, config: ModelConfig, dtype: str, extra: dict[str, Any] | None = None) -> None:
    """Write `config.json` in our format."""
    meta = {"format": FORMAT, "dtype": dtype, "config": config.to_dict(), **(extra or {})}
    (directory / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Read and check the `config.json` of one of our checkpoints."""
    f = Path(path) / "config.json"
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing (not a jaxlongctx checkpoint)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: corrupt JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a jaxlongctx checkpoint (format {meta.get('format')!r})")
    return meta


def is_checkpoint(path: str | Path) -> bool:
    """True if `path` holds one of our checkpoints."""
    try:
        read_metadata(path)
        return True
    except CheckpointError:
        return False


def save_model(module: Llama, path: str | Path, *, overwrite: bool = False,
               tokenizer_file: str | Path | None = None) -> Path:
    """Save a model atomically; returns the checkpoint path."""
    params = nnx.to_pure_dict(nnx.state(module))
    dtype = str(jax.tree.leaves(params)[0].dtype)
    with atomic_directory(path, overwrite=overwrite) as tmp:
        save_params(tmp, params)
        write_metadata(tmp, module.config, dtype)
        if tokenizer_file is not None:
            shutil.copy(tokenizer_file, tmp / "tokenizer.json")
    return Path(path)


def on_device(target: Any) -> Any:
    """`target` (a pytree of `ShapeDtypeStruct`s) with every leaf that names no sharding placed on the
    default device: orbax restores such a leaf as a numpy array, which every jitted call then copies
    to the device again (for a 540 MB model, most of a decode step)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def place(leaf: Any) -> Any:
        if getattr(leaf, "sharding", None) is not None:
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)

    return jax.tree.map(place, target)


def restore_params(path: str | Path, target: Any) -> Any:
    """Restore the orbax parameter tree at `path/params` into the shapes/dtypes/shardings of `target`
    as device-resident jax Arrays (leaves without a sharding go to the default device)."""
    path = Path(path).absolute()
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(path / "params", on_device(target))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: cannot restore parameters ({type(e).__name__}: {e})") from None


def load_module(path: str | Path, dtype: jnp.dtype | None = None,
                shardings: Any = None) -> Llama:
    """Load a `Llama` from our checkpoint, optionally casting to `dtype` and placing with `shardings`
    (a pytree of shardings matching the pure parameter dict, for restoring straight into shards)."""
    meta = read_metadata(path)
    config = ModelConfig.from_dict(meta["config"])
    stored = jnp.dtype(meta["dtype"])
    skeleton = abstract_model(config, stored)
    pure = nnx.to_pure_dict(nnx.state(skeleton))
    if shardings is not None:
        pure = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), pure, shardings)
    restored = restore_params(path, pure)
    if dtype is not None and jnp.dtype(dtype) != stored:
        restored = jax.tree.map(lambda x: x.astype(dtype), restored)
        skeleton = abstract_model(config, jnp.dtype(dtype))
    graphdef, state = nnx.split(skeleton)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)

