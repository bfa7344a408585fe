"""Codebooks tied to a model: the model fingerprint recorded in them, the check that they fit a model,
loading them for one, and the calibrated codebooks shipped with the package."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.kvcache.codebooks import Codebooks, codebooks_fingerprint, load_codebooks
from jaxlongctx.model.model import Model

FINGERPRINT_SAMPLES = 4096  # parameter values hashed per leaf (evenly strided)
ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Codebooks shipped for the models they were calibrated on (found by the model's fingerprint):
# SmolLM2-135M-Instruct: 4-bit ds 1 per layer, attention-weighted, from 8K tokens of the calibration
# split (`jaxlongctx calibrate --ds 1 --bits 4 --granularity layer --weighting attention --seq-len 8192
# --max-tokens 8192 --points-per-centroid 1024`); the shipped tiny base model: 8-bit ds 2, shared.
SHIPPED_CODEBOOKS = (ASSETS / "smollm2_pq_ds1_4bit", ASSETS / "base_model_pq_ds2")


def model_fingerprint(model: Model) -> str:
    """Stable hash of the config and a strided sample of every parameter (rounded to bf16, so dtype-independent)."""
    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    leaves = jax.tree_util.tree_flatten_with_path(model.params)[0]
    for path, leaf in sorted(leaves, key=lambda pl: jax.tree_util.keystr(pl[0])):
        flat = np.asarray(jax.device_get(leaf)).ravel()  # host copy: also works for sharded parameters
        step = max(1, flat.size // FINGERPRINT_SAMPLES)
        sample = flat[::step].astype(jnp.bfloat16).astype(np.float32)
        h.update(f"{jax.tree_util.keystr(path)}{tuple(leaf.shape)}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()[:16]


def check_codebooks(model: Model, codebooks: Codebooks) -> None:
    """ValueError unless `codebooks` fit the model's shapes and (when recorded) its fingerprint."""
    if not isinstance(codebooks, Codebooks):
        raise ValueError(
            f"codebooks must be a Codebooks (see load_codebooks), got {type(codebooks).__name__}"
        )
    cfg = model.config
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    got = (codebooks.num_layers, codebooks.num_kv_heads, codebooks.head_dim)
    if got != want:
        raise ValueError(f"codebooks are for (layers, kv heads, head dim) = {got}, the model has {want}")
    found = codebooks.model_fingerprint
    if found and found != model_fingerprint(model):
        raise ValueError(
            f"codebooks were calibrated on another model (fingerprint {found}, "
            f"this model is {model_fingerprint(model)}); run `jaxlongctx calibrate` for it"
        )


def load_codebooks_for(model: Model, path: str | Path) -> Codebooks:
    """Load codebooks from `path` and check they were made for `model` (clear ValueError if not)."""
    codebooks = load_codebooks(path, expected_fingerprint=model_fingerprint(model))
    check_codebooks(model, codebooks)
    return codebooks


def shipped_codebooks(model: Model) -> Codebooks | None:
    """The codebooks shipped with the package for `model` (SmolLM2-135M-Instruct, the shipped base
    model), or None when none were calibrated on it."""
    fingerprint = model_fingerprint(model)
    for path in SHIPPED_CODEBOOKS:
        if path.is_dir() and codebooks_fingerprint(path) == fingerprint:
            return load_codebooks_for(model, path)
    return None
