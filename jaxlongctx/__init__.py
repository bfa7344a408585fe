"""jaxlongctx: long-context Llama inference in JAX/Flax."""

from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.cache_choice import PQKV, ARMTMemory, DenseKV
from jaxlongctx.config import ModelConfig
from jaxlongctx.generate import generate
from jaxlongctx.kvcache.calibrate import calibrate
from jaxlongctx.kvcache.codebooks import load_codebooks
from jaxlongctx.loading import load
from jaxlongctx.model import Model
from jaxlongctx.parallel import make_mesh, shard_model
from jaxlongctx.pretrained import smollm2_gguf
from jaxlongctx.sampling import SamplingParams

__all__ = [
    "PQKV",
    "ARMTConfig",
    "ARMTMemory",
    "ARMTModel",
    "DenseKV",
    "Model",
    "ModelConfig",
    "SamplingParams",
    "calibrate",
    "generate",
    "load",
    "load_codebooks",
    "make_mesh",
    "shard_model",
    "smollm2_gguf",
]
