"""`ARMTConfig`: segmentation, associative-memory sizes and the cell variant of an ARMT model.

The defaults are the cell of spec/armt.md (the models trained here). The options after `state_dtype`
give the cell the ARMT authors publish (spec/armt_published.md, `published_options`): a sink row in
front of every segment, a sliding window over the previous segment's token keys and values,
L2-normalised DPFP features, several memory heads, per-channel gating, no denominator. The last five
options name what the authors' code versions do differently (spec/armt_published.md section 9); their
defaults are the reference version's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

NU = 3  # DPFP feature-map order (spec 1.3)
EPS = 1e-5  # the literal eps of the read, write and (spec/armt.md) gamma denominators

MEM_MEM_MASKS = ("causal", "all")  # memory row i sees memory rows j <= i, or every memory row
WINDOW_MEM = ("all", "none")  # what memory rows see of the previous window


@dataclasses.dataclass(frozen=True)
class ARMTConfig:
    """ARMT settings: `segment_size` input tokens per segment, `num_mem_tokens` memory tokens,
    memory key size `d_mem` (feature size `d_key = 2 * NU * d_mem`) and the A/z state dtype.

    Cell variant (defaults: spec/armt.md): `sink` (a learned row in front, local RoPE positions
    sink 0, tokens 1..n, memory n+1..n+M), `sliding_window` (each layer also attends to its own
    previous segment's post-RoPE token K/V), `normalize_features` (DPFP features L2-normalised per
    head), `gamma_eps` (eps of the gamma correction's denominator; the published cell has none),
    `mem_heads` (block-diagonal A, z), `gating` (beta per channel: W_mb is `[D, D]`), `correction`
    (gamma correction of z), `use_denom` (False: no z, no division).

    Version options (spec/armt_published.md 9; defaults: the reference): `mem_mem_mask`,
    `window_mem`, `window_token_offset` (token a sees previous-window key j >= a + offset)."""

    segment_size: int
    num_mem_tokens: int
    d_mem: int = 64
    state_dtype: Any = jnp.float32
    sink: bool = False
    sliding_window: bool = False
    normalize_features: bool = False
    gamma_eps: float = EPS
    mem_heads: int = 1
    gating: bool = False
    correction: bool = True
    use_denom: bool = True
    mem_mem_mask: str = "causal"
    window_mem: str = "all"
    window_token_offset: int = 0

    def __post_init__(self) -> None:
        for name in ("segment_size", "num_mem_tokens", "d_mem", "mem_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ARMTConfig.{name} must be a positive integer, got {value!r}")
        if jnp.dtype(self.state_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"ARMTConfig.state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        object.__setattr__(self, "state_dtype", jnp.dtype(self.state_dtype))
        for name in ("sink", "sliding_window", "normalize_features", "gating", "correction", "use_denom"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ARMTConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.d_mem % self.mem_heads:
            raise ValueError(f"ARMTConfig.d_mem {self.d_mem} is not divisible by mem_heads {self.mem_heads}")
        if self.mem_mem_mask not in MEM_MEM_MASKS:
            raise ValueError(
                f"ARMTConfig.mem_mem_mask must be one of {MEM_MEM_MASKS}, got {self.mem_mem_mask!r}"
            )
        if self.window_mem not in WINDOW_MEM:
            raise ValueError(f"ARMTConfig.window_mem must be one of {WINDOW_MEM}, got {self.window_mem!r}")
        if self.window_token_offset not in (0, 1):
            raise ValueError(
                f"ARMTConfig.window_token_offset must be 0 or 1, got {self.window_token_offset!r}"
            )
        object.__setattr__(self, "gamma_eps", float(self.gamma_eps))

    @property
    def d_key(self) -> int:
        """Feature size of the DPFP map over all memory heads: `2 * NU * d_mem`."""
        return 2 * NU * self.d_mem

    @property
    def lead(self) -> int:
        """Rows in front of the token rows: 1 with a sink, else 0."""
        return int(self.sink)

    @property
    def mem_start(self) -> int:
        """Buffer row of the first memory token."""
        return self.lead + self.segment_size

    @property
    def rows(self) -> int:
        """Rows of one segment buffer: the sink (if any), `segment_size` token rows, then
        `num_mem_tokens` memory-token rows."""
        return self.mem_start + self.num_mem_tokens

    def beta_width(self, hidden: int) -> int:
        """Outputs of W_mb for hidden size `hidden`: one per memory head, or one per channel (gating)."""
        return hidden if self.gating else self.mem_heads

    @property
    def plain_mask(self) -> bool:
        """Whether a segment's attention is causal over its buffer rows (no window, causal memory)."""
        return not self.sliding_window and self.mem_mem_mask == "causal"

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (checkpoint metadata); options at their defaults are left out."""
        out: dict[str, Any] = {
            "segment_size": self.segment_size,
            "num_mem_tokens": self.num_mem_tokens,
            "d_mem": self.d_mem,
            "state_dtype": self.state_dtype.name,
        }
        for f in dataclasses.fields(self)[4:]:
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ARMTConfig:
        """Inverse of `to_dict`."""
        options = {f.name: d[f.name] for f in dataclasses.fields(cls)[4:] if f.name in d}
        return cls(
            int(d["segment_size"]),
            int(d["num_mem_tokens"]),
            int(d["d_mem"]),
            jnp.dtype(d["state_dtype"]),
            **options,
        )
