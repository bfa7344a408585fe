"""Logit and greedy-generation parity with `transformers` for every supported family."""

from __future__ import annotations

import numpy as np
import pytest
from hf_oracle import VOCAB, hf_logits, make_hf_model

import jaxlongctx

torch = pytest.importorskip("torch")  # the oracle; absent on the jax-min lane


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (2, 17)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, 11:] = False  # second row: 11 real tokens, right padding
    return ids, mask


def test_logits_match_transformers(hf_family_dir, family):
    hf_dir, hf = hf_family_dir(family)
    model = jaxlongctx.load(hf_dir)
    ids, mask = _batch()
    ours = np.asarray(model(ids, mask))
    ref = hf_logits(hf, ids, mask)
    assert np.abs(ours - ref)[mask].max() <= 1e-4


def test_left_and_right_padding_equal_unpadded_row(hf_family_dir):
    hf_dir, _ = hf_family_dir("llama32")
    model = jaxlongctx.load(hf_dir)
    ids, _ = _batch(1)
    alone = np.asarray(model(ids[:1, :9]))[0]
    right = np.zeros((1, 17), np.int32)
    right[0, :9] = ids[0, :9]
    left = np.zeros((1, 17), np.int32)
    left[0, 8:] = ids[0, :9]
    out_r = np.asarray(model(right, right != 0))[0, :9]
    out_l = np.asarray(model(left, left != 0))[0, 8:]
    np.testing.assert_allclose(out_r, alone, atol=1e-5)
    np.testing.assert_allclose(out_l, alone, atol=1e-5)


def test_greedy_generation_matches_transformers(hf_family_dir, family):
    hf_dir, hf = hf_family_dir(family)
    model = jaxlongctx.load(hf_dir)
    ids = np.random.default_rng(2).integers(3, VOCAB, (1, 9)).astype(np.int32)
    ours = jaxlongctx.generate(model, ids, jaxlongctx.SamplingParams(32, stop_ids=()))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(ids, dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    np.testing.assert_array_equal(ours, ref.numpy())


def test_sharded_safetensors_with_index(tmp_path):
    hf = make_hf_model("llama2", tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    model = jaxlongctx.load(tmp_path / "sharded")
    ids, mask = _batch(3)
    np.testing.assert_allclose(np.asarray(model(ids, mask))[mask], hf_logits(hf, ids, mask)[mask], atol=1e-4)


@pytest.mark.parametrize("dtype", ["bf16"])
def test_bf16_load_is_close(hf_family_dir, dtype):
    hf_dir, hf = hf_family_dir("qwen2")
    model = jaxlongctx.load(hf_dir, dtype)
    ids, mask = _batch(4)
    ours = np.asarray(model(ids, mask))[mask]
    ref = hf_logits(hf, ids, mask)[mask]
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 0.05
