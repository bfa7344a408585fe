"""Base adapters: a fine-tune that changed its base is stored as memory + low-rank changes of a named
base, loads back to the fine-tune's weights, and refuses malformed adapters or a different base."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlongctx
from jaxlongctx.armt import ARMTConfig, ARMTModel
from jaxlongctx.armt.base_adapter import (
    adapter_bytes,
    apply_adapter,
    fit_base_adapter,
    restore_adapter,
    write_adapter,
)
from jaxlongctx.armt.base_reference import describe_base
from jaxlongctx.checkpoint import CheckpointError, save_model
from jaxlongctx.cli import main
from jaxlongctx.model.model import Model
from tests.test_armt_utils import tiny_config

CHANGE_RANK = 2


def _changed(params: dict, rng: np.random.Generator, rank: int = CHANGE_RANK) -> dict:
    """`params` with every matrix moved by a random rank-`rank` change and every vector moved whole."""
    out = {}
    for name, x in params.items():
        if isinstance(x, dict):
            out[name] = _changed(x, rng, rank)
            continue
        x = np.asarray(x, np.float32)
        if x.ndim >= 2:
            left = rng.normal(size=x.shape[:-1] + (rank,)).astype(np.float32)
            right = rng.normal(size=x.shape[:-2] + (rank, x.shape[-1])).astype(np.float32)
            out[name] = jnp.asarray(x + 0.01 * left @ right)
        else:
            out[name] = jnp.asarray(x + 0.01 * rng.normal(size=x.shape).astype(np.float32))
    return out


@pytest.fixture
def tuned_on_base(tmp_path):
    """(base checkpoint dir, full ARMT checkpoint dir, that ARMT model): the ARMT's base is the saved
    base with a rank-2 change in every matrix, its memory random."""
    base = Model.init(tiny_config(2), seed=0, dtype=jnp.float32)
    base_dir = save_model(base.module, tmp_path / "base")
    params = _changed(nnx.to_pure_dict(base.params), np.random.default_rng(0))
    graphdef, state = nnx.split(base.module)
    nnx.replace_by_pure_dict(state, params)
    armt = ARMTModel.wrap(Model(nnx.merge(graphdef, state)), ARMTConfig(8, 4, d_mem=8), jax.random.key(0))
    armt = armt.randomize_memory_params(jax.random.key(1))
    armt.save(tmp_path / "full")
    return base_dir, tmp_path / "full", armt


def _assert_close_params(a: ARMTModel, b: ARMTModel, atol: float) -> None:
    for (name, x), (_, y) in zip(jax.tree.leaves_with_path(a.params), jax.tree.leaves_with_path(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, err_msg=str(name))


def test_fit_keeps_the_change_at_its_rank_and_reports_the_truncation(tuned_on_base):
    base_dir, _, armt = tuned_on_base
    base = nnx.to_pure_dict(jaxlongctx.load(base_dir).params)
    tuned = nnx.to_pure_dict(armt.base.params)
    exact, report = fit_base_adapter(tuned, base, CHANGE_RANK, jnp.float32)
    assert {r["name"] for r in report} == set(exact)
    assert max(r["relative_error"] for r in report) < 1e-5
    wq = exact["layers/wq"]
    assert wq["left"].shape == (2, 32, CHANGE_RANK) and wq["right"].shape == (2, CHANGE_RANK, 32)
    assert set(exact["final_norm"]) == {"delta"}
    restored = apply_adapter(base, exact, base_dir)
    flat_restored = dict(jax.tree.leaves_with_path(restored))
    for name, x in jax.tree.leaves_with_path(tuned):
        np.testing.assert_allclose(np.asarray(flat_restored[name]), np.asarray(x), atol=1e-5)

    # a lower rank keeps the largest singular direction: the error is the dropped one's share
    truncated, report = fit_base_adapter(tuned, base, 1, jnp.float32)
    delta = np.asarray(tuned["layers"]["wq"], np.float32) - np.asarray(base["layers"]["wq"], np.float32)
    s = np.linalg.svd(delta, compute_uv=False)  # [L, k]
    expected = np.sqrt((s[:, 1:] ** 2).sum()) / np.sqrt((s**2).sum())
    row = next(r for r in report if r["name"] == "layers/wq")
    assert row["kind"] == "rank 1" and row["relative_error"] == pytest.approx(expected, rel=1e-4)
    assert adapter_bytes(truncated) < adapter_bytes(exact)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        fit_base_adapter(tuned, base, 0)


def test_export_round_trips_through_load_and_refuses_another_base(tuned_on_base, tmp_path):
    base_dir, full_dir, armt = tuned_on_base
    out = tmp_path / "memory"
    args = ["export-armt", "--model", str(full_dir), "--base", str(base_dir), "--out", str(out)]
    assert main([*args, "--rank", str(CHANGE_RANK), "--dtype", "fp32"]) == 0
    assert not (out / "params").exists() and (out / "base_adapter").is_dir()
    meta = json.loads((out / "config.json").read_text())
    assert meta["base"] == describe_base(base_dir).to_dict() and meta["base_adapter"]["tensors"] > 0
    record = json.loads((out / "training.json").read_text())
    assert record["export"]["rank"] == CHANGE_RANK and record["export"]["source"] == str(full_dir)

    loaded = jaxlongctx.load(out)
    assert isinstance(loaded, ARMTModel) and loaded.base_reference == describe_base(base_dir)
    _assert_close_params(loaded, armt, atol=1e-5)
    ids = np.random.default_rng(1).integers(3, 60, size=(1, 20))
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(armt(ids)), atol=1e-4)

    assert main(args) == 2  # exists: refused without --overwrite
    assert main([*args, "--overwrite", "--rank", "0"]) == 2
    assert (
        main(["export-armt", "--model", str(out), "--base", str(base_dir), "--out", str(tmp_path / "x")]) == 2
    )

    save_model(Model.init(tiny_config(2), seed=1, dtype=jnp.float32).module, base_dir, overwrite=True)
    with pytest.raises(CheckpointError, match="a different base"):
        jaxlongctx.load(out)


def test_malformed_adapters_are_named(tuned_on_base, tmp_path):
    base_dir, _, armt = tuned_on_base
    base = nnx.to_pure_dict(jaxlongctx.load(base_dir).params)
    adapter, _ = fit_base_adapter(nnx.to_pure_dict(armt.base.params), base, CHANGE_RANK)
    write_adapter(tmp_path, adapter)
    stored = restore_adapter(tmp_path)
    assert stored.keys() == adapter.keys()
    np.testing.assert_array_equal(stored["layers/wq"]["left"], adapter["layers/wq"]["left"])

    with pytest.raises(CheckpointError, match="does not have"):
        apply_adapter(base, {"layers/w_extra": {"delta": np.zeros(3)}}, tmp_path)
    wrong = {"layers/wq": {"left": np.zeros((2, 32, 2)), "right": np.zeros((2, 2, 16))}}
    with pytest.raises(CheckpointError, match=r"layers/wq: shape \(2, 32, 16\)"):
        apply_adapter(base, wrong, tmp_path)
    with pytest.raises(CheckpointError, match="do not chain"):
        apply_adapter(
            base, {"layers/wq": {"left": np.zeros((2, 32, 2)), "right": np.zeros((2, 3, 32))}}, tmp_path
        )
    with pytest.raises(CheckpointError, match="cannot restore the base adapter"):
        restore_adapter(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="pass base_reference"):
        armt.save(tmp_path / "x", base_adapter=adapter)
