"""A resumable training loop: jitted step, orbax checkpoints, progress bar, evaluation, loss curve.

The whole training state is `(params, opt_state, step)` plus the loss history. Batches are a pure
function of the step (see `jaxlongctx.train.data`) and the step has no other randomness, so
restoring the latest checkpoint and continuing reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from jaxlongctx.checkpoint import CheckpointError, on_device
from jaxlongctx.output_dir import MARKER, OutputError, atomic_directory, is_ours, write_marker

LossFn = Callable[[Any, Any, dict[str, jnp.ndarray]], jnp.ndarray]  # (params, frozen, batch) -> scalar
BatchFn = Callable[[int], dict[str, np.ndarray]]  # step -> batch
EvalFn = Callable[[Any], dict[str, float]]  # params -> metrics
TokenCount = Callable[[dict[str, np.ndarray]], int]  # batch -> tokens in it (for the tokens/s readout)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Loop length, checkpoint/eval cadence and where checkpoints and the loss curve go."""

    steps: int
    out_dir: Path
    ckpt_every: int = 100
    eval_every: int = 0  # 0: evaluate only at the end
    keep_checkpoints: int = 2
    progress: bool = True
    # The run's settings (learning rate, batch size, context, seed, ...): saved with every checkpoint,
    # and a resume that changes any of them is refused.
    hyperparams: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.ckpt_every < 1:
            raise ValueError(f"ckpt_every must be >= 1, got {self.ckpt_every}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


def load_into(module: nnx.Module, pure: dict[str, Any]) -> nnx.Module:
    """Copy a pure parameter dict (as trained) into `module` in place; returns the module."""
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(module, state)
    return module


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory under `out_dir/checkpoints`, or None."""
    root = Path(out_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / "trainer.json").is_file()) if root.is_dir() else []
    return done[-1] if done else None


class Trainer:
    """Minimise `loss_fn(params, frozen, batch)` over `batch_fn(step)` with `optimizer`."""

    def __init__(
        self,
        loss_fn: LossFn,
        params: Any,
        optimizer: optax.GradientTransformation,
        batch_fn: BatchFn,
        config: TrainerConfig,
        *,
        frozen: Any = None,
        eval_fn: EvalFn | None = None,
        count_tokens: TokenCount | None = None,
    ):
        self.config, self.batch_fn, self.eval_fn, self.frozen = config, batch_fn, eval_fn, frozen
        self.count_tokens = count_tokens
        self.params = params
        self.opt_state = optimizer.init(params)
        self.step = 0
        self.history: dict[str, list] = {"step": [], "loss": [], "grad_norm": [], "eval": [], "wall_s": []}
        self._wall = 0.0

        def train_step(params, opt_state, frozen, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, frozen, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1))
        self._loss = jax.jit(loss_fn)

    def batch_loss(self, step: int) -> float:
        """The loss of the current params on the batch of training step `step`."""
        batch = {k: jnp.asarray(v) for k, v in self.batch_fn(step).items()}
        return float(self._loss(self.params, self.frozen, batch))

    # --- checkpoints ----------------------------------------------------------------------------
    def _state_tree(self) -> dict[str, Any]:
        return {"params": self.params, "opt_state": self.opt_state}

    def save_checkpoint(self) -> Path:
        """Write the full training state at the current step (atomically) and prune old ones."""
        root = Path(self.config.out_dir) / "checkpoints"
        path = _step_dir(root, self.step)
        with atomic_directory(path, overwrite=True, kind="training-state") as tmp:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(tmp / "state", self._state_tree())
            meta = {
                "step": self.step,
                "total_steps": self.config.steps,
                "wall_s": self._wall,
                "hyperparams": self.config.hyperparams,
                "history": self.history,
            }
            (tmp / "trainer.json").write_text(json.dumps(meta) + "\n")
        done = sorted(p for p in root.glob("step_*") if (p / "trainer.json").is_file())
        for old in done[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def restore(self, path: str | Path) -> None:
        """Load params, optimizer state, step and history from a checkpoint written by `save_checkpoint`."""
        path = Path(path).absolute()
        try:
            meta = json.loads((path / "trainer.json").read_text())
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._state_tree())
            with ocp.StandardCheckpointer() as ckptr:
                state = ckptr.restore(path / "state", on_device(target))
        except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"{path}: cannot restore training state ({type(e).__name__}: {e})"
            ) from None
        if meta["total_steps"] != self.config.steps:
            raise CheckpointError(
                f"{path}: written by a run of {meta['total_steps']} steps; resuming it with "
                f"{self.config.steps} steps would change the learning-rate schedule"
            )
        saved = json.loads(json.dumps(meta.get("hyperparams", {})))
        now = json.loads(
            json.dumps(self.config.hyperparams)
        )  # the JSON round trip the saved copy went through
        changed = sorted(k for k in saved.keys() | now.keys() if k in saved and saved.get(k) != now.get(k))
        if changed:
            diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
            raise CheckpointError(
                f"{path}: resuming with changed settings ({diffs}); rerun with the saved "
                f"settings, or train into a new --out"
            )
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.step, self._wall, self.history = int(meta["step"]), float(meta["wall_s"]), meta["history"]

    def claim_out_dir(self) -> None:
        """Create the run directory `out_dir` and mark it as ours; refuse a non-empty directory that
        holds no run of ours (its files could be overwritten)."""
        out = Path(self.config.out_dir)
        if out.exists() and not out.is_dir():
            raise OutputError(f"{out}: exists and is not a directory")
        if out.is_dir() and any(out.iterdir()) and not is_ours(out) and latest_checkpoint(out) is None:
            raise OutputError(
                f"{out}: a non-empty directory that holds no jaxlongctx training run; "
                "give a new or empty --out"
            )
        try:
            out.mkdir(parents=True, exist_ok=True)
            if not (out / MARKER).exists():
                write_marker(out, "training-run")
        except OSError as e:
            raise OutputError(f"{out}: cannot write the run directory ({e.strerror})") from None

    def maybe_resume(self) -> bool:
        """Claim `out_dir` (see `claim_out_dir`) and restore its latest checkpoint if there is one;
        True if resumed."""
        self.claim_out_dir()
        path = latest_checkpoint(self.config.out_dir)
        if path is None:
            return False
        self.restore(path)
        return True

    # --- loop -----------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Run `eval_fn` on the current params and record the result in the history."""
        if self.eval_fn is None:
            return {}
        metrics = {"step": self.step, **{k: float(v) for k, v in self.eval_fn(self.params).items()}}
        self.history["eval"].append(metrics)
        return metrics

    def run(self, stop_at: int | None = None) -> dict[str, list]:
        """Train until `config.steps` (or `stop_at`, to simulate an interruption); returns the history."""
        cfg = self.config
        self.claim_out_dir()
        end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        bar = tqdm(
            total=cfg.steps, initial=self.step, disable=not cfg.progress, unit="step", dynamic_ncols=True
        )
        while self.step < end:
            host_batch = self.batch_fn(self.step)
            batch = {k: jnp.asarray(v) for k, v in host_batch.items()}
            t0 = time.perf_counter()
            self.params, self.opt_state, loss, gnorm = self._train_step(
                self.params, self.opt_state, self.frozen, batch
            )
            loss = float(loss)
            dt = time.perf_counter() - t0
            self._wall += dt
            if not np.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {self.step}")
            record = {"step": self.step, "loss": loss, "grad_norm": float(gnorm), "wall_s": self._wall}
            for key, value in record.items():
                self.history[key].append(value)
            self.step += 1
            postfix = {"loss": f"{loss:.3f}"}
            if self.count_tokens is not None:
                postfix["tok/s"] = f"{self.count_tokens(host_batch) / dt:.0f}"
            bar.set_postfix(postfix)
            bar.update(1)
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                bar.write(f"step {self.step}: {self.evaluate()}")
            if self.step % cfg.ckpt_every == 0 or self.step == end:
                if self.step == cfg.steps:
                    self.evaluate()
                self.save_checkpoint()
        bar.close()
        return self.history

    def plot(self, path: str | Path, title: str = "training loss") -> Path:
        """PNG of the training loss (and evaluation loss where recorded) against the step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(self.history["step"], self.history["loss"], lw=0.8, label="train loss")
        evals = [e for e in self.history["eval"] if "loss" in e]
        if evals:
            ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return Path(path)
