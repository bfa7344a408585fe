"""The real-model bench's core (`bench.real_model.compare` and its plot) on a tiny model, so it cannot rot."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlongctx
from bench import real_model

torch = pytest.importorskip("torch")  # the oracle; absent on the jax-min lane


def test_compare_row_and_plot(hf_family_dir, tmp_path, monkeypatch):
    hf_dir, hf = hf_family_dir("llama32")
    model = jaxlongctx.load(hf_dir, "fp32")
    ids = np.arange(3, 3 + 24, dtype=np.int32)[None]
    bandwidth = real_model.read_bandwidth_fns(8 * 2**20)
    row = real_model.compare(model, hf.to(torch.float32), ids, new_tokens=3, repeats=1, bandwidth=bandwidth)
    assert row["context"] == 24 and row["dtype"] == "float32"
    for key in (
        "ours_prefill_tokens_per_s",
        "hf_prefill_tokens_per_s",
        "ours_decode_tokens_per_s",
        "hf_decode_tokens_per_s",
        "read_bytes_per_s",
        "decode_ceiling_tokens_per_s",
    ):
        assert np.isfinite(row[key]) and row[key] > 0, key
    weights_and_kv = (
        model.param_bytes() + 2 * 2 * 24 * 2 * 8 * 4
    )  # L=2, K=2, hd=8 (hidden 64 / 8 heads), fp32
    assert row["bytes_per_token"] == weights_and_kv
    assert np.isclose(row["decode_ceiling_tokens_per_s"], row["read_bytes_per_s"] / weights_and_kv)
    fastest_read = min(row["raw_prefill_times"][name]["median_s"] for name in ("read_xla", "read_torch"))
    assert np.isclose(row["read_bytes_per_s"], 8 * 2**20 / fastest_read)
    assert np.isclose(
        row["ours_decode_fraction_of_ceiling"],
        row["ours_decode_tokens_per_s"] / row["decode_ceiling_tokens_per_s"],
    )
    monkeypatch.setattr(real_model, "plot_path", lambda name: tmp_path / f"{name}.png")
    real_model.plot([row, {**row, "dtype": "bfloat16"}])
    assert (tmp_path / "real_model.png").stat().st_size > 0
