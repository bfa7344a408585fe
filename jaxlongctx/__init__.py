"""jaxlongctx: long-context Llama inference in JAX/Flax.

Most names below are imported on first use, so that `import jaxlongctx` (and the command line) starts
without loading every part of the library (ARMT, training, checkpoints).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported now: importing the submodule `jaxlongctx.generate` anywhere would otherwise bind the package's
# `generate` to that module instead of the function.
from jaxlongctx.generate import generate as generate

_EXPORTS = {  # name -> module it lives in
    "ARMTConfig": "jaxlongctx.armt.config",
    "ARMTModel": "jaxlongctx.armt.model",
    "ARMTMemory": "jaxlongctx.cache_choice",
    "DenseKV": "jaxlongctx.cache_choice",
    "PQKV": "jaxlongctx.cache_choice",
    "ModelConfig": "jaxlongctx.config",
    "calibrate": "jaxlongctx.kvcache.calibrate",
    "load_codebooks": "jaxlongctx.kvcache.codebooks",
    "shipped_codebooks": "jaxlongctx.kvcache.model_codebooks",
    "enable_disk_cache": "jaxlongctx.disk_cache",
    "load": "jaxlongctx.loading",
    "Model": "jaxlongctx.model",
    "make_mesh": "jaxlongctx.parallel",
    "shard_model": "jaxlongctx.parallel",
    "smollm2_gguf": "jaxlongctx.pretrained",
    "SamplingParams": "jaxlongctx.sampling",
}

__all__ = sorted([*_EXPORTS, "generate"])


def __getattr__(name: str) -> Any:
    """Import an exported name from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxlongctx' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
