"""Pallas GPU kernels with plain-jnp references, selected by backend="auto"|"xla"|"pallas"|"interpret"."""

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.pq_attention import pq_decode_attention

__all__ = ["grouped_matmul", "pq_decode_attention"]
