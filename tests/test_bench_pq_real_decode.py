"""The SmolLM2 dense-vs-PQ decode bench (`bench.pq_real_decode`) on a tiny model with SmolLM2's head
grouping, so it cannot rot: one row, its bytes and ratios, the plot, and both PQ paths agreeing."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import pq_real_decode
from bench.pq_decode import _random_codebooks
from jaxlongctx.config import ModelConfig
from jaxlongctx.model.model import Model

TINY = ModelConfig(
    vocab_size=256,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
)  # 3 query heads per kv head, as SmolLM2


@pytest.fixture(scope="module")
def tiny():
    model = Model.init(TINY, dtype=jnp.float32)
    return model, {
        name: _random_codebooks(TINY, *cache[:2]) for name, cache in pq_real_decode.PQ_CACHES.items()
    }


@pytest.mark.slow  # two whole-model decode compiles: about a minute on 2 loaded cores
def test_native_and_xla_pq_chains_decode_the_same_tokens(tiny):
    model, books = tiny
    native, xla = (
        pq_real_decode.pq_chain(model, books["pq_ds2"], 96, 3, 16, 2, backend) for backend in ("auto", "xla")
    )
    np.testing.assert_array_equal(native(3), xla(3))  # 3 greedy steps over the same synthetic cache
    packed = (pq_real_decode.pq_chain(model, books["pq_ds2_4bit"], 96, 3, 16, 2, b) for b in ("auto", "xla"))
    np.testing.assert_array_equal(*(chain(3) for chain in packed))  # the register path, the same tokens


@pytest.mark.slow
def test_row_bytes_ratios_and_plot(tiny, tmp_path, monkeypatch):
    model, books = tiny
    args = argparse.Namespace(steps=1, repeats=1, batch=1, window=16, no_xla_path=False)
    buf = jnp.ones((2**20,), jnp.float32)
    total = jax.jit(jnp.sum)
    row = pq_real_decode.measure(model, books, 64, args, ({"read_xla": lambda: total(buf)}, 4 * 2**20))
    methods = ("dense", *pq_real_decode.PQ_CACHES, "pq_ds2_xla")
    for name in methods:
        assert np.isfinite(row[name]["tokens_per_s"]) and row[name]["tokens_per_s"] > 0, name
        assert (
            row[name]["bytes_read_per_step"] == model.param_bytes() + row[name]["cache_bytes_read_per_step"]
        )
    assert row["dense"]["cache_bytes_read_per_step"] == 2 * 2 * 64 * 2 * 16 * 4  # K+V, L=2, K=2, hd 16, fp32
    codes = 2 * 2 * 2 * (64 - 16) * (16 // 2)  # K+V, L, K, coded tokens, M (one byte per code)
    assert (
        row["pq_ds2"]["cache_bytes_read_per_step"]
        == pq_real_decode.pq_bytes(TINY, 64, books["pq_ds2"], 16)
        > codes
    )
    packed = row["pq_ds2_4bit"]["cache_bytes_read_per_step"] - row["pq_ds2"]["cache_bytes_read_per_step"]
    assert packed < -codes // 2 + 1  # half the code bytes (and a smaller codebook)
    assert np.isclose(row["dense_over_pq_ds2"], row["dense"]["s_per_token"] / row["pq_ds2"]["s_per_token"])
    assert len(row["load_average_1min_before_after"]) == 2
    monkeypatch.setattr(pq_real_decode, "plot_path", lambda name: tmp_path / f"{name}.png")
    pq_real_decode.plot({"rows": [row, {**row, "context": 128}], "dtype": "fp32", "batch": 1})
    assert (tmp_path / "pq_real_decode.png").stat().st_size > 0
