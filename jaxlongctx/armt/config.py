"""`ARMTConfig`: segmentation and associative-memory sizes of an ARMT model."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

NU = 3  # DPFP feature-map order (spec 1.3)


@dataclasses.dataclass(frozen=True)
class ARMTConfig:
    """ARMT settings: `segment_size` input tokens per segment, `num_mem_tokens` memory tokens,
    memory key size `d_mem` (feature size `d_key = 2 * NU * d_mem`) and the A/z state dtype."""

    segment_size: int
    num_mem_tokens: int
    d_mem: int = 64
    state_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for name in ("segment_size", "num_mem_tokens", "d_mem"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ARMTConfig.{name} must be a positive integer, got {value!r}")
        if jnp.dtype(self.state_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"ARMTConfig.state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        object.__setattr__(self, "state_dtype", jnp.dtype(self.state_dtype))

    @property
    def d_key(self) -> int:
        """Feature size of the DPFP map: `2 * NU * d_mem`."""
        return 2 * NU * self.d_mem

    @property
    def rows(self) -> int:
        """Rows of one segment buffer: `segment_size` token rows then `num_mem_tokens` memory-token rows."""
        return self.segment_size + self.num_mem_tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (checkpoint metadata)."""
        return {
            "segment_size": self.segment_size,
            "num_mem_tokens": self.num_mem_tokens,
            "d_mem": self.d_mem,
            "state_dtype": self.state_dtype.name,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ARMTConfig:
        """Inverse of `to_dict`."""
        return cls(
            int(d["segment_size"]), int(d["num_mem_tokens"]), int(d["d_mem"]), jnp.dtype(d["state_dtype"])
        )
