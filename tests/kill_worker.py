"""A writer that loops until it is killed, for the kill -9 tests of tests/test_robustness.py.

    python tests/kill_worker.py MODE PATH [SOURCE]

MODE `replace`: save a tiny model to PATH again and again (overwrite), its embedding filled with the
round number; `convert`: import the HF directory SOURCE into PATH again and again; `train`: train a
one-parameter model, writing a training checkpoint under PATH every step. Prints `ready` once the
first write is done, then one line per write.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx


def tiny_model(value: float):
    """A 1-layer model whose embedding is all `value` (so a reader can tell which write it sees)."""
    from jaxlongctx.model.model import Model
    from jaxlongctx.train.lm import QUICK_CONFIG

    module = Model.init(QUICK_CONFIG, seed=0, dtype=jnp.float32).module
    module.embed[...] = jnp.full_like(module.embed[...], value)
    return module


def replace_forever(path: Path) -> None:
    from jaxlongctx.checkpoint import save_model

    for round_ in range(1, 10**9):
        save_model(tiny_model(float(round_)), path, overwrite=True)
        print("ready" if round_ == 1 else round_, flush=True)


def convert_forever(path: Path, source: Path) -> None:
    from convert.hf_llama import convert_hf_to_ckpt

    for round_ in range(1, 10**9):
        convert_hf_to_ckpt(source, path, overwrite=True, progress=False)
        print("ready" if round_ == 1 else round_, flush=True)


def train_forever(path: Path) -> None:
    import optax

    from jaxlongctx.train.trainer import Trainer, TrainerConfig

    config = TrainerConfig(steps=10**6, out_dir=path, ckpt_every=1, progress=False)
    params = {"w": jnp.ones((64, 64))}
    trainer = Trainer(
        lambda p, _f, b: jnp.mean((p["w"] - b["x"]) ** 2),
        params,
        optax.sgd(0.1),
        lambda step: {"x": np.full((64, 64), float(step), np.float32)},
        config,
    )
    trainer.maybe_resume()
    trainer.run(stop_at=1)
    print("ready", flush=True)
    while True:
        trainer.run(stop_at=trainer.step + 1)
        print(trainer.step, flush=True)


if __name__ == "__main__":
    nnx.Rngs(0)  # import flax before the first write, so the kill window is writing, not importing
    mode, target = sys.argv[1], Path(sys.argv[2])
    if mode == "replace":
        replace_forever(target)
    elif mode == "convert":
        convert_forever(target, Path(sys.argv[3]))
    elif mode == "train":
        train_forever(target)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
