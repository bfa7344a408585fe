"""Generation over the static cache: equals full forward passes, per-row EOS, sampling options."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlongctx
from jaxlongctx import SamplingParams
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
    out = jaxlongctx.generate(model, ids, SamplingParams(6, stop_ids=()), attention_mask=mask)
    full_mask = np.concatenate([mask, np.ones((2, 6), bool)], axis=1)
    logits = np.asarray(model(out, full_mask))
    np.testing.assert_array_equal(out[:, 7:], logits[:, 6:-1].argmax(-1))


def test_padded_batch_equals_rows_alone(model):
    rng = np.random.default_rng(1)
    a, b = rng.integers(3, 97, 9).astype(np.int32), rng.integers(3, 97, 5).astype(np.int32)
    ids = np.zeros((2, 9), np.int32)
    ids[0], ids[1, :5] = a, b
    mask = ids != 0
    params = SamplingParams(8, stop_ids=())
    out = jaxlongctx.generate(model, ids, params, attention_mask=mask)
    np.testing.assert_array_equal(out[0, 9:], jaxlongctx.generate(model, a[None], params)[0, 9:])
    np.testing.assert_array_equal(out[1, 9:], jaxlongctx.generate(model, b[None], params)[0, 5:])


def test_rows_stop_independently_at_eos(model):
    ids = np.random.default_rng(2).integers(3, 97, (2, 5)).astype(np.int32)
    free = jaxlongctx.generate(model, ids, SamplingParams(10, stop_ids=()))
    stop_tok = int(free[0, 7])  # make row 0's third generated token the eos
    out = jaxlongctx.generate(model, ids, SamplingParams(10, stop_ids=stop_tok))
    first = int(np.argmax(free[0, 5:] == stop_tok))
    assert (out[0, 5 + first :] == stop_tok).all()
    np.testing.assert_array_equal(out[0, : 5 + first], free[0, : 5 + first])


def test_sampling_is_seeded_and_respects_top_k(model):
    ids = np.arange(3, 10, dtype=np.int32)[None]

    def sampled(**kwargs):
        return jaxlongctx.generate(model, ids, SamplingParams(12, stop_ids=(), **kwargs))

    a = sampled(temperature=1.0, top_k=5, seed=3)
    b = sampled(temperature=1.0, top_k=5, seed=3)
    np.testing.assert_array_equal(a, b)
    top1 = sampled(temperature=1.0, top_k=1, seed=4)
    np.testing.assert_array_equal(top1, sampled())
    nucleus = sampled(temperature=0.7, top_p=1e-6, seed=5)
    np.testing.assert_array_equal(nucleus, sampled())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(seed=1.5), "seed"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(stop_ids=-1), "stop_ids"),
        (dict(stop_ids=[2, "x"]), "stop_ids"),
        (dict(stop_ids=2.0), "stop_ids"),
    ],
)
def test_bad_sampling_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{"max_new_tokens": 2, **kwargs})


def test_sampling_params_normalise_and_check_against_the_model(model):
    params = SamplingParams(3, temperature=1, top_p=1, stop_ids=[5, 2, 5])
    assert (params.temperature, params.top_p, params.stop_ids) == (1.0, 1.0, (5, 2))
    assert SamplingParams(3, stop_ids=np.int64(7)).stop_ids == (7,)
    assert SamplingParams(3).resolve_stop_ids(model) == (2,)  # None: the config's eos
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, 97\]"):
        jaxlongctx.generate(model, np.array([[3, 4]]), SamplingParams(2, top_k=98))
    with pytest.raises(ValueError, match=r"stop_ids: 97 is outside the vocabulary"):
        jaxlongctx.generate(model, np.array([[3, 4]]), SamplingParams(2, stop_ids=[1, 97]))
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        jaxlongctx.generate(model, np.array([[3, 4]]), 2)


def test_cache_choice_dispatch_errors(model):
    ids = np.array([[3, 4]], np.int32)
    params = SamplingParams(2, stop_ids=())
    np.testing.assert_array_equal(
        jaxlongctx.generate(model, ids, params, cache=jaxlongctx.DenseKV()),
        jaxlongctx.generate(model, ids, params),
    )
    with pytest.raises(ValueError, match=r"ARMTMemory.*full-attention model"):
        jaxlongctx.generate(model, ids, params, cache=jaxlongctx.ARMTMemory())
    with pytest.raises(ValueError, match="cache must be DenseKV"):
        jaxlongctx.generate(model, ids, params, cache="pq")
    with pytest.raises(ValueError, match="needs a jaxlongctx Model"):
        jaxlongctx.generate(object(), ids, params)
    with pytest.raises(ValueError, match="PQKV needs codebooks"):
        jaxlongctx.PQKV(None)
    with pytest.raises(ValueError, match="schedule must be one of"):
        jaxlongctx.ARMTMemory("fast")
