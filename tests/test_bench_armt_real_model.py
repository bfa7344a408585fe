"""bench/armt_real_model.py and its scorer (`jaxlongctx.train.chat_accuracy`), on a tiny random Llama with
SmolLM2's tokenizer and chat template: the cut to the native context, teacher forcing against greedy
decoding, the diagonal and sequential schedules, the training-checkpoint loader, the JSON and plot."""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bench.common
import jaxlongctx
from bench import armt_real_model
from convert.gguf_llama import metadata, open_gguf
from convert.gguf_tokenizer import tokenizer_files
from jaxlongctx.armt import ARMTModel
from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.cpu_execution import CPUExecution
from jaxlongctx.cache_choice import ARMTMemory
from jaxlongctx.checkpoint import save_model
from jaxlongctx.commands.export_armt import export_armt
from jaxlongctx.commands.train_armt import add_train_armt_arguments, prepare_train_armt, run_train_armt
from jaxlongctx.config import ModelConfig
from jaxlongctx.data.chat_retrieval import retrieval_set
from jaxlongctx.data.haystack import CODE_DIGITS, chat_frame
from jaxlongctx.model.model import Model
from jaxlongctx.pretrained import smollm2_gguf
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.train.armt_training_checkpoint import load_training_checkpoint
from jaxlongctx.train.chat_accuracy import (
    answer_logits,
    argmax_digits,
    armt_chat_accuracy,
    armt_digit_logits,
    chat_cut,
    exact_match,
    fit_context,
    full_attention_digit_logits,
    teacher_forced,
)

NATIVE = 320  # the tiny model's context: items longer than this are cut for full attention
SEGMENT = 64


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random Llama (SmolLM2's vocabulary, 2 layers, NATIVE-token context) saved with SmolLM2's
    tokenizer files (chat template included)."""
    config = ModelConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=NATIVE,
        tie_word_embeddings=True,
    )
    path = save_model(Model.init(config, seed=1).module, tmp_path_factory.mktemp("tiny") / "base")
    for name, content in tokenizer_files(metadata(open_gguf(smollm2_gguf())), "smollm2").items():
        (path / name).write_bytes(content)
    return path


@pytest.fixture(scope="module")
def armt(base_dir):
    """An ARMT memory (random, non-zero) on the tiny base, segments of SEGMENT tokens."""
    model = ARMTModel.wrap(jaxlongctx.load(base_dir, "fp32"), ARMTConfig(SEGMENT, 4, 8), jax.random.key(0))
    return model.randomize_memory_params(jax.random.key(1), scale=3.0)


def _greedy(model, item, **options) -> np.ndarray:
    """The first CODE_DIGITS tokens greedy decoding writes after prompt + answer prefix."""
    ids = np.concatenate([item.prompt, item.answer_prefix])[None]
    out = jaxlongctx.generate(model, ids, SamplingParams(CODE_DIGITS, stop_ids=()), **options)
    return out[0, ids.shape[1] :]


def test_fit_context_keeps_the_head_and_the_question_and_fits_the_native_context(armt):
    tok = armt.tokenizer
    cut, head = chat_cut(tok), chat_frame(tok).head
    assert cut.head == head.size
    named = chat_cut(tok, "secret number")  # a longer question: more of the end is kept
    assert named.head == cut.head and named.end > cut.end
    for item in retrieval_set(tok, 2, 3 * NATIVE, num_facts=1):
        fitted = fit_context(item, cut, NATIVE)
        total = fitted.prompt.size + fitted.answer_prefix.size + CODE_DIGITS
        assert NATIVE - 1 <= total <= NATIVE
        np.testing.assert_array_equal(fitted.prompt[: head.size], head)
        kept = fitted.prompt.size - head.size  # the rest is the prompt's end
        np.testing.assert_array_equal(fitted.prompt[head.size :], item.prompt[-kept:])
        end = tok.decode(fitted.prompt[-cut.end :].tolist(), skip_special_tokens=False)
        assert "What is the code of the" in end and end.endswith("<|im_start|>assistant\n")
        np.testing.assert_array_equal(fitted.answer_prefix, item.answer_prefix)
        np.testing.assert_array_equal(fitted.answer_ids, item.answer_ids)
    short = retrieval_set(tok, 1, NATIVE, num_facts=1)[0]
    assert fit_context(short, cut, NATIVE) is short
    with pytest.raises(ValueError, match="cannot hold the chat frame"):
        fit_context(short, cut, cut.head + 10)


@pytest.mark.slow  # the shipped ARMT case in tests/test_train.py is the fast path
def test_teacher_forced_exact_match_is_greedy_decodings(armt):
    """For full attention (cut items) and ARMT: scored against greedy's own digits every
    item is an exact match, and against the codes the score is greedy's."""
    items = retrieval_set(armt.tokenizer, 2, 2 * NATIVE, num_facts=1)
    fitted = [fit_context(item, chat_cut(armt.tokenizer), NATIVE) for item in items]
    runs = [(full_attention_digit_logits(armt.base), armt.base, fitted, {})]
    runs.append((armt_digit_logits(armt, "diagonal", 2), armt, items, {"cache": ARMTMemory("diagonal")}))
    for digit_logits, model, scored, options in runs:
        greedy = np.stack([_greedy(model, item, **options) for item in scored])
        own = [dataclasses.replace(item, answer_ids=g) for item, g in zip(scored, greedy)]
        np.testing.assert_array_equal(argmax_digits(answer_logits(digit_logits, own, progress=False)), greedy)
        score = exact_match(argmax_digits(answer_logits(digit_logits, scored, progress=False)), scored)
        assert score["correct"] == sum((g == item.answer_ids).all() for g, item in zip(greedy, scored))


def test_diagonal_pipeline_and_sequential_give_the_same_answers_as_decoding(armt):
    items = retrieval_set(armt.tokenizer, 2, 8 * SEGMENT + 40, num_facts=1)
    seq = answer_logits(armt_digit_logits(armt, "sequential", 3), items, progress=False)
    saved, armt.cpu_execution = armt.cpu_execution, CPUExecution(batched_rows=10**6, min_segments_per_layer=0)
    try:
        pipe = answer_logits(armt_digit_logits(armt, "diagonal", 1 << 30), items, progress=False)
    finally:
        armt.cpu_execution = saved
    np.testing.assert_array_equal(argmax_digits(pipe), argmax_digits(seq))
    np.testing.assert_allclose(pipe, seq, atol=1e-4)
    ids, n = teacher_forced(items[0])  # chunked prompt segments = generation_logits's whole-prompt pass
    reference = armt.generation_logits(ids[None], n, "sequential")[0, n - 1 : n - 1 + CODE_DIGITS]
    np.testing.assert_allclose(seq[0], np.asarray(reference), atol=1e-5)


def test_training_checkpoint_loads_the_trained_memory(base_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_armt_arguments(parser)
    words = ["--base", str(base_dir), "--out", str(tmp_path / "run"), "--quick", "--freeze-base", "--chat"]
    words += ["--mem-tokens", "4", "--d-mem", "8", "--base-dtype", "fp32", "--no-progress"]
    trainer = prepare_train_armt(parser.parse_args(words)).trainer
    keys = iter(jax.random.split(jax.random.key(2), len(trainer.params)))
    trainer.params = {
        k: v + jax.random.normal(next(keys), v.shape, v.dtype) for k, v in trainer.params.items()
    }
    step_dir = trainer.save_checkpoint()
    armt, info = armt_real_model.load_armt(step_dir, "bf16")
    assert info["kind"] == "training checkpoint" and info["step"] == 0
    assert armt.dtype == np.dtype("bfloat16") and armt.armt.segment_size == SEGMENT
    for name, value in trainer.params.items():  # float32, as trained
        np.testing.assert_array_equal(np.asarray(getattr(armt.memory, name)[...]), np.asarray(value))
    record = json.loads((step_dir / "trainer.json").read_text())
    (step_dir / "trainer.json").write_text(json.dumps({**record, "hyperparams": {}}))
    with pytest.raises(ValueError, match="hyperparams lack"):
        load_training_checkpoint(step_dir)


def test_training_checkpoint_of_a_run_that_trained_the_base_loads_base_and_memory(base_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_armt_arguments(parser)
    words = ["--base", str(base_dir), "--out", str(tmp_path / "run"), "--quick", "--chat"]
    words += ["--mem-tokens", "4", "--d-mem", "8", "--base-dtype", "fp32", "--no-progress"]
    trainer = prepare_train_armt(parser.parse_args(words)).trainer
    leaves, tree = jax.tree.flatten(trainer.params)  # (base, memory), as trained
    keys = jax.random.split(jax.random.key(3), len(leaves))
    trainer.params = jax.tree.unflatten(
        tree, [x + 0.01 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )
    armt = load_training_checkpoint(trainer.save_checkpoint(), "fp32")
    base, memory = trainer.params
    loaded_base = nnx.to_pure_dict(armt.params[0])
    for got, want in zip(jax.tree.leaves(loaded_base), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for name, value in memory.items():
        np.testing.assert_array_equal(np.asarray(getattr(armt.memory, name)[...]), np.asarray(value))

    # the checkpoint exports to a memory checkpoint naming the untouched base (every change kept whole)
    step_dir = tmp_path / "run/checkpoints/step_00000000"
    export = export_armt(step_dir, base_dir, tmp_path / "memory", rank=10**6, dtype=jnp.float32)
    assert {row["kind"] for row in export["tensors"]} == {"whole"}
    exported = jaxlongctx.load(tmp_path / "memory")
    for got, want in zip(jax.tree.leaves(exported.params), jax.tree.leaves(armt.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    (run,) = json.loads((tmp_path / "memory/training.json").read_text())["runs"]
    assert run["training_checkpoint"] == str(step_dir) and run["step"] == 0


@pytest.mark.slow
def test_chat_train_run_scores_chat_items_and_its_last_checkpoint_holds_the_saved_memory(base_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_armt_arguments(parser)
    words = ["--base", str(base_dir), "--out", str(tmp_path / "run"), "--save", str(tmp_path / "model")]
    words += ["--quick", "--freeze-base", "--chat", "--mem-tokens", "4", "--d-mem", "8", "--lr", "1e-2"]
    words += ["--base-dtype", "fp32", "--eval-lengths", "256", "--eval-samples", "2", "--no-progress"]
    summary = run_train_armt(parser.parse_args([*words, "--noun", "secret number"]))
    (row,) = summary["accuracy"]  # held-out chat items, scored as the bench scores them
    assert row["length"] == 256 and row["n"] == 2 and row["accuracy"] == row["correct"] / 2
    assert summary["noun"] == row["noun"] == "secret number"
    saved = jaxlongctx.load(tmp_path / "model")
    step_dir = tmp_path / "run/checkpoints/step_00000002"
    armt, info = armt_real_model.load_armt(step_dir, "bf16")
    assert info["kind"] == "training checkpoint" and info["step"] == info["total_steps"] == 2
    assert armt_real_model.trained_noun(info) == "secret number"  # the bench asks as training asked
    saved_info = armt_real_model.load_armt(tmp_path / "model", "bf16")[1]
    assert armt_real_model.trained_noun(saved_info) == "secret number"
    assert armt_real_model.trained_noun({"kind": "saved model"}) == "code"
    export_armt(step_dir, base_dir, tmp_path / "exported", 2, jnp.float32)  # a training checkpoint record
    exported_info = armt_real_model.load_armt(tmp_path / "exported", "bf16")[1]
    assert armt_real_model.trained_noun(exported_info) == "secret number"
    assert not (tmp_path / "exported/base_adapter").exists()  # the frozen base: nothing to adapt
    assert armt.dtype == np.dtype("bfloat16") and armt.armt.segment_size == saved.armt.segment_size
    for name in ("memory", "wq", "wk", "wv", "wb", "bb"):  # float32, as trained and saved
        trained = np.asarray(getattr(armt.memory, name)[...])
        assert trained.dtype == np.float32 and np.abs(trained).max() > 0
        np.testing.assert_array_equal(trained, np.asarray(getattr(saved.memory, name)[...]))


def test_bench_writes_json_and_plot_and_quick_writes_only_quick_files(armt, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.common, "_QUICK", False)
    result = armt_real_model.run(armt, [256, 2 * NATIVE], 2, [256], 1, chunk_segments=4)
    info = {"path": "tiny", "kind": "saved model"}
    armt_real_model.write_results({**result, "model": info, "base_dtype": "fp32", "quick": False})
    written = json.loads((tmp_path / "armt_real_model.json").read_text())
    for name in ("full_attention", "armt_diagonal"):
        rows = written["results"][name]
        assert [r["length"] for r in rows] == [256, 2 * NATIVE]
        for r in rows:
            assert r["n"] == 2 and 0 <= r["correct"] <= 2 and r["accuracy"] == r["correct"] / 2
            assert r["interval"][0] <= r["accuracy"] <= r["interval"][1] and r["seconds"] > 0
    assert [r["tokens_seen"] <= NATIVE for r in written["results"]["full_attention"]] == [True, True]
    for r in written["results"]["armt_diagonal"]:  # per item: where the fact lies against the window
        assert [i["correct"] for i in r["items"]].count(True) == r["correct"] and len(r["items"]) == 2
        behind = [i for i in r["items"] if not i["fact_in_window"]]
        assert r["memory_only"]["n"] == len(behind)
        assert r["memory_only"].get("correct", 0) == sum(i["correct"] for i in behind)
        for i in r["items"]:
            assert i["fact_in_window"] == (i["code_position"] >= i["window_start"])
    long_row = written["results"]["armt_diagonal"][1]  # 640 tokens, segments of 64: mostly behind
    assert long_row["memory_only"]["n"] >= 1
    (check,) = written["sequential_check"]
    assert check["length"] == 256 and check["answers_equal"] and check["pipeline_answers_equal"]
    assert written["model"] == info and written["chance"]["exact_match"] == pytest.approx(1e-4)
    assert (tmp_path / "armt_real_model.png").stat().st_size > 0
    chat = armt_chat_accuracy(armt, 256, 2)  # train-armt --chat --eval-lengths: the same items and score
    assert {k: chat[k] for k in ("correct", "n", "digit_accuracy")} == {
        k: written["results"]["armt_diagonal"][0][k] for k in ("correct", "n", "digit_accuracy")
    }

    for f in tmp_path.iterdir():
        f.unlink()
    monkeypatch.setattr(bench.common, "_QUICK", True)
    armt_real_model.write_results({**result, "model": info, "base_dtype": "fp32", "quick": True})
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "armt_real_model_quick.json",
        "armt_real_model_quick.png",
    ]
    for f in tmp_path.iterdir():
        f.unlink()
    monkeypatch.setattr(bench.common, "_QUICK", False)  # --name: another checkpoint's files beside these
    armt_real_model.write_results({**result, "model": info, "base_dtype": "fp32", "quick": False}, "run3")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["run3.json", "run3.png"]


def test_memory_probe_splits_items_by_where_their_fact_lies_and_writes_quick_files(
    armt, tmp_path, monkeypatch
):
    from bench import armt_memory_probe

    hits = [[True] * CODE_DIGITS, [True, False, True, True]]
    scored = armt_memory_probe.score(hits)
    assert (scored["n"], scored["exact"], scored["digit_accuracy"]) == (2, 1, 0.875)
    assert scored["per_digit"] == [1.0, 0.5, 1.0, 1.0] and armt_memory_probe.score([]) == {"n": 0}

    row = armt_memory_probe.probe_length(armt, 4 * SEGMENT, 3)
    memory, window = row["memory_only"], row["fact_in_answer_segment"]
    assert memory["n"] + window["n"] == 3 and memory["n"] >= 1  # facts sit before the first boundary
    for part in (memory, window):
        if part["n"]:
            assert 0 <= part["exact"] <= part["n"] and len(part["per_digit"]) == CODE_DIGITS
            assert part["digit_accuracy"] == pytest.approx(np.mean(part["per_digit"]), abs=1e-3)

    armt.save(tmp_path / "model")
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(bench.common, "_QUICK", False)  # restored after main() sets it
    armt_memory_probe.main(["--model", str(tmp_path / "model"), "--quick"])
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "armt_memory_probe_quick.json",
        "armt_memory_probe_quick.png",
    ]
    written = json.loads((tmp_path / "results/armt_memory_probe_quick.json").read_text())
    assert written["quick"] and [r["tokens"] for r in written["models"][0]["rows"]] == [512]
