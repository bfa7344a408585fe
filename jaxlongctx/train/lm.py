"""Language-model pretraining of a small Llama on the corpus train split (the `jaxlongctx train-lm`
command is `jaxlongctx.commands.train_lm`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxlongctx.config import ModelConfig
from jaxlongctx.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode_corpus
from jaxlongctx.model.model import Model
from jaxlongctx.train.data import TokenWindows
from jaxlongctx.train.evaluate import perplexity, token_nll
from jaxlongctx.train.optim import OptimConfig, make_optimizer
from jaxlongctx.train.trainer import Trainer, TrainerConfig

_SPECIALS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
# The shipped base model: 4 layers, d 192, GQA 6/2 heads of 32, SwiGLU 512, tied embeddings (2.4M params:
# 4.7 MB in bf16, and about 1.7x cheaper per step than d 256 / MLP 768 on the shared 2-core CPU).
BASE_CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=192,
    intermediate_size=512,
    num_layers=4,
    num_heads=6,
    num_kv_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    **_SPECIALS,
)
# A tiny model for smoke tests.
QUICK_CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
    max_position_embeddings=64,
    **_SPECIALS,
)


def lm_trainer(
    config: ModelConfig,
    optim: OptimConfig,
    trainer: TrainerConfig,
    batch_size: int,
    context: int,
    seed: int = 0,
    eval_tokens: Any = None,
    eval_batch_size: int = 8,
) -> Trainer:
    """A `Trainer` for next-token prediction on the train split (fp32 params, init from `seed`)."""
    train_tokens = encode_corpus("train")
    if config.vocab_size < int(train_tokens.max()) + 1:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's ids need")
    model = Model.init(config, seed=seed, dtype=jnp.float32)
    graphdef = model.graphdef
    windows = TokenWindows(train_tokens, batch_size, context, seed=seed)

    def loss_fn(params, _frozen, batch):
        s, c = token_nll(nnx.merge(graphdef, params), batch["ids"], batch["mask"])
        return s / c

    def eval_fn(params) -> dict[str, float]:
        module = nnx.merge(graphdef, params)
        return perplexity(module, eval_tokens, context, eval_batch_size)

    return Trainer(
        loss_fn,
        nnx.to_pure_dict(model.params),
        make_optimizer(optim),
        windows.batch,
        trainer,
        eval_fn=None if eval_tokens is None else eval_fn,
        count_tokens=lambda b: int(b["mask"][:, 1:].sum()),
    )
