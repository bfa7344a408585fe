"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_next(
    logits: jnp.ndarray, key: jax.Array, temperature: float, top_k: int | None, top_p: float | None
) -> jnp.ndarray:
    """Pick next ids `[B]` from float32 logits `[B, V]`; temperature 0 means greedy argmax."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) >= top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
