"""The command line end to end: --help, demo, generate (ids and text), convert."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from jaxlongctx.cli import build_parser, main
from jaxlongctx.data.haystack import held_out_batch
from jaxlongctx.data.tokenizer import load_default_tokenizer


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    listed = [m[1] for m in re.finditer(r"^ {4}(\S+)", out, re.MULTILINE)]
    assert {"demo", "generate", "convert", "chat", "eval-ppl"} <= set(listed)
    assert len(listed) == len(set(listed))  # each command once


@pytest.mark.parametrize(
    "command, new, old, dest, rest",
    [
        ("generate", "--model", "--ckpt", "model", ["--ids", "1"]),
        ("chat", "--model", "--ckpt", "model", []),
        ("demo", "--model", "--ckpt", "model", []),
        ("demo", "--armt-model", "--armt-ckpt", "armt_model", []),
        ("calibrate", "--model", "--ckpt", "model", ["--out", "cb"]),
        ("eval-ppl", "--model", "--ckpt", "model", []),
        ("train-armt", "--model", "--base", "base", ["--out", "run"]),
    ],
)
def test_model_flag_is_one_name_with_the_old_one_as_alias(capsys, command, new, old, dest, rest):
    parser = build_parser()
    for flag in (new, old):
        assert getattr(parser.parse_args([command, flag, "m.gguf", *rest]), dest) == "m.gguf"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help lines unwrapped
    assert f"{new} {dest.upper()}, {old} {dest.upper()}" in text
    assert f"({old}: old name, removed in the next release)" in text


def test_demo_runs_end_to_end_on_shipped_models(capsys):
    args = [
        "demo",
        "--context",
        "640",
        "--samples",
        "1",
        "--prompt-tokens",
        "300",
        "--new-tokens",
        "3",
        "--json",
        "--real-doc-tokens",
        "0",
    ]  # the real-model part has its own tests (test_demo_real_model.py)
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert "ARMT answer:" in out
    assert 0 <= result["retrieval"]["digit_accuracy"] <= 1
    low, high = result["retrieval"]["exact_match_ci95"]  # one sample: a wide interval around 0 or 1
    assert 0 <= low <= result["retrieval"]["exact_match"] <= high <= 1 and high - low > 0.7
    assert set(result["seconds"]) == {"armt_diagonal", "armt_sequential", "full_attention"}
    for cache in ("dense", "pq"):
        assert len(result[cache]["generated_ids"]) == 3
        assert result[cache]["decode_tokens_per_s"] > 0
    mem = result["memory_bytes"]
    assert mem["armt_state"] < mem["dense_kv_bf16"] * 2 and mem["pq_kv"] < mem["dense_kv_bf16"]


def test_demo_rejects_bad_sizes(capsys):
    assert main(["demo", "--context", "0"]) == 2
    assert "--context must be >= 1" in capsys.readouterr().err


def test_generate_ids_and_text(hf_family_dir, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    src, _ = hf_family_dir("llama2")
    assert main(["generate", "--ckpt", str(src), "--ids", "5 6 7", "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    # text prompts need a tokenizer next to the model
    assert main(["generate", "--ckpt", str(src), "--prompt", "hello"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    d = tmp_path / "with_tok"
    shutil.copytree(src, d)
    words = ["<unk>", "the", "code", "of", "box", "is"] + [f"w{i}" for i in range(250)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    assert (
        main(["generate", "--ckpt", str(d), "--prompt", "the code of the box is", "--max-new-tokens", "4"])
        == 0
    )
    assert len(capsys.readouterr().out.split()) == 4


def test_generate_with_armt_and_pq_options(hf_family_dir, tmp_path, capsys):
    from jaxlongctx.demo import ARMT_MODEL, BASE_CODEBOOKS, BASE_MODEL

    src, _ = hf_family_dir("llama2")
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(src),
                "--ids",
                "5 6 7 8 9",
                "--max-new-tokens",
                "3",
                "--armt-segment",
                "2",
                "--armt-mem",
                "2",
            ]
        )
        == 0
    )
    assert len(capsys.readouterr().out.split()) == 3
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(ARMT_MODEL),
                "--prompt",
                "The code of the red box is",
                "--max-new-tokens",
                "2",
            ]
        )
        == 0
    )
    capsys.readouterr()
    # a held-out haystack whose asked fact the fixed grid splits: answered with sentence segments
    sample = held_out_batch(range(3, 4), 512, load_default_tokenizer(), num_facts=1, split_segment=128)
    ids = " ".join(map(str, sample["ids"][0]))
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(ARMT_MODEL),
                "--ids",
                ids,
                "--max-new-tokens",
                "4",
                "--armt-segmentation",
                "sentences",
            ]
        )
        == 0
    )
    code = load_default_tokenizer().decode(sample["answer_ids"][0].tolist())
    assert capsys.readouterr().out.strip() == code.strip()
    assert main(["generate", "--ckpt", str(src), "--ids", "5", "--armt-segmentation", "sentences"]) == 2
    assert "applies to ARMT models" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(BASE_MODEL),
                "--ids",
                "5 6 7",
                "--max-new-tokens",
                "2",
                "--kv-cache",
                "pq",
                "--codebooks",
                str(BASE_CODEBOOKS),
                "--pq-sinks",
                "2",
                "--pq-observed",
                "0",
                "--stats",
            ]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["window"] == 128 + 2  # the recent window and the two sinks, exact
    argv = ["generate", "--ckpt", str(BASE_MODEL), "--ids", "5 6", "--kv-cache", "pq"]
    assert main([*argv, "--codebooks", str(BASE_CODEBOOKS), "--pq-observed", "-1"]) == 2
    assert "observed must be an int >= 0" in capsys.readouterr().err
    assert main([*argv, "--codebooks", str(BASE_CODEBOOKS)]) == 0
    explicit = capsys.readouterr().out
    assert main(argv) == 0  # the codebooks shipped for the shipped model, found by its fingerprint
    assert capsys.readouterr().out == explicit
    assert main(["generate", "--ckpt", str(src), "--ids", "5", "--kv-cache", "pq"]) == 2
    assert "needs --codebooks for this model" in capsys.readouterr().err


def test_convert_command_and_errors(hf_family_dir, tmp_path, capsys):
    src, _ = hf_family_dir("mistral")
    assert main(["convert", "--hf-dir", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--hf-dir", str(src), "--out", str(tmp_path / "ck")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "--export", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()
