"""The ARMT authors' published checkpoint format (HF `model_type "armt"`, `InnerLoopARMTForCausalLM`;
spec/armt_published.md) to our ARMT checkpoint and back.

A published directory holds `config.json` (the ARMT fields, the base named by `base_model_name` or
inline in `base_model_config`) and safetensors whose base keys sit one level deeper than a plain HF
Llama's (`model.` in front, `.layer.` inside each decoder layer) next to the memory parameters
(`memory`, `sink`, `model.model.layers.{i}.W_m{q,k,v,b}.*`). Import maps it to `ARMTConfig` options
(`published_armt_config`) and writes our checkpoint with `ARMTModel.save`; export writes the
published layout back (tensors bit-exact) with the original config.json fields kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from convert.hf_llama import (
    _EXTRA_FILES,
    ConversionError,
    SafetensorsReader,
    _lookup,
    _target_dtype,
    stack_params,
    tensor_rules,
)
from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.checkpoint import abstract_model, atomic_directory, load_tokenizer, read_metadata
from jaxlongctx.config import ConfigError, ModelConfig
from jaxlongctx.output_dir import check_output

ARCHITECTURE = "InnerLoopARMTForCausalLM"
SOURCE_CONFIG = "armt_hf_config.json"  # the published config.json, kept in our checkpoint for export
_LAYER = "model.layers.{i}."

# Configs of the bases the published checkpoints name (the hub's config.json, spec/armt_published.md 6).
KNOWN_BASES: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.2-1B": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
}

# Published options that change the computation and that this library does not implement.
_REFUSED = {
    "act_on": "adaptive computation time (ACT)",
    "wrap_pos": "wrap_pos",
}


def is_published_armt(directory: str | Path) -> bool:
    """Whether `directory` holds a published-format ARMT (its config.json says `model_type "armt"`)."""
    file = Path(directory) / "config.json"
    try:
        return file.is_file() and json.loads(file.read_text()).get("model_type") == "armt"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def _read_config(directory: Path) -> dict[str, Any]:
    file = directory / "config.json"
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{file}: not a readable config.json ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "armt":
        raise ConversionError(f"{file}: not a published ARMT config (model_type is not 'armt')")
    return cfg


def base_config(cfg: dict[str, Any], where: str, given: Any = None) -> ModelConfig:
    """The base model's config: `given` (a HF model directory, a config.json path or a dict) if set,
    else the inline `base_model_config`, else the built-in config of the named `base_model_name`."""
    inline, name = cfg.get("base_model_config"), cfg.get("base_model_name")
    try:
        if given is not None:
            return ModelConfig.from_hf(given)
        if isinstance(inline, dict):
            return ModelConfig.from_hf(inline)
        if name in KNOWN_BASES:
            return ModelConfig.from_hf(KNOWN_BASES[name])
    except ConfigError as e:
        what = "base config" if given is not None else f"{where}: base config"
        raise ConversionError(f"{what}: {e}") from None
    raise ConversionError(
        f"{where}: unknown base model {cfg.get('base_model_name')!r} and no base_model_config; give the "
        f"base's config (base_config= / --base-config DIR); built-in bases: {', '.join(KNOWN_BASES)}"
    )


def published_armt_config(cfg: dict[str, Any], where: str) -> ARMTConfig:
    """`ARMTConfig` of a published config.json dict; options this library does not run are refused by name."""
    if cfg.get("architectures") not in (None, [ARCHITECTURE]):
        raise ConversionError(
            f"{where}: unsupported architectures {cfg['architectures']!r} (only {ARCHITECTURE})"
        )
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise ConversionError(f"{where}: unsupported option {key}={cfg[key]!r} ({what})")
    if cfg.get("segment_alignment", "left") != "left":
        raise ConversionError(
            f"{where}: unsupported option segment_alignment={cfg['segment_alignment']!r} (only 'left')"
        )
    if cfg.get("wrap_layers") is not None:
        raise ConversionError(f"{where}: unsupported option wrap_layers={cfg['wrap_layers']!r} (only null)")
    spellings = {k: cfg[k] for k in ("sliding_window", "sliding_window_enabled") if k in cfg}
    if len({bool(v) for v in spellings.values()}) > 1:
        raise ConversionError(f"{where}: sliding_window and sliding_window_enabled disagree: {spellings}")
    memory_dtype = cfg.get("memory_dtype") or cfg.get("model_dtype") or "float32"
    try:
        return ARMTConfig(
            segment_size=cfg.get("segment_size", 512),
            num_mem_tokens=cfg.get("num_mem_tokens", 16),
            d_mem=cfg.get("d_mem", 512),
            state_dtype=jnp.bfloat16 if memory_dtype in ("bfloat16", "bf16") else jnp.float32,
            sink=bool(cfg.get("use_sink", False)),
            sliding_window=any(bool(v) for v in spellings.values()),
            normalize_features=True,
            gamma_eps=0.0,
            mem_heads=cfg.get("n_heads", 1),
            gating=bool(cfg.get("gating", False)),
            correction=bool(cfg.get("correction", True)),
            use_denom=bool(cfg.get("use_denom", True)),
        )
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None


def _memory_rules(armt: ARMTConfig) -> list[tuple[str, str, bool, bool]]:
    """(our memory parameter, published name, transposed, per layer) of every memory tensor."""
    rules = [("memory", "memory", False, False)] + ([("sink", "sink", False, False)] if armt.sink else [])
    lyr = "model." + _LAYER
    rules += [
        ("wq", lyr + "W_mq.weight", True, True),
        ("wk", lyr + "W_mk.weight", True, True),
        ("wv", lyr + "W_mv.weight", True, True),
        ("wb", lyr + "W_mb.weight", True, True),
        ("bb", lyr + "W_mb.bias", False, True),
    ]
    return rules


def _published_name(hf_name: str) -> str:
    """A plain HF Llama tensor name -> its name in the published layout."""
    return "model." + hf_name.replace("model.layers.{i}.", "model.layers.{i}.layer.")


class _BaseView:
    """The base tensors of a published reader under their plain HF names (for `stack_params`)."""

    def __init__(self, reader: SafetensorsReader, names: dict[str, str]):
        self._reader, self._names = reader, names  # HF name -> published name
        self.location = {hf: reader.location[pub] for hf, pub in names.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(self._names[name])

    def read(self, name: str) -> np.ndarray:
        return self._reader.read(self._names[name])


def _memory_skeleton(armt: ARMTConfig, config: ModelConfig, dtype: np.dtype) -> Any:
    """`MemoryParams` of these configs with abstract (shape-only) parameters."""
    from jaxlongctx.armt.params import MemoryParams

    return nnx.eval_shape(
        lambda: MemoryParams(
            armt, config.num_layers, config.hidden_size, 1.0, dtype=dtype, key=jax.random.key(0)
        )
    )


def _memory_arrays(
    reader: SafetensorsReader, armt: ARMTConfig, config: ModelConfig, target: np.dtype, source: Path
) -> dict[str, np.ndarray]:
    """Our memory parameters (pure dict, stacked `[L, ...]`) from the published tensors, shapes checked."""
    skeleton = nnx.to_pure_dict(nnx.state(_memory_skeleton(armt, config, target)))
    out: dict[str, np.ndarray] = {}
    squeezed = ("wb", "bb") if armt.beta_width(config.hidden_size) == 1 else ()
    for ours, template, transpose, per_layer in _memory_rules(armt):
        want = skeleton[ours].shape
        one = want[1:] if per_layer else want
        stacked = np.empty(want, target)
        for i in range(config.num_layers) if per_layer else [None]:
            name = template.format(i=i)
            if name not in reader.location:
                raise ConversionError(f"{source}: missing tensor {name!r}")
            stored = one + (1,) if ours in squeezed else one  # one memory head: W_mb [1, D], b_mb [1]
            stored = tuple(reversed(stored)) if transpose else stored
            if reader.shape(name) != stored:
                raise ConversionError(
                    f"{reader.location[name]}: tensor {name!r} has shape {reader.shape(name)}, expected "
                    f"{stored} from the ARMT config"
                )
            t = reader.read(name)
            t = (t.T if transpose else t).reshape(one)
            if not np.isfinite(t).all():
                raise ConversionError(
                    f"{reader.location[name]}: tensor {name!r} holds NaN or infinite values"
                )
            if per_layer:
                stacked[i] = t.astype(target)
            else:
                stacked[...] = t.astype(target)
        out[ours] = stacked
    return out


def read_published(
    directory: str | Path, dtype: str | None = None, given_base: Any = None, *, progress: bool = False
) -> Any:
    """An `ARMTModel` (on the default device) from a published directory."""
    from jaxlongctx.armt import ARMTModel

    source = Path(directory)
    if not source.is_dir():
        raise ConversionError(f"{source}: not a directory")
    where = str(source / "config.json")
    cfg = _read_config(source)
    armt = published_armt_config(cfg, where)
    config = base_config(cfg, where, given_base)
    reader = SafetensorsReader(source)
    names = {}
    for rule in tensor_rules(config):
        for i in range(config.num_layers) if rule.per_layer else [None]:
            names[rule.template.format(i=i)] = _published_name(rule.template).format(i=i)
    memory_names = {
        t.format(i=i)
        for _, t, _, per_layer in _memory_rules(armt)
        for i in (range(config.num_layers) if per_layer else [None])
    }
    if config.tie_word_embeddings and "model.lm_head.weight" in reader.location:
        names["lm_head.weight"] = "model.lm_head.weight"  # a duplicated tied head: checked equal
    unknown = sorted(set(reader.location) - set(names.values()) - memory_names)
    if unknown:
        raise ConversionError(
            f"{reader.location[unknown[0]]}: unknown tensor {unknown[0]!r} for this ARMT config"
        )
    for pub in names.values():
        if pub not in reader.location:
            raise ConversionError(f"{source}: missing tensor {pub!r}")
    target = _target_dtype(reader, dtype)
    memory_pure = _memory_arrays(reader, armt, config, target, source)  # small: checked before the base
    params = stack_params(_BaseView(reader, names), config, target, source, progress=progress)
    graphdef, state = nnx.split(abstract_model(config, jnp.dtype(target)))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params))
    base = nnx.merge(graphdef, state)
    skeleton = _memory_skeleton(armt, config, target)
    mgraph, mstate = nnx.split(skeleton)
    nnx.replace_by_pure_dict(mstate, {k: jnp.asarray(v) for k, v in memory_pure.items()})
    model = ARMTModel(base, armt, nnx.merge(mgraph, mstate), load_tokenizer(source))
    model.published_config = cfg
    return model


def convert_armt_hf_to_ckpt(
    directory: str | Path,
    out: str | Path,
    dtype: str | None = None,
    *,
    base_config_dir: Any = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a published ARMT directory into our ARMT checkpoint at `out` (atomic); returns `out`."""
    source = Path(directory)
    check_output(out, overwrite=overwrite, inputs=(source,))
    model = read_published(source, dtype, base_config_dir, progress=progress)
    record = json.dumps(model.published_config, indent=2) + "\n"
    model.save(out, overwrite=overwrite, extra_files={SOURCE_CONFIG: record})
    return Path(out)


def export_ckpt_to_armt_hf(ckpt: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write our ARMT checkpoint `ckpt` (with the published cell) in the published layout at `out`:
    `config.json` and `model.safetensors` (same dtype; a tied head is left out); import then export
    is bit-exact."""
    from jaxlongctx.armt import ARMTModel

    ckpt = Path(ckpt)
    meta = read_metadata(ckpt)
    if "armt" not in meta or "base" in meta:
        raise ConversionError(f"{ckpt}: not a full ARMT checkpoint (export needs the base weights inside)")
    armt = ARMTConfig.from_dict(meta["armt"])
    if not (armt.normalize_features and armt.gamma_eps == 0.0):
        raise ConversionError(
            f"{ckpt}: its ARMT cell is not the published one (normalize_features, gamma_eps 0)"
        )
    check_output(out, overwrite=overwrite, inputs=(ckpt,))
    model = ARMTModel.load(ckpt)
    config = model.config
    base = nnx.to_pure_dict(model.base.params)
    tensors: dict[str, np.ndarray] = {}
    for rule in tensor_rules(config):
        value = np.asarray(_lookup(base, rule.ours))
        for i in range(config.num_layers) if rule.per_layer else [None]:
            t = value[i] if rule.per_layer else value
            tensors[_published_name(rule.template).format(i=i)] = np.ascontiguousarray(
                t.T if rule.transpose else t
            )
    memory = nnx.to_pure_dict(nnx.state(model.memory))
    for ours, template, transpose, per_layer in _memory_rules(armt):
        value = np.asarray(memory[ours])
        for i in range(config.num_layers) if per_layer else [None]:
            t = value[i] if per_layer else value
            if ours in ("wb", "bb") and t.ndim == (1 if ours == "wb" else 0):
                t = t[..., None]  # one memory head: W_mb [1, D], b_mb [1]
            tensors[template.format(i=i)] = np.ascontiguousarray(t.T if transpose else t)
    hf = _export_config(ckpt, armt, config, str(model.dtype))
    with atomic_directory(out, overwrite=overwrite, kind="armt-hf-export", inputs=(ckpt,)) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        for extra in _EXTRA_FILES:
            if (ckpt / extra).exists():
                shutil.copy(ckpt / extra, tmp / extra)
    return Path(out)


def _export_config(ckpt: Path, armt: ARMTConfig, config: ModelConfig, dtype: str) -> dict[str, Any]:
    """The published config.json of a checkpoint: the imported one (if any) with our ARMT fields."""
    file = ckpt / SOURCE_CONFIG
    hf: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    hf.update(
        model_type="armt",
        architectures=[ARCHITECTURE],
        segment_size=armt.segment_size,
        num_mem_tokens=armt.num_mem_tokens,
        d_mem=armt.d_mem,
        n_heads=armt.mem_heads,
        use_sink=armt.sink,
        sliding_window=armt.sliding_window,
        gating=armt.gating,
        correction=armt.correction,
        use_denom=armt.use_denom,
        segment_alignment="left",
        wrap_layers=None,
    )
    hf.pop("sliding_window_enabled", None)
    if not isinstance(hf.get("base_model_config"), dict) and hf.get("base_model_name") not in KNOWN_BASES:
        hf["base_model_name"] = None
        hf["base_model_config"] = config.to_hf()
    hf.setdefault("dtype", dtype)
    return hf
