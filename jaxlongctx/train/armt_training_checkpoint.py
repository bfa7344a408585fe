"""An `ARMTModel` from a `train-armt` training checkpoint (`<run>/checkpoints/step_*`, written by
`Trainer.save_checkpoint`) of a run with a frozen base (`--freeze-base`): its trained parameters are the
memory's. The base is the one the run started from (`--base`, or `--init`'s model), the ARMT sizes and
segmentation are the run's (`trainer.json`), the memory parameters are read from the saved state
(the optimizer state is not read)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxlongctx.armt.base_reference import resolve_base_argument
from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.checkpoint import CheckpointError
from jaxlongctx.loading import load
from jaxlongctx.train.armt_finetune import memory_in_float32

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
    """The ARMT model of a memory-only training checkpoint at `path`: the run's base in `base_dtype`
    ('bf16' | 'fp32' | None = as stored), the memory parameters as trained (float32)."""
    path = Path(path).absolute()
    record = training_record(path)
    settings = record.get("hyperparams", {})
    if not settings.get("freeze_base"):
        raise CheckpointError(
            f"{path}: a run that also trained the base weights (no --freeze-base); load the model its "
            "--save wrote instead"
        )
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
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(nnx.state(armt.memory))
    )
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
    armt.set_memory_params(**restored["params"])
    armt.segmentation = settings["segmentation"]
    return armt
