"""Next-token choice for a batch of slots, each with its own sampling settings: greedy where the
temperature is 0, else temperature and top-p sampling with the slot's own seeded key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.sampling import MIN_TEMPERATURE


def slot_key(seed: int) -> np.ndarray:
    """The raw key data of a request's seed (one row of `choose_per_slot`'s `key_data`)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def choose_per_slot(
    sampled: bool,
    logits: jnp.ndarray,
    temperature: jnp.ndarray,
    top_p: jnp.ndarray,
    key_data: jnp.ndarray,
    steps: jnp.ndarray,
) -> jnp.ndarray:
    """Next ids `[B]` from float32 logits `[B, V]`: argmax in rows whose `temperature [B]` is 0; the
    others sample from the smallest set of tokens whose probability reaches `top_p [B]` (1 = all) with
    key `fold_in(key_data[b], steps[b])` (`key_data [B, ...]`, raw keys of the requests' seeds).
    `sampled` (static) is False when every row is greedy: then only the argmax is computed."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampled:
        return greedy
    scaled = logits / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V], most likely first
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    drop = (jnp.cumsum(probs, axis=-1) - probs) >= top_p[:, None]  # always keeps the first
    ranked = jnp.where(drop, -jnp.inf, ranked)
    keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(key_data, steps)
    pick = jax.vmap(jax.random.categorical)(keys, ranked)  # [B], index into `order`
    sampled_ids = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled_ids, greedy)
