"""Converter bookkeeping: every failure is a named error that leaves no output; round trips are exact."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hf_oracle import make_hf_model
from safetensors.numpy import load_file, save_file

from convert.cli import main
from convert.hf_llama import ConversionError, convert_hf_to_ckpt, export_ckpt_to_hf
from jaxlongctx.config import ConfigError


@pytest.fixture()
def hf_copy(hf_family_dir, tmp_path):
    src, _ = hf_family_dir("llama2")
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    return dst


def _edit(hf_dir, fn):
    f = hf_dir / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def _expect_failure(hf_dir, tmp_path, match):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        convert_hf_to_ckpt(hf_dir, out, progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


def test_missing_tensor(hf_copy, tmp_path):
    _edit(hf_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _expect_failure(hf_copy, tmp_path, "missing tensor 'model.layers.1.mlp.up_proj.weight'")


def test_unknown_tensor(hf_copy, tmp_path):
    _edit(hf_copy, lambda t: t.__setitem__("model.layers.0.mystery.weight", np.zeros(3, np.float32)))
    _expect_failure(hf_copy, tmp_path, r"model.safetensors: unknown tensor 'model.layers.0.mystery.weight'")


def test_wrong_shape(hf_copy, tmp_path):
    _edit(
        hf_copy,
        lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((3, 64), np.float32)),
    )
    _expect_failure(hf_copy, tmp_path, r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(3, 64\)")


def test_duplicated_tensor(hf_copy, tmp_path):
    save_file({"model.norm.weight": np.ones(64, np.float32)}, hf_copy / "extra.safetensors")
    _expect_failure(hf_copy, tmp_path, "tensor 'model.norm.weight' appears twice")


def test_corrupt_file(hf_copy, tmp_path):
    f = hf_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    _expect_failure(hf_copy, tmp_path, "model.safetensors: corrupt safetensors file")


def test_unsupported_config(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    _expect_failure(hf_copy, tmp_path, "unsupported hidden_act 'gelu'")
    cfg["hidden_act"], cfg["model_type"] = "silu", "gpt2"
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'"):
        convert_hf_to_ckpt(hf_copy, tmp_path / "out", progress=False)


def test_pickled_checkpoint_refused(tmp_path):
    d = tmp_path / "pt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ConversionError, match=r"pickled PyTorch files.*refused"):
        from convert.hf_llama import SafetensorsReader

        SafetensorsReader(d)


def test_existing_output_is_not_overwritten(hf_copy, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="already exists"):
        convert_hf_to_ckpt(hf_copy, out, progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    src = tmp_path / "src"
    make_hf_model("qwen2", src, dtype=dtype)
    assert main(["--hf-dir", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    export_ckpt_to_hf(tmp_path / "ckpt", tmp_path / "back")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].tobytes() == b[name].tobytes(), name


def test_exported_model_loads_in_transformers(tmp_path, hf_family_dir):
    import torch
    import transformers
    from hf_oracle import hf_logits

    src, hf = hf_family_dir("qwen3")
    convert_hf_to_ckpt(src, tmp_path / "ckpt", progress=False)
    export_ckpt_to_hf(tmp_path / "ckpt", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    ids = np.arange(3, 15)[None]
    mask = np.ones_like(ids, bool)
    np.testing.assert_allclose(hf_logits(back, ids, mask), hf_logits(hf, ids, mask), atol=1e-6)
