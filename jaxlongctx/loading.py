"""`load`: one entry point for our checkpoints and HuggingFace model directories."""

from __future__ import annotations

import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxlongctx.checkpoint import (
    CheckpointError,
    declares_checkpoint,
    load_module,
    load_tokenizer,
    read_metadata,
)
from jaxlongctx.config import ModelConfig
from jaxlongctx.model.llama import Llama
from jaxlongctx.model.model import Model
from jaxlongctx.parallel import param_shardings

_DTYPE_NAMES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp32": jnp.float32, "float32": jnp.float32}


def parse_dtype(dtype: Any) -> jnp.dtype | None:
    """Accept 'bf16'/'fp32'/jnp dtypes/None; anything else is a ValueError."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype!r} (choose bf16 or fp32)")
        return jnp.dtype(_DTYPE_NAMES[dtype])
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"unsupported dtype {d} (choose bf16 or fp32)")
    return d


def _restore(ckpt: Path, dtype: jnp.dtype | None, mesh: Mesh | None) -> Llama:
    """Restore a checkpoint's module, each tensor straight into its shard when a mesh is given."""
    if mesh is None:
        return load_module(ckpt, dtype)
    config = ModelConfig.from_dict(read_metadata(ckpt)["config"])
    return load_module(ckpt, dtype, param_shardings(config, mesh))


def _load_published(path: Path, dtype: jnp.dtype | None, mesh: Mesh | None, base_config: Any) -> Any:
    """An `ARMTModel` from a directory in the ARMT authors' published format."""
    from convert.armt_hf import read_published

    model = read_published(path, None, base_config)
    if dtype is not None and dtype != model.dtype:
        model = model.astype(dtype)
    if mesh is None:
        return model
    from jaxlongctx.armt import ARMTModel

    with tempfile.TemporaryDirectory(prefix="jaxlongctx-convert-") as tmp:
        sharded = ARMTModel.load(model.save(Path(tmp) / "ckpt"), mesh=mesh)
    sharded.tokenizer = sharded.base.tokenizer = model.tokenizer
    return sharded


def load(path: str | Path, dtype: Any = None, *, mesh: Mesh | None = None, base_config: Any = None) -> Any:
    """Load a model from our checkpoint, a HF model directory or a GGUF file (converted on the fly);
    an ARMT checkpoint (written by `ARMTModel.save`) loads as an `ARMTModel`, with the segmentation
    it was saved with, and so does a directory in the ARMT authors' published format (config.json
    `model_type "armt"`; `base_config`, a HF model directory or config dict, gives its base's config
    when the directory neither holds it nor names a built-in base).

    `dtype` ('bf16' | 'fp32' | None = as stored) casts the parameters; `mesh` (see
    `jaxlongctx.parallel.make_mesh`) shards them, each process reading only its shards.
    """
    path = Path(path)
    target = parse_dtype(dtype)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from convert.gguf_llama import load_gguf

        as_loaded = "float32" if target is None else target.name  # a GGUF loads as float32 by default
        return _through_weight_cache(path, as_loaded, mesh, lambda: load_gguf(path, target, mesh))
    if not path.is_dir():
        raise ValueError(f"{path}: no such model directory (or .gguf file)")
    if not declares_checkpoint(path):
        from convert.armt_hf import is_published_armt

        if is_published_armt(path):
            return _load_published(path, target, mesh, base_config)
        if (path / "config.json").exists():  # a HF model directory
            as_loaded = "stored" if target is None else target.name
            return _through_weight_cache(path, as_loaded, mesh, lambda: _load_hf(path, target, mesh))
    meta = read_metadata(path) if declares_checkpoint(path) else {}  # ours: its errors, not the HF reader's
    if "armt" in meta:
        from jaxlongctx.armt import ARMTModel

        armt = ARMTModel.load(path, target, mesh, load_base=load)
        # a memory-only checkpoint has no tokenizer.json: its base's tokenizer stays
        armt.tokenizer = armt.base.tokenizer = load_tokenizer(path) or armt.tokenizer
        armt.segmentation = meta.get("segmentation", "fixed")  # as saved (checkpoints before it: the grid)
        return armt
    if not meta:
        raise CheckpointError(
            f"{path}: neither a jaxlongctx checkpoint nor a HF model directory (no config.json)"
        )
    return Model(_restore(path, target, mesh), tokenizer=load_tokenizer(path))


def _load_hf(path: Path, target: jnp.dtype | None, mesh: Mesh | None) -> Model:
    """A HF model directory, converted to our checkpoint in a temporary folder and restored."""
    from convert.hf_llama import convert_hf_to_ckpt

    with tempfile.TemporaryDirectory(prefix="jaxlongctx-convert-") as tmp:
        ckpt = convert_hf_to_ckpt(path, Path(tmp) / "ckpt", progress=False)
        return Model(_restore(ckpt, target, mesh), tokenizer=load_tokenizer(path))


def _through_weight_cache(
    source: Path, as_loaded: str, mesh: Mesh | None, convert: Callable[[], Model]
) -> Model:
    """`convert()` the model at `source`, or read its converted weights (in dtype `as_loaded`) from the
    disk cache (`jaxlongctx.weight_cache`) when it is on; a conversion without a mesh fills the cache."""
    from jaxlongctx.disk_cache import weights_cache_dir

    root = weights_cache_dir()
    if root is None:
        return convert()
    from jaxlongctx import weight_cache

    entry = weight_cache.entry_dir(root, source, as_loaded)
    cached = weight_cache.read_entry(entry)
    if cached is not None:
        return _model_from_arrays(ModelConfig.from_dict(cached[0]), *cached[1:], load_tokenizer(entry), mesh)
    model = convert()
    if mesh is None:  # written beside the first answer (the process waits for it before exiting)
        from flax import nnx

        arrays = {"/".join(k): np.asarray(v) for k, v in _flat(nnx.to_pure_dict(model.params))}
        args = (entry, source, model.config.to_dict(), arrays, model.tokenizer)
        threading.Thread(target=_write_cache_entry, args=args, name="jaxlongctx-weight-cache").start()
    return model


def _write_cache_entry(entry: Path, *args: Any) -> None:
    """`weight_cache.write_entry`, a failure only warned about (the cache costs speed, not results)."""
    from jaxlongctx import weight_cache

    try:
        weight_cache.write_entry(entry, *args)
    except OSError as e:
        print(f"warning: converted weights not cached in {entry.parent} ({e})", file=sys.stderr)


def _flat(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, leaf) of a nested dict of parameters."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _model_from_arrays(
    config: ModelConfig, arrays: dict[str, np.ndarray], tokenizer: Any, mesh: Mesh | None
) -> Model:
    """A `Model` from host parameters named by "/"-joined key paths, put on the device (sharded over `mesh`)."""
    import jax
    from flax import nnx

    from jaxlongctx.checkpoint import abstract_model

    graphdef, state = nnx.split(abstract_model(config, jnp.dtype(arrays["embed"].dtype)))
    shardings = dict(_flat(param_shardings(config, mesh))) if mesh is not None else {}
    tree: dict[str, Any] = {}
    for name, array in arrays.items():
        keys = tuple(name.split("/"))
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = jax.device_put(array, shardings.get(keys))
    nnx.replace_by_pure_dict(state, tree)
    return Model(nnx.merge(graphdef, state), tokenizer=tokenizer)
