"""The blocked causal prefill attention equals plain masked attention over the whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.model.attention import PREFILL_CHUNK, attention, causal_prefill_attention


def test_blocked_prefill_equals_full_attention():
    t = 2 * PREFILL_CHUNK + 37  # three blocks, the last one short
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, t, 4, 8))
    k = jax.random.normal(kk, (2, t, 2, 8))
    v = jax.random.normal(kv, (2, t, 2, 8))
    valid = np.ones((2, t), bool)
    valid[1, :5] = False  # left padding
    valid[1, -9:] = False  # and right padding
    valid = jnp.asarray(valid)
    slots = jnp.broadcast_to(jnp.arange(t), (2, t))
    blocked = np.asarray(causal_prefill_attention(q, k, v, valid))
    full = np.asarray(attention(q, k, v, slots, valid))
    # padding queries see no key at all; their (unused) output is a uniform average in both paths
    seen = np.asarray(valid) & (np.cumsum(np.asarray(valid), axis=1) > 0)
    np.testing.assert_allclose(blocked[seen], full[seen], atol=1e-5)
    assert np.isfinite(blocked).all()
