"""An `ARMTModel` from a `train-armt` training checkpoint (`<run>/checkpoints/step_*`, written by
`Trainer.save_checkpoint`), so that a run can be scored while it trains. The model is built from the
one the run started from (`--base`, or `--init`'s model) with the run's ARMT sizes and segmentation
(`trainer.json`); the trained parameters are read from the saved state (the optimizer state is not
read): the memory's for a run with a frozen base (`--freeze-base`), else the base's and the memory's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxlongctx.armt.base_reference import resolve_base_argument
from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.checkpoint import CheckpointError
from jaxlongctx.loading import load, parse_dtype
from jaxlongctx.train.armt_finetune import memory_in_float32
from jaxlongctx.train.trainer import load_into

TRAINER_RECORD = "trainer.json"


def is_training_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a training checkpoint directory (it holds `trainer.json` and `state/`)."""
    path = Path(path)
    return (path / TRAINER_RECORD).is_file() and (path / "state").is_dir()


def training_record(path: str | Path) -> dict[str, Any]:
    """The checkpoint's `trainer.json`: step, total_steps, wall_s, hyperparams and the loss history."""
    file = Path(path) / TRAINER_RECORD
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable training record ({e})") from None


def load_training_checkpoint(path: str | Path, base_dtype: Any = None) -> ARMTModel:
    """The ARMT model of the training checkpoint at `path`: the base in `base_dtype` ('bf16' | 'fp32' |
    None = as stored; as the run left it where it trained the base), the memory parameters as trained
    (float32)."""
    path = Path(path).absolute()
    record = training_record(path)
    settings = record.get("hyperparams", {})
    missing = [k for k in ("armt_config", "segmentation") if k not in settings]
    if missing or not (settings.get("base") or settings.get("init")):
        raise CheckpointError(f"{path / TRAINER_RECORD}: hyperparams lack {missing or ['base/init']}")
    if settings.get("init"):
        armt = load(settings["init"], base_dtype)
        if not isinstance(armt, ARMTModel):
            raise CheckpointError(f"{path}: the run's --init {settings['init']} is not an ARMT model")
    else:
        base = load(resolve_base_argument(settings["base"]), base_dtype)
        armt = ARMTModel.wrap(base, ARMTConfig.from_dict(settings["armt_config"]), jax.random.key(0))
    armt = memory_in_float32(armt)
    trained_base = not settings.get("freeze_base")
    base_params, memory_params = (nnx.to_pure_dict(p) for p in armt.params)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), memory_params)
    if trained_base:  # the run's params are (base, memory), the base as the run held it (--base-dtype)
        stored = parse_dtype(settings.get("base_dtype", "fp32"))
        base = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, stored), base_params)
        target = (base, target)
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            restored = ckptr.restore(
                path / "state",
                args=ocp.args.PyTreeRestore(
                    item={"params": target},
                    restore_args=ocp.checkpoint_utils.construct_restore_args({"params": target}),
                    partial_restore=True,
                ),
            )
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"{path}: cannot read the memory parameters ({type(e).__name__}: {e})"
        ) from None
    params = restored["params"]
    if trained_base:
        base, params = params
        dtype = armt.base.dtype
        load_into(armt.base.module, jax.tree.map(lambda x: jnp.asarray(x, dtype), base))
    armt.set_memory_params(**params)
    armt.segmentation = settings["segmentation"]
    return armt
