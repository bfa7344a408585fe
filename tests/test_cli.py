"""The command line end to end: --help, demo, generate (ids and text), convert."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxlongctx.cli import main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("demo", "generate", "convert"):
        assert cmd in out


def test_demo_runs_small(capsys):
    assert main(["demo", "--prompt-tokens", "256", "--new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["generated_ids"]) == 4
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0


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
    assert main(["generate", "--ckpt", str(d), "--prompt", "the code of the box is", "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.split()) == 4


def test_convert_command_and_errors(hf_family_dir, tmp_path, capsys):
    src, _ = hf_family_dir("mistral")
    assert main(["convert", "--hf-dir", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--hf-dir", str(src), "--out", str(tmp_path / "ck")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "--export", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()
