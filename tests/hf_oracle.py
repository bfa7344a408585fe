"""Tiny random HuggingFace models of every supported family, saved with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# One small config per family; each exercises a feature of the converter and model.
FAMILIES: dict[str, dict] = {
    "llama32": dict(  # Llama-3.2 style: tied embeddings, llama3 rope scaling, GQA 4:1
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama2": dict(  # Llama-2 style: untied, MHA
        model_type="llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "llama_linear": dict(  # linear rope scaling + attention bias
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        attention_bias=True,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=None,
    ),
    "qwen2": dict(  # q/k/v bias
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(  # per-head q/k norm, head_dim != hidden / heads
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
    ),
}

VOCAB = 256


def make_hf_model(
    family: str, out: Path, *, seed: int = 0, max_shard_size: str | None = None, dtype: str = "float32"
):
    """Build a random `transformers` model of a family, save it to `out`, return the torch model."""
    torch = pytest.importorskip("torch")  # the oracle; absent on the jax-min lane
    transformers = pytest.importorskip("transformers")

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **spec,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights, so that every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return model


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """float32 logits of a torch model for ids `[B, T]` with padding mask."""
    import torch

    with torch.no_grad():
        m = torch.tensor(mask, dtype=torch.long)
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=m, position_ids=pos)
    return out.logits.float().numpy()
