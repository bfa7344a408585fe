"""Generation over the static cache: equals full forward passes, per-row EOS, sampling options."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.config import ModelConfig

CFG = ModelConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def model():
    return jaxlongctx.Model.init(CFG, seed=1)


@pytest.mark.jaxmin
def test_cached_decode_equals_full_forward(model):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 97, (2, 7)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, :3] = False  # left padding
    out = jaxlongctx.generate(model, ids, 6, attention_mask=mask, eos_id=-1)
    full_mask = np.concatenate([mask, np.ones((2, 6), bool)], axis=1)
    logits = np.asarray(model(out, full_mask))
    np.testing.assert_array_equal(out[:, 7:], logits[:, 6:-1].argmax(-1))


def test_padded_batch_equals_rows_alone(model):
    rng = np.random.default_rng(1)
    a, b = rng.integers(3, 97, 9).astype(np.int32), rng.integers(3, 97, 5).astype(np.int32)
    ids = np.zeros((2, 9), np.int32)
    ids[0], ids[1, :5] = a, b
    mask = ids != 0
    out = jaxlongctx.generate(model, ids, 8, attention_mask=mask, eos_id=-1)
    np.testing.assert_array_equal(out[0, 9:], jaxlongctx.generate(model, a[None], 8, eos_id=-1)[0, 9:])
    np.testing.assert_array_equal(out[1, 9:], jaxlongctx.generate(model, b[None], 8, eos_id=-1)[0, 5:])


def test_rows_stop_independently_at_eos(model):
    ids = np.random.default_rng(2).integers(3, 97, (2, 5)).astype(np.int32)
    free = jaxlongctx.generate(model, ids, 10, eos_id=-1)
    stop_tok = int(free[0, 7])  # make row 0's third generated token the eos
    out = jaxlongctx.generate(model, ids, 10, eos_id=stop_tok)
    first = int(np.argmax(free[0, 5:] == stop_tok))
    assert (out[0, 5 + first :] == stop_tok).all()
    np.testing.assert_array_equal(out[0, : 5 + first], free[0, : 5 + first])


def test_sampling_is_seeded_and_respects_top_k(model):
    ids = np.arange(3, 10, dtype=np.int32)[None]
    a = jaxlongctx.generate(model, ids, 12, temperature=1.0, top_k=5, seed=3, eos_id=-1)
    b = jaxlongctx.generate(model, ids, 12, temperature=1.0, top_k=5, seed=3, eos_id=-1)
    np.testing.assert_array_equal(a, b)
    top1 = jaxlongctx.generate(model, ids, 12, temperature=1.0, top_k=1, seed=4, eos_id=-1)
    np.testing.assert_array_equal(top1, jaxlongctx.generate(model, ids, 12, eos_id=-1))
    nucleus = jaxlongctx.generate(model, ids, 12, temperature=0.7, top_p=1e-6, seed=5, eos_id=-1)
    np.testing.assert_array_equal(nucleus, jaxlongctx.generate(model, ids, 12, eos_id=-1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_options(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxlongctx.generate(model, np.array([[3, 4]]), 2, **kwargs)
