"""Model configuration for the Llama family, read from and written to HuggingFace `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ConfigError(ValueError):
    """A model configuration that jaxlongctx cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3"|"linear", ...}
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, Llama attention_bias
    o_bias: bool = False  # Llama attention_bias
    qk_norm: bool = False  # Qwen3 per-head RMSNorm on q and k
    sliding_window: int | None = None  # Mistral; we run full attention and refuse longer inputs
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"config field {name!r} must be a positive finite number, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("llama3", "linear"):
            raise ConfigError(
                f"unsupported rope_scaling type {self.rope_scaling.get('rope_type')!r} "
                "(supported: none, 'llama3', 'linear')"
            )

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_length(self) -> int:
        """Longest sequence the model may attend over (sliding-window models refuse longer)."""
        return self.sliding_window if self.sliding_window else 1 << 31

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (our own checkpoint metadata)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`."""
        if not isinstance(d, dict):
            raise ConfigError(f"the model config must be a JSON object, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"unknown model config fields: {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # a required field missing
            raise ConfigError(f"incomplete model config ({e})") from None

    # --- HuggingFace interchange -------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a HuggingFace Llama/Mistral/Qwen2/Qwen3 `config.json` (a path, a model dir or a dict)."""
        if isinstance(path_or_dict, dict):
            hf, where = path_or_dict, "config"
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ConfigError(f"{path}: no such config file")
            try:
                hf = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
            except UnicodeDecodeError:
                raise ConfigError(f"{path}: not UTF-8 text") from None
            where = str(path)
        if not isinstance(hf, dict):
            raise ConfigError(f"{where}: must hold a JSON object, got {type(hf).__name__}")
        try:
            return _from_hf_dict(hf, where)
        except ConfigError:
            raise
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
            raise ConfigError(
                f"{where}: a field has the wrong type or value ({type(e).__name__}: {e})"
            ) from None

    def to_hf(self) -> dict[str, Any]:
        """A HuggingFace `config.json` dict that `transformers` loads as the same model."""
        arch = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }[self.model_type]
        hf: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("llama", "mistral"):
            if self.qkv_bias != self.o_bias:
                raise ConfigError("llama/mistral configs have q/k/v and o biases together or not at all")
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = False
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            hf["sliding_window"] = self.sliding_window
            if self.model_type != "mistral":
                hf["use_sliding_window"] = False
        if self.model_type == "qwen3":
            hf["attention_bias"] = False
        return hf


_HF_INTEGER_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "sliding_window",
)


def _from_hf_dict(hf: dict[str, Any], where: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise ConfigError(f"{where}: missing required field {key!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: unsupported hidden_act {act!r} (only 'silu')")
    if hf.get("mlp_bias"):
        raise ConfigError(f"{where}: unsupported field mlp_bias=true")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError(f"{where}: unsupported field pretraining_tp={hf['pretraining_tp']}")
    for key, value in hf.items():
        if (
            key in _HF_INTEGER_FIELDS
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int))
        ):
            raise ConfigError(f"{where}: field {key!r} must be an integer, got {value!r}")
    heads = hf["num_attention_heads"]
    if heads <= 0:
        raise ConfigError(f"{where}: field 'num_attention_heads' must be positive, got {heads}")
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)

    # Rope: transformers >= 5 writes `rope_parameters`; older versions `rope_theta` + `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or rope or None
    scaling = _normalise_rope_scaling(scaling, where)

    sliding = None
    if model_type == "mistral" or hf.get("use_sliding_window"):
        sliding = hf.get("sliding_window")
    if model_type == "qwen2" or model_type == "qwen3":
        qkv_bias, o_bias = model_type == "qwen2", False
        if model_type == "qwen3" and hf.get("attention_bias"):
            qkv_bias, o_bias = True, True
    else:
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=hf.get("pad_token_id"),
    )


def _normalise_rope_scaling(scaling: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """Map HF rope scaling dicts (old `type` or new `rope_type` keys) to ours; None for plain RoPE."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        try:
            return {
                "rope_type": "llama3",
                "factor": float(scaling["factor"]),
                "low_freq_factor": float(scaling["low_freq_factor"]),
                "high_freq_factor": float(scaling["high_freq_factor"]),
                "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
            }
        except KeyError as e:
            raise ConfigError(f"{where}: llama3 rope_scaling is missing {e.args[0]!r}") from None
    raise ConfigError(f"{where}: unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def eos_ids(config: ModelConfig) -> tuple[int, ...]:
    """The end-of-sequence ids of a config as a tuple (HF allows an int or a list)."""
    eos = config.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
