"""Convert HuggingFace Llama-family checkpoints (safetensors) to jaxlongctx checkpoints and back
(command line: `convert.cli`).

Import streams tensor by tensor: each stacked `[L, ...]` parameter is assembled in a file-backed
buffer inside the (temporary) output directory, so resident memory stays near one stacked tensor.
Every tensor is accounted for: missing, unknown, duplicated or wrongly shaped tensors, corrupt
files and unsupported configs are errors naming the file and tensor, and no output is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from jaxlongctx.checkpoint import (
    abstract_model,
    atomic_directory,
    read_metadata,
    restore_params,
    save_params,
    write_metadata,
)
from jaxlongctx.config import ModelConfig
from jaxlongctx.output_dir import OutputError, check_free_space, check_output

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32}
# Tensors some exporters write that carry no weights.
_IGNORED = ("rotary_emb.inv_freq",)
# Files next to the weights that travel with a model through import and export.
_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorRule:
    """How one of our parameters maps to HF tensors: `template` with `{i}` for the layer index."""

    ours: tuple[str, ...]
    template: str
    transpose: bool
    per_layer: bool


def tensor_rules(config: ModelConfig) -> list[TensorRule]:
    """The HF name of every parameter of a model with this config."""
    lyr = "model.layers.{i}."
    rules = [
        TensorRule(("embed",), "model.embed_tokens.weight", False, False),
        TensorRule(("final_norm",), "model.norm.weight", False, False),
        TensorRule(("layers", "input_norm"), lyr + "input_layernorm.weight", False, True),
        TensorRule(("layers", "post_norm"), lyr + "post_attention_layernorm.weight", False, True),
        TensorRule(("layers", "wq"), lyr + "self_attn.q_proj.weight", True, True),
        TensorRule(("layers", "wk"), lyr + "self_attn.k_proj.weight", True, True),
        TensorRule(("layers", "wv"), lyr + "self_attn.v_proj.weight", True, True),
        TensorRule(("layers", "wo"), lyr + "self_attn.o_proj.weight", True, True),
        TensorRule(("layers", "w_gate"), lyr + "mlp.gate_proj.weight", True, True),
        TensorRule(("layers", "w_up"), lyr + "mlp.up_proj.weight", True, True),
        TensorRule(("layers", "w_down"), lyr + "mlp.down_proj.weight", True, True),
    ]
    if not config.tie_word_embeddings:
        rules.append(TensorRule(("lm_head",), "lm_head.weight", True, False))
    if config.qkv_bias:
        rules += [
            TensorRule(("layers", f"b{x}"), lyr + f"self_attn.{x}_proj.bias", False, True) for x in "qkv"
        ]
    if config.o_bias:
        rules.append(TensorRule(("layers", "bo"), lyr + "self_attn.o_proj.bias", False, True))
    if config.qk_norm:
        rules += [
            TensorRule(("layers", f"{x}_norm"), lyr + f"self_attn.{x}_norm.weight", False, True) for x in "qk"
        ]
    return rules


class SafetensorsReader:
    """Lazy access to the tensors of a HF directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: Path):
        self.hf_dir = hf_dir
        pickled = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt"))
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            hint = (
                (
                    f" (found pickled PyTorch files {pickled}: they are refused because loading them "
                    "would run arbitrary code; re-save the model with safetensors)"
                )
                if pickled
                else ""
            )
            raise ConversionError(f"{hf_dir}: no *.safetensors files{hint}")
        index_file = hf_dir / "model.safetensors.index.json"
        expected_files: dict[str, str] | None = None
        if index_file.exists():
            try:
                expected_files = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index_file}: corrupt index ({e})") from None
            files = sorted({hf_dir / f for f in expected_files.values()})
        self.location: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for f in files:
            if not f.exists():
                raise ConversionError(f"{f}: listed in {index_file.name} but missing")
            try:
                handle = safe_open(str(f), framework="numpy")
                names = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise ConversionError(f"{f}: corrupt safetensors file ({e})") from None
            self._handles[f] = handle
            for name in names:
                if name in self.location:
                    raise ConversionError(
                        f"tensor {name!r} appears twice: in {self.location[name].name} and {f.name}"
                    )
                if expected_files is not None and expected_files.get(name) != f.name:
                    raise ConversionError(
                        f"{f}: tensor {name!r} is not listed for this file in {index_file.name}"
                    )
                self.location[name] = f
        if expected_files is not None:
            missing = sorted(set(expected_files) - set(self.location))
            if missing:
                raise ConversionError(f"{index_file}: tensor {missing[0]!r} is listed but in no file")

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor without reading it."""
        return tuple(self._handles[self.location[name]].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        """Read one tensor as numpy."""
        f = self.location[name]
        try:
            return self._handles[f].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ConversionError(f"{f}: cannot read tensor {name!r} ({e})") from None


def _target_dtype(reader: SafetensorsReader, dtype: str | None) -> np.dtype:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConversionError(f"unsupported --dtype {dtype!r} (choose from {', '.join(DTYPES)})")
        return np.dtype(DTYPES[dtype])
    first = next(iter(reader.location))
    src = reader.read(first).dtype
    return np.dtype(ml_dtypes.bfloat16) if src == np.dtype(ml_dtypes.bfloat16) else np.dtype(np.float32)


def convert_hf_to_ckpt(
    hf_dir: str | Path,
    out: str | Path,
    dtype: str | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a HF model directory into our checkpoint at `out` (atomic); returns `out`."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"{hf_dir}: not a directory")
    config = ModelConfig.from_hf(hf_dir / "config.json")
    reader = SafetensorsReader(hf_dir)
    extras = {name: (hf_dir / name).read_bytes() for name in _EXTRA_FILES if (hf_dir / name).exists()}
    return write_checkpoint(
        reader, config, out, dtype, source=hf_dir, extras=extras, overwrite=overwrite, progress=progress
    )


def write_checkpoint(
    reader: Any,
    config: ModelConfig,
    out: str | Path,
    dtype: str | None,
    *,
    source: Path,
    extras: dict[str, bytes],
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write our checkpoint at `out` (atomic) from `reader`'s tensors, which carry HF names and layout
    (`reader.location`, `.shape(name)`, `.read(name)`: SafetensorsReader or a GGUF reader); every
    tensor the config needs must be there and no other. `extras` are files (name -> bytes) to add."""
    target = _target_dtype(reader, dtype)
    skeleton = nnx.to_pure_dict(nnx.state(abstract_model(config, jnp.dtype(target))))
    model_bytes = sum(x.size * target.itemsize for x in jax.tree.leaves(skeleton))
    check_free_space(out, 2 * model_bytes)  # the stacking buffers and the checkpoint, side by side
    with atomic_directory(out, overwrite=overwrite, inputs=(source,)) as tmp:
        buffers = tmp / "buffers"
        buffers.mkdir()
        params = stack_params(
            reader,
            config,
            target,
            source,
            progress=progress,
            allocate=lambda name, shape: allocated_memmap(buffers / f"{name}.npy", target, shape),
        )
        save_params(tmp, params)
        del params
        shutil.rmtree(buffers)
        write_metadata(tmp, config, str(target), {"source": str(source.absolute())})
        for name, content in extras.items():
            (tmp / name).write_bytes(content)
    return Path(out)


def stack_params(
    reader: Any,
    config: ModelConfig,
    target: np.dtype,
    source: Path,
    *,
    progress: bool = True,
    allocate: Any = None,
) -> dict[str, Any]:
    """Our pure parameter dict (per-layer leaves stacked `[L, ...]`) from `reader`'s HF-named tensors,
    read one at a time into buffers from `allocate(name, shape)` (default: in memory); checks that
    every tensor the config needs is there with its shape and no other."""
    rules = tensor_rules(config)
    expected = {
        rule.template.format(i=i)
        for rule in rules
        for i in (range(config.num_layers) if rule.per_layer else [0])
    }
    known = set(reader.location)
    if config.tie_word_embeddings and "lm_head.weight" in known:
        known.discard("lm_head.weight")  # some exporters write the tied head too; checked below
        tied_copy = True
    else:
        tied_copy = False
    unknown = sorted(n for n in known - expected if not n.endswith(_IGNORED))
    if unknown:
        raise ConversionError(
            f"{reader.location[unknown[0]]}: unknown tensor {unknown[0]!r} "
            f"for a {config.model_type} model with this config"
        )
    missing = sorted(expected - known)
    if missing:
        raise ConversionError(f"{source}: missing tensor {missing[0]!r}")

    skeleton = nnx.to_pure_dict(nnx.state(abstract_model(config, jnp.dtype(target))))
    allocate = allocate or (lambda name, shape: np.empty(shape, target))
    params: dict[str, Any] = {}
    with tqdm(rules, desc="convert", unit="tensor", disable=not progress) as bar:  # closed on errors too
        for rule in bar:
            spec = _lookup(skeleton, rule.ours)
            bar.set_postfix_str(".".join(rule.ours))
            buf = allocate("_".join(rule.ours), spec.shape)
            for i in range(config.num_layers) if rule.per_layer else [None]:
                name = rule.template.format(i=i)
                want = spec.shape[1:] if rule.per_layer else spec.shape
                hf_want = tuple(reversed(want)) if rule.transpose else tuple(want)
                got = reader.shape(name)
                if got != hf_want:
                    raise ConversionError(
                        f"{reader.location[name]}: tensor {name!r} has shape {got}, "
                        f"expected {hf_want} from the model config"
                    )
                t = reader.read(name)
                if not np.isfinite(t).all():
                    raise ConversionError(
                        f"{reader.location[name]}: tensor {name!r} holds NaN or infinite values"
                    )
                t = (t.T if rule.transpose else t).astype(target)
                if rule.per_layer:
                    buf[i] = t
                else:
                    buf[...] = t
            if isinstance(buf, np.memmap):
                buf.flush()
            _assign(params, rule.ours, buf)
    if tied_copy and not np.array_equal(reader.read("lm_head.weight").astype(target), params["embed"]):
        raise ConversionError(
            f"{reader.location['lm_head.weight']}: tensor 'lm_head.weight' differs from "
            "the embedding although tie_word_embeddings is true"
        )
    return params


def export_ckpt_to_hf(ckpt: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Export our checkpoint to a HF directory (`config.json`, `model.safetensors`) that
    `transformers` loads; HF -> ours -> HF is bit-exact."""
    meta = read_metadata(ckpt)
    config = ModelConfig.from_dict(meta["config"])
    check_output(out, overwrite=overwrite, inputs=(ckpt,))
    skeleton = nnx.to_pure_dict(nnx.state(abstract_model(config, jnp.dtype(meta["dtype"]))))
    params = restore_params(ckpt, skeleton)
    tensors: dict[str, np.ndarray] = {}
    for rule in tensor_rules(config):
        value = np.asarray(_lookup(params, rule.ours))
        for i in range(config.num_layers) if rule.per_layer else [None]:
            t = value[i] if rule.per_layer else value
            tensors[rule.template.format(i=i)] = np.ascontiguousarray(t.T if rule.transpose else t)
    with atomic_directory(out, overwrite=overwrite, kind="hf-export", inputs=(ckpt,)) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_config = config.to_hf()
        hf_config["torch_dtype"] = "bfloat16" if meta["dtype"] == "bfloat16" else "float32"
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for extra in _EXTRA_FILES:
            if (Path(ckpt) / extra).exists():
                shutil.copy(Path(ckpt) / extra, tmp / extra)
    return Path(out)


def allocated_memmap(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.memmap:
    """A `.npy` file-backed buffer whose disk blocks are reserved up front, so that a full disk is an
    OSError here rather than a SIGBUS when a page of the mapping is first written."""
    buf = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as e:
            raise OutputError(
                f"{path}: cannot reserve {os.fstat(f.fileno()).st_size / 2**20:,.0f} MiB ({e.strerror})"
            ) from None
    return buf


def _lookup(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _assign(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
