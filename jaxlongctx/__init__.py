"""jaxlongctx: long-context Llama inference in JAX/Flax."""

from jaxlongctx.config import ModelConfig
from jaxlongctx.generate import generate
from jaxlongctx.loading import load
from jaxlongctx.model import Model

__all__ = ["Model", "ModelConfig", "generate", "load"]
