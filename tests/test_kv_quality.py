"""K/V fake-quantization perplexity and the calibrate / eval-ppl / generate --kv-cache command helpers."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.cache_choice import PQKV, DenseKV, add_kv_cache_arguments, kv_cache_from_args
from jaxlongctx.checkpoint import save_model
from jaxlongctx.commands.calibrate import add_calibrate_arguments, run_calibrate
from jaxlongctx.commands.eval_ppl import add_eval_kv_arguments, add_eval_ppl_arguments, run_eval_ppl
from jaxlongctx.config import ModelConfig
from jaxlongctx.kv_quality import kv_perplexity, kv_transform
from jaxlongctx.kvcache import fake_quantize
from jaxlongctx.kvcache.model_codebooks import model_fingerprint
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.train.evaluate import perplexity

# vocab of the default tokenizer, so the built-in corpus splits are valid ids
CFG = ModelConfig(
    vocab_size=4096,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def model():
    return jaxlongctx.Model.init(CFG, seed=3)


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    return save_model(model.module, tmp_path_factory.mktemp("m") / "ckpt")


@pytest.fixture(scope="module")
def codebooks_dir(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("cb") / "codebooks"
    p = argparse.ArgumentParser()
    add_calibrate_arguments(p)
    run_calibrate(
        p.parse_args(
            [
                "--model",
                str(ckpt),
                "--out",
                str(out),
                "--bits",
                "4",
                "--iters",
                "2",
                "--granularity",
                "layer",
                "--seq-len",
                "128",
                "--max-tokens",
                "256",
            ]
        )
    )
    return out


def test_default_points_per_centroid_samples_about_16k_vectors_a_problem():
    from jaxlongctx.kvcache.calibrate import default_points_per_centroid

    assert [default_points_per_centroid(b) for b in (4, 6, 8, 10, 12)] == [1024, 256, 64, 64, 64]


def test_transforms(model):
    k = jax.random.normal(jax.random.key(0), (1, 40, 1, 16))
    assert kv_transform("dense") is None
    with pytest.raises(ValueError, match="kv kind must be one of"):
        kv_transform("int3")
    with pytest.raises(ValueError, match="needs codebooks"):
        kv_transform("pq")
    k4, v4 = kv_transform("int4", group=8)(k, k, 0)
    assert 0 < float(jnp.abs(k4 - k).max()) < 0.5 and float(jnp.abs(v4 - k).max()) < 0.5


def test_calibrate_cli_and_pq_perplexity(model, ckpt, codebooks_dir):
    from jaxlongctx.kvcache import load_codebooks

    cb = load_codebooks(codebooks_dir)
    assert cb.granularity == "layer" and cb.metadata["calibration_source"] == "calibration split"
    assert cb.metadata["points_per_centroid"] == 1024  # 4-bit codes: the default samples 16,384 a problem
    assert cb.model_fingerprint == model_fingerprint(model)
    k = jax.random.normal(jax.random.key(1), (1, 5, 1, 16))
    kq, _ = kv_transform("pq", cb)(k, k, 1)
    np.testing.assert_array_equal(kq, fake_quantize(k, cb.for_layer(1)[0]))
    tokens = np.random.default_rng(0).integers(3, 4096, 200)
    dense = kv_perplexity(model, tokens, 64, "dense", batch_size=2)
    assert dense["ppl"] == pytest.approx(perplexity(model.module, tokens, 64, 2)["ppl"])
    pq = kv_perplexity(model, tokens, 64, "pq", cb, batch_size=2)
    assert pq["bits_per_element"] == 2.0 and abs(pq["ppl"] / dense["ppl"] - 1) < 0.05

    p = argparse.ArgumentParser()
    add_eval_ppl_arguments(p)
    add_eval_kv_arguments(p)
    args = p.parse_args(
        [
            "--ckpt",
            str(ckpt),
            "--kv",
            "pq",
            "--codebooks",
            str(codebooks_dir),
            "--context",
            "64",
            "--max-tokens",
            "130",
            "--batch-size",
            "2",
        ]
    )
    result = run_eval_ppl(args)
    assert result["kv"] == "pq" and result["ppl_change"] == pytest.approx(
        result["ppl"] / result["dense_ppl"] - 1
    )
    with pytest.raises(ValueError, match="needs --codebooks for this model"):
        run_eval_ppl(p.parse_args(["--ckpt", str(ckpt), "--kv", "pq"]))
    with pytest.raises(ValueError, match="go with --kv-cache pq"):
        run_eval_ppl(p.parse_args(["--ckpt", str(ckpt), "--codebooks", str(codebooks_dir)]))


def test_generate_kv_cache_options(model, ckpt, codebooks_dir):
    p = argparse.ArgumentParser()
    add_kv_cache_arguments(p)
    cache = kv_cache_from_args(
        p.parse_args(
            ["--kv-cache", "pq", "--codebooks", str(codebooks_dir), "--pq-window", "16", "--pq-bare"]
        ),
        model,
    )
    assert isinstance(cache, PQKV) and cache.window == 16
    out = jaxlongctx.generate(
        model, np.array([[5, 6, 7]], np.int32), SamplingParams(20, stop_ids=()), cache=cache
    )
    assert out.shape == (1, 23)
    stats = cache.bytes_report(model.config, 23)
    assert stats["window_bytes"] == 2 * 2 * 1 * 16 * 16 * 2
    assert stats["codes_bytes"] == 2 * 2 * 1 * 7 * 4  # 4-bit codes of 8 subspaces, two a byte
    assert kv_cache_from_args(p.parse_args([]), model) == DenseKV()
    assert DenseKV().bytes_report(model.config, 23)["total_bytes"] == 2 * 2 * 23 * 16 * 2
    other = jaxlongctx.Model.init(CFG, seed=4)
    with pytest.raises(ValueError, match="were made for model"):
        kv_cache_from_args(p.parse_args(["--kv-cache", "pq", "--codebooks", str(codebooks_dir)]), other)
    with pytest.raises(ValueError, match="needs --codebooks for this model"):
        kv_cache_from_args(p.parse_args(["--kv-cache", "pq"]), model)
    with pytest.raises(ValueError, match="--pq-bare leaves every prompt token coded"):
        kv_cache_from_args(p.parse_args(["--kv-cache", "pq", "--pq-bare", "--pq-sinks", "2"]), model)
    default = kv_cache_from_args(p.parse_args(["--kv-cache", "pq", "--codebooks", str(codebooks_dir)]), model)
    assert (default.keep_prompt_tail_exact, default.sinks, default.observed) == (True, 4, 256)
    bare = kv_cache_from_args(
        p.parse_args(["--kv-cache", "pq", "--codebooks", str(codebooks_dir), "--pq-bare"]), model
    )
    assert (bare.keep_prompt_tail_exact, bare.sinks, bare.observed) == (False, 0, 0)


def test_eval_ppl_text_matches_perplexity_and_pq_cache_options(tmp_path, monkeypatch, capsys):
    """`eval-ppl --text FILE` (and `-`) on the shipped model equals `perplexity` over the file's tokens; with
    `--kv-cache pq` (its shipped codebooks) every token kept exact gives the dense perplexity back, and
    the default cache reports its bits and the change against dense on the same windows."""
    import io
    import json

    from jaxlongctx.cli import main
    from jaxlongctx.data.corpus import load_corpus
    from jaxlongctx.demo import BASE_MODEL

    text = "\n\n".join(load_corpus()["validation"][6:30])
    path = tmp_path / "notes.txt"
    path.write_text(text)
    model = jaxlongctx.load(BASE_MODEL)
    tokens = np.asarray(model.tokenizer.encode(text).ids)
    assert 300 < tokens.size < 2000
    want = perplexity(model.module, tokens, 128, 4)["ppl"]

    def eval_ppl(*argv: str) -> dict:
        assert (
            main(["eval-ppl", "--model", str(BASE_MODEL), "--context", "128", "--batch-size", "4", *argv])
            == 0
        )
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert eval_ppl("--text", str(path))["ppl"] == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert eval_ppl("--text", "-")["ppl"] == pytest.approx(want, rel=1e-6)
    exact = eval_ppl(
        "--text", str(path), "--kv-cache", "pq", "--pq-window", "1", "--pq-sinks", "128", "--pq-observed", "0"
    )
    assert exact["ppl"] == pytest.approx(want, rel=1e-4) and exact["dense_ppl"] == pytest.approx(
        want, rel=1e-6
    )
    pq = eval_ppl("--text", str(path), "--kv-cache", "pq", "--pq-window", "16", "--pq-observed", "8")
    assert pq["observed"] == 8 and pq["sinks"] == 4 and pq["dense_ppl"] == pytest.approx(want, rel=1e-6)
    assert pq["ppl"] != pytest.approx(want, rel=1e-4) and abs(pq["ppl_change"]) < 0.2
    assert 4 < pq["bits_per_element"] < 16
    assert main(["eval-ppl", "--model", str(BASE_MODEL), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt is not a file" in capsys.readouterr().err
