"""`jaxlongctx export-armt`: an ARMT fine-tune whose base was trained with the memory (a full checkpoint,
or a `train-armt` training checkpoint `<run>/checkpoints/step_*`), written as a small memory checkpoint
that names the untouched base and stores the base's change as a low-rank adapter
(`jaxlongctx.armt.base_adapter`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.armt.base_adapter import adapter_bytes, fit_base_adapter
from jaxlongctx.armt.base_reference import SMOLLM2_NAME, describe_base, resolve_base_argument
from jaxlongctx.armt.model import ARMTModel, saved_training_record
from jaxlongctx.loading import load
from jaxlongctx.output_dir import check_output
from jaxlongctx.train.armt_training_checkpoint import (
    is_training_checkpoint,
    load_training_checkpoint,
    training_record,
)

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def add_export_armt_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `jaxlongctx export-armt`."""
    parser.add_argument(
        "--model",
        required=True,
        help="full ARMT checkpoint, or a training checkpoint <run>/checkpoints/step_*",
    )
    parser.add_argument(
        "--base", required=True, help=f"the base it was fine-tuned from ('{SMOLLM2_NAME}' or a path)"
    )
    parser.add_argument("--out", required=True, help="output memory checkpoint directory")
    parser.add_argument(
        "--rank", type=int, default=32, help="rank of each weight matrix's change (default 32)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="dtype of the adapter and the memory parameters (default bf16)",
    )
    parser.add_argument("--overwrite", action="store_true")


def export_armt(
    model: str | Path, base: str | Path, out: str | Path, rank: int, dtype: Any, overwrite: bool = False
) -> dict[str, Any]:
    """Write the full ARMT checkpoint or training checkpoint `model` as a memory checkpoint at `out`
    naming `base`, with a rank-`rank` base adapter and the memory in `dtype`; returns what was recorded
    of the export (also in the output's training.json, after the source's training runs)."""
    if rank < 1:
        raise ValueError(f"--rank must be >= 1, got {rank}")
    out = check_output(out, overwrite=overwrite, inputs=[model])
    if is_training_checkpoint(model):
        armt, record = load_training_checkpoint(model), checkpoint_record(model)
    else:
        armt = load(model)
        if not isinstance(armt, ARMTModel):
            raise ValueError(f"--model {model}: holds a {type(armt).__name__}, not an ARMT model")
        if armt.base_reference is not None:
            raise ValueError(f"--model {model}: already a memory checkpoint naming its base")
        record = saved_training_record(model)
    base_path = resolve_base_argument(base)
    reference = describe_base(base_path)
    base_model = load(base_path, armt.dtype)
    if base_model.config != armt.config:
        raise ValueError(f"--base {base}: its model config differs from the ARMT model's base")
    print(f"fitting rank-{rank} changes of {armt.config.num_layers} layers ...", flush=True)
    adapter, report = fit_base_adapter(
        nnx.to_pure_dict(armt.base.params), nnx.to_pure_dict(base_model.params), rank, dtype
    )
    cast = jax.tree.map(lambda x: x.astype(dtype), nnx.state(armt.memory))
    nnx.update(armt.memory, cast)
    export = {
        "source": str(Path(model).absolute()),
        "base": reference.to_dict(),
        "rank": rank,
        "dtype": str(jnp.dtype(dtype)),
        "adapter_bytes": adapter_bytes(adapter),
        "tensors": report,
    }
    record["export"] = export
    armt.save(  # a base left as it was (a --freeze-base run) needs no adapter
        out,
        overwrite=overwrite,
        base_reference=reference,
        base_adapter=adapter or None,
        training_record=record,
    )
    return export


def checkpoint_record(path: str | Path) -> dict[str, Any]:
    """The training record of a training checkpoint: its run's `--init` model's runs, then this run as
    far as the checkpoint got (step, settings, wall time, loss)."""
    trainer = training_record(path)
    settings, history = trainer.get("hyperparams", {}), trainer.get("history", {})
    record = saved_training_record(settings["init"]) if settings.get("init") else {}
    run = {
        "training_checkpoint": str(Path(path).absolute()),
        "step": trainer.get("step"),
        "total_steps": trainer.get("total_steps"),
        "hyperparams": settings,
        "train_wall_s": (history.get("wall_s") or [None])[-1],
        "final_loss": (history.get("loss") or [None])[-1],
    }
    return {**record, "runs": [*record.get("runs", []), run]}


def run_export_armt(args: argparse.Namespace) -> int:
    """Export, then print the adapter's size and how much of each change the rank keeps."""
    export = export_armt(args.model, args.base, args.out, args.rank, DTYPES[args.dtype], args.overwrite)
    for row in export["tensors"]:
        print(
            f"  {row['name']:<24} {tuple(row['shape'])!s:<20} {row['kind']:<8} "
            f"relative error {row['relative_error']:.3f}"
        )
    print(
        f"wrote {args.out}: {len(export['tensors'])} changed tensors, adapter "
        f"{export['adapter_bytes'] / 2**20:.1f} MiB, base {export['base']['where']}"
    )
    return 0
