"""Our checkpoint format: `config.json` + orbax parameter tree (+ optional `tokenizer.json`).

Writes go through `jaxlongctx.output_dir.atomic_directory`: built in a temporary sibling and swapped
in by renames when complete, so a failed or killed save never leaves a partial checkpoint behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.config import ModelConfig
from jaxlongctx.model.llama import Llama
from jaxlongctx.output_dir import atomic_directory

FORMAT = "jaxlongctx-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written."""


def abstract_model(config: ModelConfig, dtype: jnp.dtype) -> Llama:
    """A model skeleton whose parameters are `ShapeDtypeStruct`s (no memory allocated)."""
    return nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))


def save_params(directory: Path, params: Any) -> None:
    """Write a parameter pytree (jax or numpy leaves) with orbax under `directory/params`."""
    import orbax.checkpoint as ocp  # slow to import: only when a checkpoint is read or written

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", params)


def write_metadata(
    directory: Path, config: ModelConfig, dtype: str, extra: dict[str, Any] | None = None
) -> None:
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: corrupt JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{f}: cannot read ({e.strerror})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{f}: not a jaxlongctx checkpoint (format {found!r})")
    for key, kind in (("config", dict), ("dtype", str)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{f}: field {key!r} is missing or not a JSON {kind.__name__}")
    if meta["dtype"] not in ("bfloat16", "float32", "float16"):
        raise CheckpointError(f"{f}: unsupported dtype {meta['dtype']!r}")
    try:
        ModelConfig.from_dict(meta["config"])
    except ValueError as e:
        raise CheckpointError(f"{f}: {e}") from None
    return meta


def declares_checkpoint(path: str | Path) -> bool:
    """True if `path/config.json` names our format, however broken the rest of it is."""
    try:
        meta = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(meta, dict) and str(meta.get("format", "")).startswith("jaxlongctx-checkpoint")


def save_model(
    module: Llama, path: str | Path, *, overwrite: bool = False, tokenizer_file: str | Path | None = None
) -> Path:
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


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype name)} of a tree of arrays, ShapeDtypeStructs or orbax metadata."""
    return {
        jax.tree_util.keystr(k, simple=True, separator="."): (tuple(v.shape), str(jnp.dtype(v.dtype)))
        for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def check_stored_tensors(directory: Path, target: Any) -> None:
    """Compare the tensors stored in the orbax tree at `directory` with `target` (what config.json
    implies): every name, shape and dtype must match, else a CheckpointError naming the tensor."""
    import orbax.checkpoint as ocp  # slow to import: only when a checkpoint is read or written

    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(directory)
    except (FileNotFoundError, ValueError, KeyError, OSError) as e:
        raise CheckpointError(
            f"{directory}: cannot read the stored tensors ({type(e).__name__}: {e})"
        ) from None
    stored, wanted = _shapes(getattr(meta, "item_metadata", meta)), _shapes(target)
    for name in sorted(wanted.keys() | stored.keys()):
        if name not in stored:
            raise CheckpointError(f"{directory}: tensor {name!r} is missing")
        if name not in wanted:
            raise CheckpointError(
                f"{directory}: unexpected tensor {name!r} (not in the model config.json describes)"
            )
        if stored[name] != wanted[name]:
            (s_shape, s_dtype), (w_shape, w_dtype) = stored[name], wanted[name]
            raise CheckpointError(
                f"{directory}: tensor {name!r} is stored as {s_dtype}{list(s_shape)} but "
                f"config.json implies {w_dtype}{list(w_shape)}"
            )


def restore_params(path: str | Path, target: Any) -> Any:
    """Restore the orbax parameter tree at `path/params` into the shapes/dtypes/shardings of `target`
    as device-resident jax Arrays (leaves without a sharding go to the default device)."""
    path = Path(path).absolute()
    check_stored_tensors(path / "params", target)
    import orbax.checkpoint as ocp  # slow to import: only when a checkpoint is read or written

    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(path / "params", on_device(target))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: cannot restore parameters ({type(e).__name__}: {e})") from None


def load_module(path: str | Path, dtype: jnp.dtype | None = None, shardings: Any = None) -> Llama:
    """Load a `Llama` from our checkpoint, optionally casting to `dtype` and placing with `shardings`
    (a pytree of shardings matching the pure parameter dict, for restoring straight into shards)."""
    meta = read_metadata(path)
    config = ModelConfig.from_dict(meta["config"])
    stored = jnp.dtype(meta["dtype"])
    skeleton = abstract_model(config, stored)
    pure = nnx.to_pure_dict(nnx.state(skeleton))
    if shardings is not None:
        pure = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), pure, shardings
        )
    restored = restore_params(path, pure)
    if dtype is not None and jnp.dtype(dtype) != stored:
        restored = jax.tree.map(lambda x: x.astype(dtype), restored)
        skeleton = abstract_model(config, jnp.dtype(dtype))
    graphdef, state = nnx.split(skeleton)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer in `directory/tokenizer.json` (a `ChatTokenizer`: a `tokenizers.Tokenizer` with the
    chat template and special tokens of tokenizer_config.json), or None when there is none."""
    from jaxlongctx.tokenizer import ChatTokenizer

    try:
        return ChatTokenizer.from_directory(directory)
    except Exception as e:
        raise CheckpointError(
            f"{Path(directory) / 'tokenizer.json'}: not a readable tokenizer ({type(e).__name__}: {e})"
        ) from None
