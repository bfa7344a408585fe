"""KV-quantization quality: perplexity with every token's post-RoPE K/V fake-quantized (MILLION's protocol),
or with the tokens a `PQKV` cache keeps exact left exact (`cache_perplexity`).

Kinds: "dense" (no quantization), "pq" (decode(encode(.)) with calibrated codebooks), "int4" /
"int2" (KIVI-style uniform: keys per channel, values per token, groups of `group`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlongctx.kvcache.codebooks import Codebooks
from jaxlongctx.kvcache.pq_codec import fake_quantize
from jaxlongctx.kvcache.uniform_quant import effective_bits, fake_quantize_keys, fake_quantize_values
from jaxlongctx.model.model import Model
from jaxlongctx.train.evaluate import KVTransform, perplexity, token_nll, windows_perplexity

if TYPE_CHECKING:
    from jaxlongctx.cache_choice import PQKV

KV_KINDS = ("dense", "pq", "int4", "int2")
DEFAULT_GROUP = 128  # KIVI group: int4 -> 4.25 bits/element, int2 -> 2.25 (PQ ds2/8 bit: 4, ds4: 2)


def kv_transform(
    kind: str, codebooks: Codebooks | None = None, group: int = DEFAULT_GROUP
) -> KVTransform | None:
    """The (k, v, layer) -> (k, v) fake quantization of `kind` for k/v `[B, T, K, D]` (None for dense)."""
    if kind not in KV_KINDS:
        raise ValueError(f"kv kind must be one of {KV_KINDS}, got {kind!r}")
    if kind == "dense":
        return None
    if kind == "pq":
        if codebooks is None:
            raise ValueError("kv kind 'pq' needs codebooks")
        k_cent, v_cent = codebooks.stacked()  # [L, (K,) M, C, ds]
        k_w, v_w = codebooks.stacked_weights()  # [L, (K,) D] or None

        def pq(k, v, layer):  # per-head centroids need [..., K, T, D]
            kw, vw = (None, None) if k_w is None else (k_w[layer], v_w[layer])
            k = fake_quantize(k.transpose(0, 2, 1, 3), k_cent[layer], kw).transpose(0, 2, 1, 3)
            v = fake_quantize(v.transpose(0, 2, 1, 3), v_cent[layer], vw).transpose(0, 2, 1, 3)
            return k, v

        return pq
    bits = int(kind[3:])
    effective_bits(bits, group)  # validates bits and group

    def uniform(k, v, layer):  # keys: groups of tokens per channel; values: groups of channels per token
        k = fake_quantize_keys(k.transpose(0, 2, 1, 3), bits, group).transpose(0, 2, 1, 3)
        return k, fake_quantize_values(v, bits, group)

    return uniform


def bits_per_element(kind: str, codebooks: Codebooks | None = None, group: int = DEFAULT_GROUP) -> float:
    """Stored bits per K/V element of `kind` (codebooks and the exact window not counted)."""
    if kind == "dense":
        return 16.0
    if kind == "pq":
        return codebooks.bits / codebooks.ds
    return effective_bits(int(kind[3:]), group)


def kv_perplexity(
    model: Model,
    tokens: Any,
    context: int,
    kind: str,
    codebooks: Codebooks | None = None,
    group: int = DEFAULT_GROUP,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Perplexity of `model` on `tokens` (windows of `context`) with K/V fake-quantized by `kind`."""
    if kind == "pq":
        from jaxlongctx.kvcache.model_codebooks import check_codebooks

        check_codebooks(model, codebooks)
    result = perplexity(
        model.module, np.asarray(tokens), context, batch_size, kv_transform(kind, codebooks, group)
    )
    out: dict[str, Any] = {"kv": kind, "bits_per_element": bits_per_element(kind, codebooks, group), **result}
    if kind == "pq":
        out.update(ds=codebooks.ds, bits=codebooks.bits, granularity=codebooks.granularity)
    elif kind != "dense":
        out["group"] = group
    return out


def cache_perplexity(
    model: Model, tokens: Any, context: int, cache: PQKV, batch_size: int = 8, progress: bool = False
) -> dict[str, Any]:
    """Perplexity of `model` on `tokens` (windows of `context`) over the K/V that the PQ cache `cache`
    holds: every token decode(encode(.)) but those it keeps exact, which are each query's last
    `cache.window` tokens, each window's first `cache.sinks` and, with `cache.observed`, per layer and kv
    head the window's tokens that its last `OBSERVE` tokens attend to most (chosen from an exact forward,
    as generation's prefill chooses them; windows of at most `OBSERVE` tokens have none). Also the
    dense perplexity on the same windows, the change against it and the cache's bits per element."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxlongctx.kvcache.model_codebooks import check_codebooks
    from jaxlongctx.kvcache.observed_tokens import (
        OBSERVE,
        ObservingPrefill,
        observed_slots,
        pinned_prompt_tokens,
    )
    from jaxlongctx.model.llama import forward_with

    check_codebooks(model, cache.codebooks)
    quantize = kv_transform("pq", cache.codebooks)
    graphdef, params = nnx.split(model.module)
    observed = cache.observed if context > OBSERVE else 0

    def nll(p, ids, mask):  # windows [B, context + 1]: the first context tokens are the cache's prompt
        module = nnx.merge(graphdef, p)
        prompt, prompt_mask = ids[:, :-1], mask[:, :-1]
        if observed:
            attend = ObservingPrefill(prompt_mask, observed_slots(prompt_mask, OBSERVE))
            _, (k, _, q_observed) = forward_with(module, prompt, prompt_mask, attend)
            pinned = pinned_prompt_tokens(prompt_mask, cache.sinks, observed, q_observed, k, cache.window)
        else:
            pinned = pinned_prompt_tokens(prompt_mask, cache.sinks)  # [1, B, T, 1]

        def transform(k, v, layer):  # k, v [B, T, K, D]
            k_quant, v_quant = quantize(k, v, layer)
            exact = pinned[jnp.minimum(layer, pinned.shape[0] - 1)][..., None]  # [B, T, K or 1, 1]
            return jnp.where(exact, k, k_quant), jnp.where(exact, v, v_quant)

        return token_nll(module, ids, mask, transform, cache.window)

    step = jax.jit(nll)
    tokens = np.asarray(tokens)
    vocab = model.config.vocab_size
    result = windows_perplexity(lambda i, m: step(params, i, m), tokens, context, vocab, batch_size, progress)
    dense = perplexity(model.module, tokens, context, batch_size, progress=progress)
    report = cache.bytes_report(model.config, context)
    return {
        "kv": "pq",
        "bits_per_element": 8 * report["total_bytes"] / (report["dense_bf16_bytes"] / 2),
        **result,
        "dense_ppl": dense["ppl"],
        "ppl_change": result["ppl"] / dense["ppl"] - 1,
        "window": cache.window,
        "sinks": cache.sinks,
        "observed": observed,
        "ds": cache.codebooks.ds,
        "bits": cache.codebooks.bits,
        "granularity": cache.codebooks.granularity,
    }
