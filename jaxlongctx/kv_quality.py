"""KV-quantization quality: perplexity with every token's post-RoPE K/V fake-quantized (MILLION's protocol).

Kinds: "dense" (no quantization), "pq" (decode(encode(.)) with calibrated codebooks), "int4" /
"int2" (KIVI-style uniform: keys per channel, values per token, groups of `group`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxlongctx.kvcache.codebooks import Codebooks
from jaxlongctx.kvcache.pq_codec import fake_quantize
from jaxlongctx.kvcache.uniform_quant import effective_bits, fake_quantize_keys, fake_quantize_values
from jaxlongctx.model.model import Model
from jaxlongctx.train.evaluate import KVTransform, perplexity

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
