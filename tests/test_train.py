"""Training: data determinism, optimizer schedule, quick LM training with exact resume, eval hooks,
ARMT fine-tuning plumbing, and the shipped base model's HF export parity."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlongctx.armt.sentences import SentenceSegmenter
from jaxlongctx.commands.train_armt import add_train_armt_arguments, parse_fact_range, run_train_armt
from jaxlongctx.commands.train_lm import add_train_lm_arguments, run_train_lm
from jaxlongctx.data.haystack import CODE_DIGITS, code_split_by_boundary, held_out_batch
from jaxlongctx.data.tokenizer import BOS_ID, encode_corpus, load_default_tokenizer
from jaxlongctx.demo import ARMT_MODEL, BASE_MODEL
from jaxlongctx.model.llama import forward
from jaxlongctx.model.model import Model
from jaxlongctx.train.armt_finetune import (
    Stage,
    answer_logits,
    haystack_batch,
    parse_curriculum,
    retrieval_loss,
    stage_per_step,
)
from jaxlongctx.train.data import TokenWindows, eval_windows
from jaxlongctx.train.evaluate import forward_with_kv_transform, unigram_baseline
from jaxlongctx.train.lm import QUICK_CONFIG
from jaxlongctx.train.optim import OptimConfig, learning_rate


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
    return run_train_lm(
        parser.parse_args(
            [
                "--quick",
                "--out",
                str(out),
                "--steps",
                "6",
                "--batch-size",
                "2",
                "--context",
                "32",
                "--ckpt-every",
                "3",
                "--no-progress",
                *extra,
            ]
        )
    )


def test_quick_training_lowers_loss_and_resumes_exactly(tmp_path):
    full = _train_lm(tmp_path / "full")
    history = json.loads((tmp_path / "full/checkpoints/step_00000006/trainer.json").read_text())["history"]
    assert np.mean(history["loss"][-3:]) < history["loss"][0]
    assert (tmp_path / "full/loss_curve.png").stat().st_size > 0
    assert math.isfinite(full["validation"]["ppl"])
    # "Interrupt" after step 3: a fresh run directory holding only the step-3 checkpoint resumes there.
    shutil.copytree(
        tmp_path / "full/checkpoints/step_00000003", tmp_path / "resumed/checkpoints/step_00000003"
    )
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
    stages = parse_curriculum("64:2:8, 256:3:2")
    assert stages == [Stage(64, 2, 8), Stage(256, 3, 2)]
    assert [st.tokens for st in stage_per_step(stages)] == [64, 64, 256, 256, 256]
    for bad in ("64:2", "64:0:4", "a:1:1"):
        with pytest.raises(ValueError, match="stage"):
            parse_curriculum(bad)
    batch = haystack_batch(0, 8, 256, load_default_tokenizer(), 128, num_facts=4)
    lengths = batch["lengths"]
    assert batch["seg_ids"].shape == (2, 8, 128) and batch["answer_ids"].shape == (8, CODE_DIGITS)
    assert ((lengths > 128) & (lengths <= 256)).all() and len(set(lengths.tolist())) > 1  # random ends
    flat = batch["seg_ids"].transpose(1, 0, 2).reshape(8, -1)
    np.testing.assert_array_equal(flat, batch["ids"])
    for row, n in enumerate(lengths):
        np.testing.assert_array_equal(flat[row, n - (CODE_DIGITS - 1) : n], batch["answer_ids"][row, :-1])
        assert (flat[row, n:] == 0).all()
    logits = jnp.asarray(np.arange(2 * 8 * 128, dtype=np.float32).reshape(2, 8, 128, 1))  # nS B S V=1
    np.testing.assert_array_equal(
        batch["answer_pos"], lengths[:, None] - CODE_DIGITS + np.arange(CODE_DIGITS)
    )
    assert (batch["answer_mask"] == 1).all()
    picked = np.asarray(
        answer_logits(logits, jnp.asarray(batch["answer_pos"]))[..., 0]
    )  # B 4: positions n-4..n-1
    flat_logits = np.asarray(logits)[..., 0].transpose(1, 0, 2).reshape(8, -1)
    for row, n in enumerate(lengths):
        np.testing.assert_array_equal(picked[row], flat_logits[row, n - CODE_DIGITS : n])

    boundary = haystack_batch(0, 4, 512, load_default_tokenizer(), 128, num_facts=1, boundary_fraction=1.0)
    assert (boundary["lengths"] == 384 + CODE_DIGITS - 1).all()  # prompt of 3 whole segments, then the answer
    assert (boundary["seg_n"][:, 0] == [128, 128, 128, CODE_DIGITS - 1]).all()
    one_segment = haystack_batch(0, 4, 128, load_default_tokenizer(), 128, num_facts=1, boundary_fraction=1.0)
    assert (one_segment["lengths"] > 64).all()  # no whole-segment prompt fits: ends stay random
    with pytest.raises(ValueError, match="boundary_fraction"):
        haystack_batch(0, 1, 256, load_default_tokenizer(), 128, num_facts=1, boundary_fraction=1.5)
    far = haystack_batch(0, 8, 1024, load_default_tokenizer(), 128, num_facts=1, far_fraction=1.0)
    for ids, answer, n in zip(far["ids"], far["answer_ids"], far["lengths"]):  # the fact's code comes early
        windows = np.lib.stride_tricks.sliding_window_view(ids[:n], CODE_DIGITS)
        assert np.flatnonzero((windows == answer).all(axis=1))[0] < n / 4
    with pytest.raises(ValueError, match="far_fraction"):
        haystack_batch(0, 1, 256, load_default_tokenizer(), 128, num_facts=1, far_fraction=-0.1)
    near = haystack_batch(0, 16, 1024, load_default_tokenizer(), 128, num_facts=1, near_fraction=1.0)
    starts = []
    for ids, answer, n in zip(near["ids"], near["answer_ids"], near["lengths"]):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:n], CODE_DIGITS)
        starts.append(np.flatnonzero((windows == answer).all(axis=1))[0])
    # the code just before the first boundary (facts sit at sentence ends, so a few land past it)
    assert np.mean(np.array(starts) < 128) >= 0.75 and np.median(starts) > 128 * 0.6
    with pytest.raises(ValueError, match="near_fraction"):
        haystack_batch(0, 1, 256, load_default_tokenizer(), 128, num_facts=1, near_fraction=2.0)
    tok = load_default_tokenizer()
    named = haystack_batch(0, 4, 1024, tok, 128, num_facts=1, noun="secret number")
    plain = haystack_batch(0, 4, 1024, tok, 128, num_facts=1)
    np.testing.assert_array_equal(named["answer_ids"], plain["answer_ids"])  # same facts, renamed
    for ids, n in zip(named["ids"], named["lengths"]):
        text = tok.decode(ids[:n].tolist())
        assert "secret number of the" in text and "code of the" not in text
    with pytest.raises(ValueError, match="noun"):
        haystack_batch(0, 1, 256, tok, 128, num_facts=1, noun="secret  number")
    train = encode_corpus("train")  # training filler is train-split text unless told otherwise
    val = haystack_batch(
        0, 2, 1024, load_default_tokenizer(), 128, num_facts=1, far_fraction=1.0, filler_split="validation"
    )
    for split, filler in (("train", far), ("validation", val)):
        span = filler["ids"][0, 512:544]  # filler: the fact lies in the first fifth, the question at the end
        windows = np.lib.stride_tricks.sliding_window_view(encode_corpus(split), span.size)
        assert (windows == span).all(axis=1).any()
        assert (
            split == "train"
            or not (np.lib.stride_tricks.sliding_window_view(train, span.size) == span).all(axis=1).any()
        )

    tok = load_default_tokenizer()  # a fact range: each sample draws its own count of facts
    mixed = haystack_batch(0, 24, 512, tok, 128, num_facts=(1, 4))
    prefix = np.asarray(tok.encode(" The code of the", add_special_tokens=False).ids)
    counts = {
        int((np.lib.stride_tricks.sliding_window_view(ids[:n], prefix.size) == prefix).all(axis=1).sum()) - 1
        for ids, n in zip(mixed["ids"], mixed["lengths"])
    }  # minus the question's own phrase
    assert counts == {1, 2, 3, 4}
    assert parse_fact_range("3") == (3, 3) and parse_fact_range("1-4") == (1, 4)
    for bad in ("0", "4-2", "x", "1-2-3"):
        with pytest.raises(ValueError, match="num-facts"):
            parse_fact_range(bad)
    with pytest.raises(ValueError, match="num_facts"):
        haystack_batch(0, 1, 256, tok, 128, num_facts=(2, 1))

    near = haystack_batch(0, 16, 512, tok, 128, num_facts=(2, 4), shared_word_fraction=0.5)
    kinds = set()
    for ids, n in zip(near["ids"], near["lengths"]):
        text = tok.decode(ids[:n].tolist())
        asked = re.findall(r"What is the code of the (\w+ \w+)\?", text)[0].split()
        others = [
            s.split() for s, _ in _code_pairs(text[: text.index("\nWhat is the code")]) if s.split() != asked
        ]
        kinds.add(all(asked[0] in o or asked[1] in o for o in others))
    assert kinds == {True, False}  # near misses and samples with random subjects both occur
    with pytest.raises(ValueError, match="shared_word_fraction"):
        haystack_batch(0, 1, 256, tok, 128, num_facts=1, shared_word_fraction=2.0)

    def code_splits(batch):  # samples whose asked code starts within 2 tokens of a segment boundary
        count = 0
        for ids, answer, n in zip(batch["ids"], batch["answer_ids"], batch["lengths"]):
            windows = np.lib.stride_tricks.sliding_window_view(ids[: n - CODE_DIGITS], CODE_DIGITS)
            start = (
                np.flatnonzero((windows == answer).all(axis=1))[0] % 128
            )  # the asked fact's code in the prompt
            count += (
                start > 128 - CODE_DIGITS or start < 3
            )  # the boundary after the subject, before the last digit
        return count

    assert code_splits(haystack_batch(0, 12, 1024, tok, 128, num_facts=(1, 3), split_fraction=1.0)) >= 10
    assert code_splits(haystack_batch(0, 12, 1024, tok, 128, num_facts=(1, 3))) <= 3
    with pytest.raises(ValueError, match="split_fraction"):
        haystack_batch(0, 1, 256, tok, 128, num_facts=1, split_fraction=-1.0)

    short = haystack_batch(0, 2, 64, load_default_tokenizer(), 128, num_facts=1)  # one padded segment
    assert short["seg_ids"].shape == (1, 2, 128) and short["ids"].shape == (2, 64)
    n = short["lengths"]
    assert (short["seg_n"][0] == n).all() and ((n > 32) & (n <= 64)).all()
    logits = jax.random.normal(jax.random.key(0), (1, 2, 128, 4096))
    answer, lm = [], []
    for row in range(2):
        x = logits[0, row]  # S V
        answer.append(
            optax.softmax_cross_entropy_with_integer_labels(x[n[row] - 4 : n[row]], short["answer_ids"][row])
        )
        lm.append(
            optax.softmax_cross_entropy_with_integer_labels(x[: n[row] - 1], short["ids"][row, 1 : n[row]])
        )
    answer, lm = jnp.concatenate(answer).mean(), jnp.concatenate(lm).mean()
    np.testing.assert_allclose(retrieval_loss(logits, short, 0.0), answer, rtol=1e-6)
    np.testing.assert_allclose(retrieval_loss(logits, short, 0.5), answer + 0.5 * lm, rtol=1e-6)


def _code_pairs(text: str) -> list[tuple[str, str]]:
    return re.findall(r"The code of the (\w+ \w+) is (\d{4})", text)


def test_follow_up_questions_ask_every_other_fact_and_supervise_each_answer():
    tok = load_default_tokenizer()
    batch = haystack_batch(3, 12, 512, tok, 128, num_facts=(1, 4), boundary_fraction=0.5, follow_ups=True)
    assert batch["answer_ids"].shape == batch["answer_pos"].shape == (12, 4 * CODE_DIGITS)
    assert (batch["lengths"] <= 512).all()
    asked_counts = set()
    for ids, n, digits, pos, mask in zip(
        batch["ids"], batch["lengths"], batch["answer_ids"], batch["answer_pos"], batch["answer_mask"]
    ):
        real = mask.astype(bool)
        asked = int(real.sum()) // CODE_DIGITS
        assert (real == (np.arange(real.size) < asked * CODE_DIGITS)).all()  # real digits first, then padding
        full = np.append(ids[:n], digits[real][-1])  # the row's inputs + its last target
        np.testing.assert_array_equal(full[pos[real] + 1], digits[real])  # each logit predicts the next digit
        assert pos[real][-1] == n - 1
        text = tok.decode(full.tolist())
        questions = re.findall(r"What is the code of the (\w+ \w+)\?", text)
        stated = _code_pairs(text[: text.index("\nWhat is the code")])  # the facts in the prompt
        assert len(questions) == asked == len(stated) and sorted(questions) == sorted(s for s, _ in stated)
        answers = dict(stated)
        answered = _code_pairs(
            text[text.index("\nWhat is the code") :]
        )  # each question's "... is DDDD" answer
        assert [(s, answers[s]) for s in questions] == answered
        asked_counts.add(asked)
    assert asked_counts == {1, 2, 3, 4}

    tight = haystack_batch(0, 8, 160, tok, 128, num_facts=4, follow_ups=True)  # room for fewer follow-ups
    counts = tight["answer_mask"].sum(axis=1) / CODE_DIGITS
    assert (tight["lengths"] <= 160).all() and (counts >= 1).all() and (counts < 4).all()
    logits = jax.random.normal(jax.random.key(1), (2, 8, 128, 4096))
    flat = np.asarray(logits).transpose(1, 0, 2, 3).reshape(8, 256, 4096)
    expected = [
        optax.softmax_cross_entropy_with_integer_labels(flat[b, p], d)
        for b in range(8)
        for p, d, m in zip(tight["answer_pos"][b], tight["answer_ids"][b], tight["answer_mask"][b])
        if m
    ]
    np.testing.assert_allclose(retrieval_loss(logits, tight, 0.0), np.mean(expected), rtol=1e-5)


@pytest.mark.skipif(not BASE_MODEL.is_dir(), reason="base model asset not built yet")
def test_train_armt_runs_its_curriculum_and_saves_a_loadable_model(tmp_path):
    from jaxlongctx.loading import load

    parser = argparse.ArgumentParser()
    add_train_armt_arguments(parser)
    args = [
        "--base",
        str(BASE_MODEL),
        "--out",
        str(tmp_path / "run"),
        "--save",
        str(tmp_path / "armt"),
        "--curriculum",
        "64:2:2,256:2:2",
        "--ckpt-every",
        "2",
        "--eval-lengths",
        "256",
        "--eval-samples",
        "2",
        "--num-facts",
        "1-2",
        "--no-progress",
    ]
    summary = run_train_armt(parser.parse_args(args))
    assert summary["steps"] == 4 and [st["tokens"] for st in summary["curriculum"]] == [64, 256]
    assert (
        summary["num_facts"] == [1, 2]
        and summary["filler_split"] == "train"
        and summary["segmentation"] == "fixed"
    )
    assert np.isfinite(summary["final_loss"]) and summary["accuracy"][0]["samples"] == 2
    history = json.loads((tmp_path / "run/checkpoints/step_00000004/trainer.json").read_text())["history"]
    assert len(history["loss"]) == 4
    armt = load(tmp_path / "armt")
    assert armt.armt.segment_size == 128 and armt.tokenizer is not None
    out = armt(np.full((1, 200), 5, np.int32))
    assert out.shape == (1, 200, 4096) and np.isfinite(np.asarray(out)).all()

    again = [
        "--init",
        str(tmp_path / "armt"),
        "--out",
        str(tmp_path / "run2"),
        "--save",
        str(tmp_path / "armt2"),
        "--curriculum",
        "256:1:2",
        "--no-progress",
    ]
    with pytest.raises(ValueError, match="--segment-size only apply with --base"):
        run_train_armt(parser.parse_args(again + ["--segment-size", "64"]))
    summary = run_train_armt(
        parser.parse_args(
            again
            + [
                "--follow-ups",
                "--num-facts",
                "3",
                "--shared-word-fraction",
                "0.5",
                "--filler-split",
                "validation",
                "--segmentation",
                "sentences",
            ]
        )
    )
    assert summary["init"] == str(tmp_path / "armt") and summary["armt_config"]["segment_size"] == 128
    assert (
        summary["follow_ups"]
        and summary["shared_word_fraction"] == 0.5
        and np.isfinite(summary["final_loss"])
    )
    assert summary["filler_split"] == "validation" and summary["segmentation"] == "sentences"
    further = load(tmp_path / "armt2")
    assert (
        further.armt == armt.armt and float(jnp.abs(further(np.full((1, 200), 5, np.int32)) - out).max()) > 0
    )
    with pytest.raises(SystemExit):  # --base and --init exclude each other
        parser.parse_args(["--base", "a", "--init", "b", "--out", "c"])


@pytest.mark.skipif(not BASE_MODEL.is_dir(), reason="base model asset not built yet")
def test_shipped_base_model_exports_to_transformers(tmp_path):
    import torch
    import transformers
    from hf_oracle import hf_logits

    from convert.hf_llama import export_ckpt_to_hf
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
    from jaxlongctx.commands.eval_ppl import add_eval_ppl_arguments, run_eval_ppl

    parser = argparse.ArgumentParser()
    add_eval_ppl_arguments(parser)
    out = run_eval_ppl(
        parser.parse_args(
            [
                "--ckpt",
                str(BASE_MODEL),
                "--max-tokens",
                "1024",
                "--context",
                "256",
                "--batch-size",
                "4",
                "--baseline",
            ]
        )
    )
    assert out["tokens"] == 1024 and out["ppl"] < 0.7 * out["unigram"]["ppl"]
    with pytest.raises(ValueError, match="--context"):
        run_eval_ppl(parser.parse_args(["--ckpt", str(BASE_MODEL), "--context", "0"]))


def _ngram_copy_logits(
    ids: np.ndarray,
    window: int | None,
    prompt_length: int | None = None,
    vocab: int = 4096,
    n: int = 3,
    lookback: int | None = None,
) -> np.ndarray:
    """An exact in-context copier: at each position, predict the token that followed the last earlier
    occurrence of the current n-gram, looking back only within the position's `window`-token segment
    (with `prompt_length`, ARMT's decoding layout: positions after the prompt's last segment opened
    look back to its start, up to 2 windows) and at most `lookback` tokens."""
    b, t = ids.shape
    opened = None if window is None or prompt_length is None else (prompt_length - 1) // window * window
    logits = np.zeros((b, t, vocab), np.float32)
    for row in range(b):
        for pos in range(n - 1, t):
            start = 0 if window is None else pos // window * window
            if opened is not None and opened <= pos < opened + 2 * window:
                start = opened
            start = start if lookback is None else max(start, pos - lookback)
            key = tuple(ids[row, pos - n + 1 : pos + 1])
            for j in range(pos - 1, max(start, n - 1) - 1, -1):
                if tuple(ids[row, j - n + 1 : j + 1]) == key:
                    logits[row, pos, ids[row, j + 1]] = 1.0
                    break
    return logits


def test_retrieval_accuracy_splits_attention_from_memory():
    from jaxlongctx.train.evaluate import retrieval_accuracy

    def score(window, length, samples=8, layout=True, **kw):
        def model(ids, prompt_length):
            return _ngram_copy_logits(ids, window, prompt_length if layout else None)

        return retrieval_accuracy(model, length, samples, batch_size=4, num_facts=1, **kw)

    full = score(None, 380, segment_size=128)  # answer digits predicted at 379..382: all in segment 2
    assert full["exact_match"] == 1.0 and full["samples"] == 8
    assert full["in_segment_samples"] > 0 and full["from_memory_samples"] > 0
    codes = held_out_batch(range(8), 380, load_default_tokenizer(), num_facts=1)["code_start"]
    assert full["code_split_samples"] == code_split_by_boundary(codes, 128).sum()
    assert full["code_split_samples"] + full["code_whole_samples"] == 8
    split = score(None, 380, segment_size=128, split_facts=True)  # every asked fact split by a boundary
    assert split["split_facts"] and split["code_split_samples"] == 8 and split["exact_match"] == 1.0
    with pytest.raises(ValueError, match="segment_size"):
        score(None, 380, split_facts=True)
    # the splits follow the model's cut: sentence segments keep every shifted fact in one segment
    segmenter = SentenceSegmenter(load_default_tokenizer())
    by_sentences = score(
        None,
        380,
        segment_size=128,
        split_facts=True,
        segment_starts=lambda ids, lengths: segmenter.row_starts(ids, lengths, 128),
    )
    assert by_sentences["code_split_samples"] == 0 and by_sentences["code_whole_samples"] == 8
    assert by_sentences["in_segment_samples"] + by_sentences["from_memory_samples"] == 8
    windowed = score(128, 380, segment_size=128)  # sees only its own segment, like attention in ARMT
    assert windowed["in_segment_exact_match"] == 1.0 and windowed["from_memory_exact_match"] == 0.0
    # a prompt of whole segments: the answer is decoded in the window its last segment opened ...
    whole = score(128, 384, segment_size=128)
    assert whole["in_segment_samples"] > 0 and whole["in_segment_exact_match"] == 1.0
    assert whole["from_memory_exact_match"] == 0.0
    # ... while in a fresh segment digits 2-4 could not see the fact
    assert score(128, 384, layout=False, segment_size=128)["exact_match"] == 0.0
    assert "in_segment_samples" not in score(None, 380, samples=1)


def test_exact_match_interval_is_the_wilson_interval():
    from jaxlongctx.train.evaluate import exact_match_interval

    # Wilson: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 1.95996...
    z, right, n = 1.959963984540054, 14, 16
    p = right / n
    centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    expected = [(centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)]
    np.testing.assert_allclose(exact_match_interval(right, n), expected, rtol=1e-9)
    low, high = exact_match_interval(0, 8)
    assert low == 0.0 and 0.3 < high < 0.4  # nothing right out of 8 still allows a third
    assert exact_match_interval(8, 8)[1] == 1.0
    wide, narrow = exact_match_interval(7, 8), exact_match_interval(56, 64)  # same rate, 8x the samples
    assert wide[0] < narrow[0] < 7 / 8 < narrow[1] < wide[1]
    half_confidence = exact_match_interval(right, n, confidence=0.5)
    assert (
        expected[0] < half_confidence[0] < p < half_confidence[1] < expected[1]
    )  # less confidence, narrower


def test_retrieval_accuracy_by_fact_depth():
    from jaxlongctx.train.evaluate import retrieval_accuracy

    # A copier that sees 128 tokens back finds facts in the prompt's last quarter, never in its first half.
    out = retrieval_accuracy(
        lambda ids, n: _ngram_copy_logits(ids, None, lookback=128), 512, 16, batch_size=4, num_facts=1
    )
    depth = out["by_depth"]
    assert [d["depth"] for d in depth] == [[0.0, 0.25], [0.25, 0.5], [0.5, 0.75], [0.75, 1.0]]
    assert sum(d["samples"] for d in depth) == 16
    assert depth[0]["samples"] and depth[3]["samples"]  # these eval seeds fill both ends
    assert depth[0]["exact_match"] == 0.0 and depth[3]["exact_match"] == 1.0
    assert depth[1]["exact_match"] in (None, 0.0)
    assert out["exact_match"] == sum(d["samples"] * (d["exact_match"] or 0) for d in depth) / 16
    low, high = out["exact_match_ci95"]
    assert low < out["exact_match"] < high  # some but not all samples right
    assert depth[0]["exact_match_ci95"][0] == 0.0 and depth[3]["exact_match_ci95"][1] == 1.0
    assert all(d["exact_match_ci95"] is None for d in depth if not d["samples"])


def test_retrieval_accuracy_counts_wrong_digits_and_first_digits_of_another_fact():
    from jaxlongctx.data.haystack import held_out_batch
    from jaxlongctx.train.evaluate import retrieval_accuracy

    length, samples, batch_size = 512, 12, 4
    batches = [
        held_out_batch(range(i, i + batch_size), length, load_default_tokenizer())
        for i in range(0, samples, batch_size)
    ]

    def first_fact_answerer(ids, prompt_length):  # always answers the code of the prompt's first fact
        raw = next(b for b in batches if np.array_equal(b["ids"], ids[:, :prompt_length]))
        logits = np.zeros((*ids.shape, 4096), np.float32)
        for d in range(CODE_DIGITS):
            logits[np.arange(len(ids)), prompt_length - 1 + d, raw["fact_answer_ids"][:, 0, d]] = 1.0
        return logits

    out = retrieval_accuracy(first_fact_answerer, length, samples, batch_size=batch_size)
    target = np.concatenate([b["target_fact"] for b in batches])
    shared = np.concatenate([b["shares_word"] for b in batches])
    assert 0 < (target == 0).sum() < samples and 0 < shared.sum() < samples  # both cases occur
    assert out["num_facts"] == 4 and out["exact_match"] == (target == 0).mean()
    first = np.concatenate([b["fact_answer_ids"][:, 0, 0] != b["answer_ids"][:, 0] for b in batches])
    assert 0 < first.sum() < samples  # some wrong answers start with a wrong first digit, some do not
    assert out["first_digit_other_fact_rate"] == first.mean()
    wrong = 1.0 - np.concatenate([b["fact_answer_ids"][:, 0] == b["answer_ids"] for b in batches]).mean(
        axis=0
    )
    assert out["wrong_digit_rate"] == pytest.approx(wrong.tolist())
    assert (
        out["shared_word_samples"] == shared.sum() and out["distinct_words_samples"] == samples - shared.sum()
    )
    assert out["shared_word_exact_match"] == (target[shared] == 0).mean()
    batches = [
        held_out_batch(range(i, min(i + 5, samples)), length, load_default_tokenizer())
        for i in range(0, samples, 5)
    ]
    assert retrieval_accuracy(first_fact_answerer, length, samples, batch_size=5) == out  # same prompts
    near = retrieval_accuracy(
        lambda ids, n: np.zeros((*ids.shape, 4096), np.float32), length, 4, batch_size=2, shared_word=True
    )
    assert (
        near["shared_word_haystack"] and near["shared_word_samples"] == 4 and not out["shared_word_haystack"]
    )


@pytest.mark.skipif(not ARMT_MODEL.is_dir(), reason="ARMT model asset not built yet")
def test_teacher_forced_exact_match_is_greedy_decoding_of_the_shipped_armt():
    """What `retrieval_accuracy` scores (argmax of the decoding logits, right digits fed back) is
    what greedy generation answers: the same samples right, and a wrong greedy answer starts with
    the wrong first digit exactly when teacher forcing has it wrong there."""
    from jaxlongctx.data.haystack import eval_seed, make_batch
    from jaxlongctx.generate import generate
    from jaxlongctx.loading import load
    from jaxlongctx.sampling import SamplingParams
    from jaxlongctx.train.evaluate import answer_inputs

    armt = load(ARMT_MODEL, "fp32")
    raw = make_batch(eval_seed(0), 16, 128, load_default_tokenizer(), num_facts=4)  # one segment
    logits = armt.generation_logits(answer_inputs(raw["ids"], raw["answer_ids"]), 128)
    forced = np.asarray(jnp.argmax(logits[:, 127 : 127 + CODE_DIGITS], axis=-1))
    greedy = generate(armt, raw["ids"], SamplingParams(CODE_DIGITS))[:, -CODE_DIGITS:]
    forced_right = (forced == raw["answer_ids"]).all(axis=1)
    assert 0 < forced_right.sum() < 16  # both outcomes occur in these samples
    np.testing.assert_array_equal(forced_right, (greedy == raw["answer_ids"]).all(axis=1))
    np.testing.assert_array_equal(forced[:, 0], greedy[:, 0])
