"""Bad input at the API boundary is a ValueError that names the argument."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.config import ConfigError, ModelConfig

CFG = ModelConfig(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)


@pytest.fixture(scope="module")
def model():
    return jaxlongctx.Model.init(CFG)


@pytest.mark.parametrize(
    "ids, match",
    [
        (np.array([[1, 50]]), "token id 50 outside the vocabulary"),
        (np.array([[-1, 3]]), "token id -1 outside the vocabulary"),
        (np.array([[1.0, 2.0]]), "ids must be an integer array"),
        (np.zeros((1, 2, 3), np.int32), r"ids must have shape \[batch, length\]"),
        (np.zeros((1, 0), np.int32), "ids must not be empty"),
    ],
)
def test_bad_ids(model, ids, match):
    with pytest.raises(ValueError, match=match):
        model(ids)
    with pytest.raises(ValueError, match=match):
        jaxlongctx.generate(model, ids, jaxlongctx.SamplingParams(2))


def test_bad_masks(model):
    ids = np.ones((2, 4), np.int32)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\)"):
        model(ids, np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="attention_mask must be boolean or 0/1"):
        model(ids, np.full((2, 4), 2))
    with pytest.raises(ValueError, match="attention_mask row 1 has no real token"):
        model(ids, np.array([[1, 1, 1, 1], [0, 0, 0, 0]]))


def test_bad_max_new_tokens(model):
    with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
        jaxlongctx.SamplingParams(0)


def test_prompt_longer_than_sliding_window():
    m = jaxlongctx.Model.init(dataclasses.replace(CFG, model_type="mistral", sliding_window=8))
    m(np.ones((1, 8), np.int32))
    with pytest.raises(ValueError, match="exceeds sliding_window=8"):
        m(np.ones((1, 9), np.int32))
    with pytest.raises(ValueError, match="exceeds sliding_window=8"):
        jaxlongctx.generate(m, np.ones((1, 6), np.int32), jaxlongctx.SamplingParams(3))


def test_bad_configs():
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        dataclasses.replace(CFG, num_heads=3, num_kv_heads=2)
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_hf(
            {
                "model_type": "llama",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
            }
        )
    with pytest.raises(ConfigError, match="missing required field 'vocab_size'"):
        ModelConfig.from_hf({"model_type": "llama"})


def test_load_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="no such model directory"):
        jaxlongctx.load(tmp_path / "nope")
    with pytest.raises(ValueError, match="neither a jaxlongctx checkpoint nor a HF model directory"):
        jaxlongctx.load(tmp_path)
    with pytest.raises(ValueError, match="unsupported dtype 'fp16'"):
        jaxlongctx.load(tmp_path, "fp16")
