"""AdamW with linear warmup, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Peak learning rate, schedule lengths and AdamW settings."""

    lr: float = 3e-3
    warmup_steps: int = 50
    total_steps: int = 1000
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, total_steps={self.total_steps}], got {self.warmup_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip_norm <= 0:
            raise ValueError(f"clip_norm must be positive, got {self.clip_norm}")


def learning_rate(config: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=config.warmup_steps,
        decay_steps=config.total_steps,
        end_value=config.lr * config.min_lr_ratio,
    )


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (not on norm weights or biases)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on the warmup-cosine schedule."""
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            learning_rate(config),
            b1=config.b1,
            b2=config.b2,
            weight_decay=config.weight_decay,
            mask=_decay_mask,
        ),
    )
