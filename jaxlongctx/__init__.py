"""jaxlongctx: long-context Llama inference in JAX/Flax."""

from jaxlongctx.config import ModelConfig
from jaxlongctx.generate import generate
from jaxlongctx.loading import load
from jaxlongctx.model import Model
from jaxlongctx.parallel import make_mesh, shard_model

__all__ = ["Model", "ModelConfig", "generate", "load", "make_mesh", "shard_model"]
