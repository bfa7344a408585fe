"""Grouped-query softmax attention over slot-indexed keys (prefill, decode and ARMT segments)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so rows with no visible key give zeros-weighted averages, never NaN
# long causal prefill: queries per block and keys per tile (256 x 512 measured fastest on CPU at 4K-16K;
# an fp32 score tile of B K c G kb then stays in L2/L3)
PREFILL_QUERY_BLOCK = 256
PREFILL_KEY_BLOCK = 512


def attention(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    q_slot: jnp.ndarray,
    key_valid: jnp.ndarray,
    *,
    heads_major: bool = False,
) -> jnp.ndarray:
    """Causal GQA attention: query t sees key slot s iff `key_valid[b, s]` and `s <= q_slot[b, t]`.

    q `[B, T, H, hd]`, k/v `[B, S, K, hd]` (or `[B, K, S, hd]` with `heads_major`, the dense cache
    layout), q_slot `[B, T]` int, key_valid `[B, S]` bool -> `[B, T, H, hd]`.
    Scores, softmax and the weighted sum accumulate in float32.
    """
    num_slots = k.shape[2] if heads_major else k.shape[1]
    slots = jnp.arange(num_slots)
    visible = key_valid[:, None, :] & (slots[None, None, :] <= q_slot[:, :, None])  # B T S
    return masked_attention(q, k, v, visible, heads_major=heads_major)


def masked_attention(
    q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, visible: jnp.ndarray, *, heads_major: bool = False
) -> jnp.ndarray:
    """GQA attention where query t sees key slot s iff `visible[b, t, s]` (q `[B, T, H, hd]`, k/v
    `[B, S, K, hd]` or `[B, K, S, hd]` with `heads_major`, visible `[B, T, S]` bool) -> `[B, T, H, hd]`."""
    b, t, h, hd = q.shape
    kv = k.shape[1] if heads_major else k.shape[2]
    keys = "bksd" if heads_major else "bskd"
    qg = q.reshape(b, t, kv, h // kv, hd)  # B T K G hd
    # scores in the dot's natural output order [B, K, T, G, S]: any other order costs a transpose of
    # every score (measured 1.8x slower prefill attention on CPU)
    scores = jnp.einsum(f"btkgd,{keys}->bktgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5)
    scores = jnp.where(visible[:, None, :, None], scores, _MASKED)
    # softmax with the normalisation applied to the [.., hd] output instead of every score: one pass
    # over the scores fewer
    weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    total = jnp.sum(weights, axis=-1)  # B K T G
    # the weighted sum also in the dot's natural order [B, K, T, G, hd], transposed once normalised: asked
    # for [B, T, K, G, hd] directly, XLA CPU may swap the operands of a bf16 dot into a form its runtime
    # cannot run (bf16 x bf16 = f32 with batch dims, seen in batched ARMT decoding)
    out = jnp.einsum(f"bktgs,{keys}->bktgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = (out / total[..., None]).transpose(0, 2, 1, 3, 4)  # B T K G hd
    return out.reshape(b, t, h, hd).astype(q.dtype)


def decode_attention(
    q: jnp.ndarray,
    cache_k: jnp.ndarray,
    cache_v: jnp.ndarray,
    k_new: jnp.ndarray,
    v_new: jnp.ndarray,
    visible: jnp.ndarray,
) -> jnp.ndarray:
    """One new token per row attending over the cache and over its own key/value, which are not yet in
    the cache: the softmax joins both parts, so the step never writes into a copy of the cache first.

    q `[B, 1, H, hd]`, cache_k/v `[B, K, S, hd]`, k_new/v_new `[B, 1, K, hd]`, visible `[B, S]` (cached
    slots this token sees) -> `[B, 1, H, hd]`. Scores, softmax and the weighted sum accumulate in float32.
    """
    b, _, h, hd = q.shape
    kv = cache_k.shape[1]
    qg = q.reshape(b, kv, h // kv, hd)  # B K G hd
    scale = hd**-0.5
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, cache_k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
    own = (
        jnp.einsum("bkgd,bkd->bkg", qg, k_new[:, 0].astype(qg.dtype), preferred_element_type=jnp.float32)
        * scale
    )
    top = jnp.maximum(jnp.max(scores, axis=-1), own)  # B K G
    weights, own_weight = jnp.exp(scores - top[..., None]), jnp.exp(own - top)
    total = jnp.sum(weights, axis=-1) + own_weight
    out = jnp.einsum(
        "bkgs,bksd->bkgd", weights.astype(cache_v.dtype), cache_v, preferred_element_type=jnp.float32
    )
    out = out + own_weight[..., None] * v_new[:, 0, :, None, :].astype(jnp.float32)
    return (out / total[..., None]).reshape(b, 1, h, hd).astype(q.dtype)


def causal_prefill_attention(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    key_valid: jnp.ndarray,
    chunk: int = PREFILL_QUERY_BLOCK,
    key_block: int = PREFILL_KEY_BLOCK,
    offset: jnp.ndarray | int = 0,
) -> jnp.ndarray:
    """Causal attention where query t sits at slot `offset + t` and sees the valid key slots up to it.

    Inputs longer than `chunk` run flash-style: blocks of `chunk` queries walk the key blocks of
    their causal prefix with an online softmax (running max and sum), so no score tile outgrows the
    CPU cache and blocks above the diagonal are skipped. The result equals `attention` up to float
    rounding; the loops are static-length (`fori_loop` + `cond`), so it is also differentiable.

    q `[B, T, H, hd]`, k/v `[B, S, K, hd]`, key_valid `[B, S]` -> `[B, T, H, hd]`; S = T unless a
    chunk of queries (at `offset`, a traced int) reads a longer buffer of keys (chunked prefill).
    """
    b, t, h, hd = q.shape
    s = k.shape[1]
    if t <= chunk and s == t:
        return attention(q, k, v, jnp.broadcast_to(jnp.arange(t), (b, t)), key_valid)
    kv = k.shape[2]
    g = h // kv
    n_q, n_k = (
        -(-t // chunk),
        -(-s // key_block),
    )  # queries and keys padded apart: no tile is wasted on padding

    def pad_to(x, length):
        return jnp.pad(x, ((0, 0), (0, length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))

    # float32 operands, widened once here: bf16 ones would be widened again for every tile's dots (XLA's
    # CPU dot runs bf16 as float32); their products are the same
    q_blocks = (
        pad_to(q.astype(jnp.float32), n_q * chunk)
        .reshape(b, n_q, chunk, kv, g, hd)
        .transpose(1, 0, 3, 2, 4, 5)
    )  # Nq B K c G hd
    keys, values = (
        pad_to(x.astype(jnp.float32), n_k * key_block).transpose(0, 2, 1, 3) for x in (k, v)
    )  # B K Tk hd
    key_valid = pad_to(key_valid, n_k * key_block)
    scale = hd**-0.5

    def query_block(_, xs):
        i, qi = xs  # qi: B K c G hd
        q_slots = offset + i * chunk + jnp.arange(chunk)

        def key_tile(j, state):
            top, total, acc = state  # B K c G (x hd for acc)
            start = j * key_block
            kj = jax.lax.dynamic_slice_in_dim(keys, start, key_block, axis=2)  # B K kb hd
            vj = jax.lax.dynamic_slice_in_dim(values, start, key_block, axis=2)
            valid = jax.lax.dynamic_slice_in_dim(key_valid, start, key_block, axis=1)  # B kb
            visible = valid[:, None, :] & (
                (start + jnp.arange(key_block))[None, None, :] <= q_slots[None, :, None]
            )
            scores = jnp.einsum("bkcgd,bksd->bkcgs", qi, kj, preferred_element_type=jnp.float32) * scale
            scores = jnp.where(visible[:, None, :, None, :], scores, _MASKED)  # B K c G kb
            new_top = jax.lax.stop_gradient(jnp.maximum(top, jnp.max(scores, axis=-1)))
            weights = jnp.exp(scores - new_top[..., None])
            rescale = jnp.exp(top - new_top)
            pv = jnp.einsum(  # the weights rounded to v's dtype, as a dot in that dtype takes them
                "bkcgs,bksd->bkcgd", weights.astype(v.dtype).astype(jnp.float32), vj
            )
            return new_top, total * rescale + jnp.sum(weights, axis=-1), acc * rescale[..., None] + pv

        def maybe_tile(j, state):  # key blocks past this query block's last slot hold nothing it sees
            last = offset + (i + 1) * chunk - 1
            return jax.lax.cond(j * key_block <= last, key_tile, lambda _, s: s, j, state)

        init = (
            jnp.full((b, kv, chunk, g), _MASKED, jnp.float32),
            jnp.zeros((b, kv, chunk, g), jnp.float32),
            jnp.zeros((b, kv, chunk, g, hd), jnp.float32),
        )
        _, total, acc = jax.lax.fori_loop(0, n_k, maybe_tile, init)
        return None, (acc / total[..., None]).astype(q.dtype)

    _, out = jax.lax.scan(query_block, None, (jnp.arange(n_q), q_blocks))  # Nq B K c G hd
    return out.transpose(1, 0, 3, 2, 4, 5).reshape(b, n_q * chunk, h, hd)[:, :t]
