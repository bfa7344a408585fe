"""Import llama.cpp GGUF files (architectures llama, qwen2, qwen3) as jaxlongctx checkpoints.

    jaxlongctx convert --gguf model.gguf --out CKPT [--dtype bf16|fp32]
    jaxlongctx.load("model.gguf")            # converted on the fly

The config comes from the file's metadata, the tokenizer and chat template from its `tokenizer.*`
keys (convert.gguf_tokenizer), the weights tensor by tensor: each is dequantized with `gguf`'s own
dequantizers, presented under its HF name and layout, and written by convert.hf_llama's
`write_checkpoint` into a file-backed buffer, so resident memory stays near one dequantized tensor
(tests/test_gguf.py measures it). `load_gguf` keeps the model plus about one tensor: loading
SmolLM2-135M-Instruct (Q4_1, 513 MiB of fp32 parameters) peaks at 1.13 GB resident against 0.33 GB
for the imports alone (bf16: 0.81 GB); the rest is one dequantized tensor (the 113 MB embedding),
the mapped file (98 MB) and its parsed metadata.

llama.cpp's converter stores the Q and K projections of `llama` models with the rows of each head
interleaved for its pairwise rope; `unpermute_rope_rows` restores HF's half-split order (qwen2 and
qwen3 files use the half-split "neox" rope and are stored unpermuted).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.gguf_tokenizer import chat_tokenizer, tokenizer_files
from convert.hf_llama import ConversionError, stack_params, write_checkpoint
from jaxlongctx.checkpoint import abstract_model
from jaxlongctx.config import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3")
GGUF_MAGIC = b"GGUF"
# Tensor types we dequantize (all with gguf.quants.dequantize).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name -> HF name ({i}: layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFError(ConversionError):
    """A GGUF file that cannot be imported; the message names the file and what is wrong."""


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a GGUF tensor name, or None for a tensor we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rope row order of a Q/K weight `[heads * hd, D]` (or bias `[heads * hd]`):
    within each head llama.cpp stores rows (0, hd/2, 1, hd/2 + 1, ...); HF stores (0, 1, ..., hd - 1)."""
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader` over `path`, after checking that it is a complete GGUF file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise GGUFError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise GGUFError(
                f"{path}: truncated: tensor {t.name!r} needs bytes up to {end:,} but the file has {size:,}"
            )
    return reader


def metadata(reader: Any) -> dict[str, Any]:
    """The file's key-value metadata as Python values (the tokenizer's long arrays included)."""
    out = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            out[key] = field.contents()
    return out


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], where: str) -> ModelConfig:
    """Our ModelConfig from GGUF metadata and the tensor table (`tensors`: GGUF name -> tensor)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{where}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{where}: missing metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(
            f"{where}: partial rope ({arch}.rope.dimension_count={rope_dim} < head_dim={head_dim}) "
            "is not supported"
        )
    if "rope_freqs.weight" in tensors:
        raise GGUFError(
            f"{where}: per-frequency rope factors (tensor 'rope_freqs.weight', Llama 3.1-style rope "
            "scaling) are not supported"
        )
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{where}: missing tensor 'token_embd.weight'")
    vocab = int(meta.get(f"{arch}.vocab_size", int(tensors["token_embd.weight"].shape[1])))
    tok = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, where),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 131072)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        model_type=arch,
        bos_token_id=tok["bos"],
        eos_token_id=tok["eos"],
        pad_token_id=tok["padding"],
    )


def _rope_scaling(meta: dict[str, Any], arch: str, where: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise GGUFError(f"{where}: unsupported rope scaling type {kind!r} (supported: none, linear)")


class GGUFTensorReader:
    """The tensors of a GGUF file under their HF names and layout `(out, in)`, dequantized to float32
    one at a time (the interface of convert.hf_llama.SafetensorsReader)."""

    def __init__(self, path: Path, reader: Any, config: ModelConfig):
        import gguf

        self.path = path
        self.config = config
        self.location: dict[str, Path] = {}
        self._tensors: dict[str, Any] = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise GGUFError(f"{path}: unknown tensor {t.name!r} for a {config.model_type} model")
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported "
                    f"(supported: {', '.join(SUPPORTED_TYPES)})"
                )
            self.location[name] = path
            self._tensors[name] = t
        self._dequantize = gguf.quants.dequantize

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape `(out, in)` of a tensor (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def read(self, name: str) -> np.ndarray:
        """One tensor, dequantized to float32, in HF layout and row order."""
        t = self._tensors[name]
        try:
            w = self._dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        except (ValueError, NotImplementedError) as e:
            raise GGUFError(f"{self.path}: cannot dequantize tensor {t.name!r} ({e})") from None
        if self.config.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.num_heads if ".q_proj." in name else self.config.num_kv_heads
            w = unpermute_rope_rows(w, heads)
        return w


def open_for_import(gguf_file: Path) -> tuple[dict[str, Any], ModelConfig, GGUFTensorReader]:
    """(metadata, config, tensor reader) of a GGUF file, everything checked before any work."""
    reader = open_gguf(gguf_file)
    meta = metadata(reader)
    config = config_from_metadata(meta, {t.name: t for t in reader.tensors}, str(gguf_file))
    return meta, config, GGUFTensorReader(gguf_file, reader, config)


def load_gguf(gguf_file: str | Path, dtype: Any = None, mesh: Any = None) -> Any:
    """A `Model` straight from a GGUF file (no checkpoint written): parameters dequantized tensor by
    tensor into `dtype` (None: float32) and placed on the device (sharded over `mesh` if given) one
    stacked tensor at a time; the tokenizer and chat template come from the metadata."""
    import jax

    from jaxlongctx.model.model import Model
    from jaxlongctx.parallel import param_shardings

    gguf_file = Path(gguf_file)
    meta, config, tensors = open_for_import(gguf_file)
    target = np.dtype(dtype) if dtype is not None else np.dtype(np.float32)
    tokenizer = chat_tokenizer(meta, str(gguf_file)) if "tokenizer.ggml.model" in meta else None
    params = stack_params(tensors, config, target, gguf_file, progress=False)
    leaves, tree = jax.tree.flatten(params)
    del params
    shardings = jax.tree.leaves(param_shardings(config, mesh)) if mesh is not None else [None] * len(leaves)
    for i, sharding in enumerate(shardings):  # one stacked tensor at a time: host + device peak ~ model + 1
        leaves[i] = jax.device_put(leaves[i], sharding)
    graphdef, state = nnx.split(abstract_model(config, jnp.dtype(target)))
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(tree, leaves))
    return Model(nnx.merge(graphdef, state), tokenizer=tokenizer)


def convert_gguf_to_ckpt(
    gguf_file: str | Path,
    out: str | Path,
    dtype: str | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a GGUF file into our checkpoint at `out` (atomic; tokenizer.json and
    tokenizer_config.json with the chat template included); returns `out`."""
    gguf_file = Path(gguf_file)
    meta, config, tensors = open_for_import(gguf_file)
    extras = tokenizer_files(meta, str(gguf_file)) if "tokenizer.ggml.model" in meta else {}
    return write_checkpoint(
        tensors,
        config,
        out,
        dtype or "fp32",
        source=gguf_file,
        extras=extras,
        overwrite=overwrite,
        progress=progress,
    )
