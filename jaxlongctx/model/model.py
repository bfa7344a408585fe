"""`Model`: a loaded Llama-family model with jitted, validated entry points."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxlongctx.config import ModelConfig
from jaxlongctx.model.llama import Llama, forward
from jaxlongctx.sharding import mesh_of, put_batch
from jaxlongctx.validation import check_ids, check_mask


class Model:
    """A Llama-family model: `model(ids, attention_mask) -> logits [B, T, V]` (float32)."""

    def __init__(self, module: Llama, tokenizer: Any = None):
        self.module = module
        self.config: ModelConfig = module.config
        self.tokenizer = tokenizer

    @classmethod
    def init(cls, config: ModelConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.float32) -> Model:
        """A randomly initialised model (std 0.02 weights, unit norms)."""
        return cls(Llama(config, dtype=dtype, rngs=nnx.Rngs(seed)))

    @property
    def dtype(self) -> jnp.dtype:
        """Parameter dtype."""
        return self.module.embed[...].dtype

    @property
    def mesh(self) -> Mesh | None:
        """The device mesh the parameters are sharded on (see `jaxlongctx.parallel`), or None."""
        return mesh_of(self.params)

    @cached_property
    def graphdef(self) -> nnx.GraphDef:
        """Static structure of the module (parameters excluded)."""
        return nnx.split(self.module)[0]

    @property
    def params(self) -> nnx.State:
        """The parameter pytree (per-layer leaves are `[L, ...]`)."""
        return nnx.state(self.module)

    def merge(self, params: nnx.State) -> Llama:
        """The module rebuilt from a parameter pytree (use inside traced functions)."""
        return nnx.merge(self.graphdef, params)

    @cached_property
    def _forward(self):
        return jax.jit(lambda params, ids, mask: forward(self.merge(params), ids, mask))

    def check_length(self, total: int) -> None:
        """Refuse inputs a sliding-window model would need its window for."""
        if total > self.config.max_length:
            raise ValueError(
                f"sequence length {total} exceeds sliding_window={self.config.sliding_window} of this "
                f"{self.config.model_type} model; sliding-window attention is not supported, so inputs "
                "must fit in the window"
            )

    def __call__(self, ids: Any, attention_mask: Any = None) -> jnp.ndarray:
        """Logits `[B, T, V]` for ids `[B, T]` (mask True = real token; pads may be on either side)."""
        ids = check_ids(ids, self.config.vocab_size)
        mask = check_mask(attention_mask, ids)
        self.check_length(ids.shape[1])
        return self._forward(self.params, put_batch(ids, self.mesh), put_batch(mask, self.mesh))

    def param_bytes(self) -> int:
        """Total bytes of all parameters."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))
