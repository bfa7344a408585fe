"""Training: optimizer, deterministic data pipeline, resumable trainer, LM pretraining, ARMT fine-tuning."""

from jaxlongctx.train.data import TokenWindows, eval_windows
from jaxlongctx.train.optim import OptimConfig, make_optimizer
from jaxlongctx.train.trainer import Trainer, TrainerConfig

__all__ = ["OptimConfig", "TokenWindows", "Trainer", "TrainerConfig", "eval_windows", "make_optimizer"]
