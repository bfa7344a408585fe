"""KV-cache compression: MILLION product quantization (codec, k-means codebooks, static PQ cache) and a uniform baseline."""

from jaxlongctx.kvcache.codebooks import (
    GRANULARITIES,
    Codebooks,
    cache_bytes,
    centroid_shape,
    load_codebooks,
    save_codebooks,
    train_codebooks,
)
from jaxlongctx.kvcache.kmeans import kmeans
from jaxlongctx.kvcache.pq_cache import PQCache, pq_cache_report
from jaxlongctx.kvcache.pq_codec import decode, encode, fake_quantize
from jaxlongctx.kvcache.uniform_quant import effective_bits, fake_quantize_keys, fake_quantize_values

__all__ = [
    "GRANULARITIES",
    "Codebooks",
    "PQCache",
    "cache_bytes",
    "centroid_shape",
    "decode",
    "effective_bits",
    "encode",
    "fake_quantize",
    "fake_quantize_keys",
    "fake_quantize_values",
    "kmeans",
    "load_codebooks",
    "pq_cache_report",
    "save_codebooks",
    "train_codebooks",
]
