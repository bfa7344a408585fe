"""The calibration-time bench (`bench.pq_calibration_time`) on a tiny model, so it cannot rot: a timed
row per granularity with the tokens it calibrated on, and the plot."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import bench.common
from bench import pq_calibration_time
from jaxlongctx.kvcache.codebooks import GRANULARITIES
from jaxlongctx.model.model import Model
from tests.test_armt_utils import tiny_config


def test_rows_time_each_granularity_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.common, "_QUICK", False)
    model = Model.init(tiny_config(2), dtype=jnp.float32)
    tokens = np.random.default_rng(0).integers(3, 60, size=600).astype(np.int32)
    rows = [pq_calibration_time.time_row(model, tokens, 2, g, 64, 512) for g in GRANULARITIES]
    assert [r["granularity"] for r in rows] == list(GRANULARITIES)
    assert all(r["seconds"] > 0 and r["calibration_tokens"] == 512 for r in rows)
    assert all(r["iters_run"] >= 1 and r["key_mse"] > 0 and r["value_mse"] > 0 for r in rows)
    path = pq_calibration_time.plot({"rows": rows}, "pq_calibration_time")
    assert (
        path == str(tmp_path / "pq_calibration_time.png") and (tmp_path / "pq_calibration_time.png").is_file()
    )
