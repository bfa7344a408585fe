"""ARMT fine-tuning on the real model (SmolLM2-135M-Instruct): chat haystacks, memory-only gradients with
a bf16 frozen base and fp32 memory, rematerialised cells, the `--quick` run lowering the loss on its fixed
batch and resuming exactly, and its memory-only checkpoint."""

from __future__ import annotations

import argparse
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.armt import ARMTModel
from jaxlongctx.commands.train_armt import add_train_armt_arguments, prepare_train_armt, run_train_armt
from jaxlongctx.data.haystack import CODE_DIGITS, chat_frame
from jaxlongctx.pretrained import smollm2_gguf
from jaxlongctx.train.trainer import latest_checkpoint

QUICK = ["--base", "smollm2", "--quick", "--freeze-base", "--chat", "--remat", "--base-dtype", "bf16"]
QUICK += ["--d-mem", "64", "--lr", "1e-4", "--no-progress"]


def _args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_armt_arguments(parser)
    return parser.parse_args(list(words))


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # SmolLM2 steps: the toy-model curriculum run (test_train) is the fast path
def test_quick_memory_only_smollm2_finetune_lowers_the_loss_and_resumes_exactly(tmp_path):
    run = prepare_train_armt(_args(*QUICK, "--out", str(tmp_path / "run")))
    trainer, armt = run.trainer, run.armt
    assert armt.armt.segment_size == 64 and armt.armt.d_mem == 64 and armt.remat
    # memory-only: the trained params are the memory's (fp32), the frozen base is bf16 and gets no
    # optimizer state (AdamW keeps two fp32 moments per trained number)
    assert sorted(trainer.params) == ["bb", "memory", "wb", "wk", "wq", "wv"]
    assert {x.dtype for x in jax.tree.leaves(trainer.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(trainer.frozen)} == {jnp.dtype(jnp.bfloat16)}
    trained = sum(x.size for x in jax.tree.leaves(trainer.params))
    moments = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim]
    assert sum(x.size for x in moments) == 2 * trained and {x.dtype for x in moments} == {
        jnp.dtype(jnp.float32)
    }

    # the batch: one chat haystack of 2 segments, answer digits after the assistant's turn opens
    batch = trainer.batch_fn(0)
    tok = armt.tokenizer
    assert batch["seg_ids"].shape == (2, 1, 64) and batch["ids"].shape == (1, 128)
    frame = chat_frame(tok)
    ids, pos = batch["ids"][0], batch["answer_pos"][0]
    np.testing.assert_array_equal(ids[: frame.head.size], frame.head)
    prompt = tok.decode(ids[: pos[0] + 1], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\nThe code of the " + prompt.split("The code of the ")[-1])
    assert "<|im_end|>" not in prompt.split("<|im_start|>user\n")[1].split("\nWhat is the code")[0]
    digits = tok.decode(batch["answer_ids"][0])
    assert len(digits) == CODE_DIGITS and digits.isdigit() and digits in prompt  # the fact is in the text
    np.testing.assert_array_equal(trainer.batch_fn(1)["ids"], batch["ids"])  # --quick: one fixed batch

    history = trainer.run()  # 2 steps, a checkpoint after each
    assert history["loss"][1] < history["loss"][0]  # the loss on the fixed batch after one update
    final = _leaves((trainer.params, trainer.opt_state))
    trainer.restore(tmp_path / "run/checkpoints/step_00000001")
    assert trainer.step == 1
    trainer.run()
    for x, y in zip(_leaves((trainer.params, trainer.opt_state)), final):
        np.testing.assert_array_equal(x, y)  # resumed from the disk state: bit for bit
    assert trainer.history["loss"] == history["loss"]
    assert latest_checkpoint(tmp_path / "run").name == "step_00000002"


@pytest.mark.slow
def test_quick_cli_run_saves_a_memory_only_checkpoint_and_a_cut_run_resumes_to_the_same_result(tmp_path):
    summary = run_train_armt(_args(*QUICK, "--out", str(tmp_path / "run"), "--save", str(tmp_path / "armt")))
    loss = summary["fixed_batch_loss"]
    assert loss["after"] < loss["before"] and summary["base_reference"]["kind"] == "package_resource"
    saved = json.loads((tmp_path / "armt/config.json").read_text())
    assert saved["base"] == summary["base_reference"] and not (tmp_path / "armt/params").exists()
    record = json.loads((tmp_path / "armt/training.json").read_text())
    assert (
        record["runs"][0]["command"].startswith("jaxlongctx train-armt --")
        and "smollm2" in record["runs"][0]["command"]
    )
    armt = jaxlongctx.load(tmp_path / "armt", "bf16")
    assert isinstance(armt, ARMTModel) and armt.tokenizer is not None
    assert armt.base_reference.locate() == smollm2_gguf()

    # the same run, cut after step 1: a new trainer resumes it from disk to the same result
    shutil.copytree(tmp_path / "run", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut/checkpoints/step_00000002")
    again = run_train_armt(_args(*QUICK, "--out", str(tmp_path / "cut")))
    assert (
        again["resumed"]
        and again["fixed_batch_loss"] == loss
        and again["final_loss"] == summary["final_loss"]
    )


def test_base_lr_scale_scales_the_base_updates_only_and_needs_a_trained_base(tmp_path):
    import optax

    from jaxlongctx.train.armt_finetune import scale_base_updates

    tx = optax.chain(optax.sgd(1.0), scale_base_updates(0.1))
    params = ({"w": jnp.ones(3)}, {"m": jnp.ones(2)})
    grads = ({"w": jnp.full(3, 2.0)}, {"m": jnp.full(2, 2.0)})
    (base, memory), _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(base["w"], -0.2, rtol=1e-6)
    np.testing.assert_allclose(memory["m"], -2.0, rtol=1e-6)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            scale_base_updates(bad)
    with pytest.raises(ValueError, match="--freeze-base"):
        prepare_train_armt(_args(*QUICK, "--base-lr-scale", "0.1", "--out", str(tmp_path / "run")))
    with pytest.raises(ValueError, match="noun"):  # refused before a model loads
        prepare_train_armt(_args(*QUICK, "--noun", "code 7", "--out", str(tmp_path / "run")))
