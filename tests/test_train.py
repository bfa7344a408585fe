"""Training: data determinism, optimizer schedule, quick LM training with exact resume, eval hooks,
ARMT fine-tuning plumbing, and the shipped base model's HF export parity."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path


import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.data.haystack import CODE_DIGITS
from jaxlongctx.data.tokenizer import BOS_ID, encode_corpus, load_default_tokenizer
from jaxlongctx.model.llama import forward
from jaxlongctx.model.model import Model
from jaxlongctx.train.armt_finetune import answer_logits, curriculum, haystack_batch
from jaxlongctx.train.data import TokenWindows, eval_windows
from jaxlongctx.train.evaluate import forward_with_kv_transform, unigram_baseline
from jaxlongctx.train.lm import QUICK_CONFIG, add_train_lm_arguments, run_train_lm
from jaxlongctx.train.optim import OptimConfig, learning_rate

BASE_MODEL = Path(__file__).resolve().parent.parent / "jaxlongctx" / "assets" / "base_model"


def test_token_windows_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.int32) + 3
    a, b = TokenWindows(tokens, 4, 16, seed=7), TokenWindows(tokens, 4, 16, seed=7)
    for step in (0, 5, 17, 40):  # 40 crosses into later epochs
        np.testing.assert_array_equal(a.batch(step)["ids"], b.batch(step)["ids"])
    assert not np.array_equal(a.batch(0)["ids"], TokenWindows(tokens, 4, 16, seed=8).batch(0)["ids"])
    epoch = np.concatenate([a.batch(s)["ids"][:, 1] for s in range(a.num_windows // 4)])
    assert len(set(epoch.tolist())) == epoch.size  # no window repeats within an epoch
    batch = a.batch(3)
    assert batch["ids"].shape == (4, 17) and batch["mask"].all() and (batch["ids"][:, 0] == BOS_ID).all()
    w = eval_windows(tokens, 16)  # every token exactly once as a target
    np.testing.assert_array_equal(w["ids"][:, 1:][w["mask"][:, 1:]], tokens)
    with pytest.raises(ValueError, match="step"):
        a.batch(-1)
    with pytest.raises(ValueError, match="shorter"):
        TokenWindows(tokens[:8], 2, 16)


def test_warmup_cosine_schedule_and_bad_arguments():
    lr = learning_rate(OptimConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1))
    assert float(lr(0)) == 0.0 and float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55, abs=1e-6) and float(lr(110)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=20, total_steps=10)


def _train_lm(out: Path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    add_train_lm_arguments(parser)
    return run_train_lm(parser.parse_args(["--quick", "--out", str(out), "--steps", "6", "--batch-size", "2",
                                           "--context", "32", "--ckpt-every", "3", "--no-progress", *extra]))


def test_quick_training_lowers_loss_and_resumes_exactly(tmp_path):
    full = _train_lm(tmp_path / "full")
    history = json.loads((tmp_path / "full/checkpoints/step_00000006/trainer.json").read_text())["history"]
    assert np.mean(history["loss"][-3:]) < history["loss"][0]
    assert (tmp_path / "full/loss_curve.png").stat().st_size > 0
    assert math.isfinite(full["validation"]["ppl"])
    # "Interrupt" after step 3: a fresh run directory holding only the step-3 checkpoint resumes there.
    shutil.copytree(tmp_path / "full/checkpoints/step_00000003", tmp_path / "resumed/checkpoints/step_00000003")
    resumed = _train_lm(tmp_path / "resumed")
    again = json.loads((tmp_path / "resumed/checkpoints/step_00000006/trainer.json").read_text())["history"]
    assert resumed["resumed"] and again["step"] == history["step"]
    np.testing.assert_allclose(again["loss"], history["loss"], rtol=0, atol=1e-6)
    assert resumed["validation"]["loss"] == pytest.approx(full["validation"]["loss"], abs=1e-6)


def test_kv_transform_hook_sees_post_rope_kv():
    model = Model.init(QUICK_CONFIG, seed=1)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 4096, size=(2, 12)), jnp.int32)
    mask = jnp.ones(ids.shape, bool)
    ref = forward(model.module, ids, mask)
    seen = []

    def identity(k, v, layer):
        seen.append(k.shape)
        return k, v

    np.testing.assert_allclose(forward_with_kv_transform(model.module, ids, mask, identity), ref, atol=1e-6)
    assert seen == [(2, 12, QUICK_CONFIG.num_kv_heads, QUICK_CONFIG.head_dim)]  # traced once inside the scan
    zero_v = forward_with_kv_transform(model.module, ids, mask, lambda k, v, layer: (k, jnp.zeros_like(v)))
    assert float(jnp.abs(zero_v - ref).max()) > 1e-3


def test_unigram_baseline():
    out = unigram_baseline(np.array([3, 3, 3, 4]), np.array([3, 4]), vocab_size=5)
    assert out["loss"] == pytest.approx(-(math.log(4 / 9) + math.log(2 / 9)) / 2)


def test_armt_curriculum_and_answer_positions():
    assert curriculum([1, 2, 4], 7) == [1, 1, 2, 2, 4, 4, 4]
    with pytest.raises(ValueError, match="stage"):
        curriculum([1, 2], 1)
    batch = haystack_batch(0, 2, 256, load_default_tokenizer(), 128, num_facts=4)
    assert batch["seg_ids"].shape == (2, 2, 128) and batch["answer_ids"].shape == (2, CODE_DIGITS)
    flat = batch["seg_ids"].transpose(1, 0, 2).reshape(2, -1)
    np.testing.assert_array_equal(flat[:, -(CODE_DIGITS - 1):], batch["answer_ids"][:, :-1])
    logits = jnp.asarray(np.arange(2 * 2 * 128, dtype=np.float32).reshape(2, 2, 128, 1))  # nS B S V=1
    picked = answer_logits(logits, 256)[..., 0]  # B 4: flat positions 252..255 of each row
    np.testing.assert_array_equal(picked[1], logits[1, 1, 124:, 0])


@pytest.mark.skipif(not BASE_MODEL.is_dir(), reason="base model asset not built yet")
def test_shipped_base_model_exports_to_transformers(tmp_path):
    import torch
    import transformers

    from convert.hf_llama import export_ckpt_to_hf
    from hf_oracle import hf_logits
    from jaxlongctx.loading import load

    ours = load(BASE_MODEL, "fp32")
    assert ours.tokenizer is not None
    export_ckpt_to_hf(BASE_MODEL, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = np.concatenate([[BOS_ID], encode_corpus("validation")[:95]])[None].astype(np.int32)
    mask = np.ones_like(ids, bool)
    np.testing.assert_allclose(np.asarray(ours(ids, mask)), hf_logits(theirs, ids, mask), atol=1e-4)


@pytest.mark.skipif(not BASE_MODEL.is_dir(), reason="base model asset not built yet")
def test_eval_ppl_of_shipped_model_beats_unigram():
    from jaxlongctx.train.evaluate import add_eval_ppl_arguments, run_eval_ppl

    parser = argparse.ArgumentParser()
    add_eval_ppl_arguments(parser)
    out = run_eval_ppl(parser.parse_args(["--ckpt", str(BASE_MODEL), "--max-tokens", "1024", "--context", "256",
                                          "--batch-size", "4", "--baseline"]))
    assert out["tokens"] == 1024 and out["ppl"] < 0.7 * out["unigram"]["ppl"]
    with pytest.raises(ValueError, match="--context"):
        run_eval_ppl(parser.parse_args(["--ckpt", str(BASE_MODEL), "--context", "0"]))
