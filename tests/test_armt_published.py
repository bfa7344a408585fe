"""The ARMT authors' published format (spec/armt_published.md): `jaxlongctx.load` of the fixture
directories (made by the authors' reference code) reproduces the reference's logits, memory state and
greedy ids on both schedules; conversion to our checkpoint and back is bit-exact; bad input is refused
by name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS
from jaxlongctx.armt.projections import DiagonalProjections
from jaxlongctx.sampling import SamplingParams

# CI lays the shared folder beside the clone (`../shared`); JAXLONGCTX_SHARED points elsewhere
SHARED = Path(os.environ.get("JAXLONGCTX_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
FIXTURES = SHARED / "fixtures" / "armt_published"
NAMES = ("sw_sink", "nosw_sink", "sw_sink_heads2")
TOL = 1e-4  # fp32 logits and A, z (fixtures' README: the reference vs float64 within 4.7e-5)


def fixture_dir(name: str) -> Path:
    """A fixture folder; a missing `shared/` folder beside the repository is a failure, not a skip."""
    d = FIXTURES / name
    assert (d / "fixture.npz").is_file(), (
        f"{d}: missing fixture (expected the shared/ folder beside the repo)"
    )
    return d


def _check_forward(model, f, schedule: str) -> None:
    ones = np.ones_like(f["attention_mask"])
    logits, state = model.run(f["input_ids"], ones, schedule=schedule)
    assert float(jnp.abs(logits - f["logits_nomask"]).max()) <= TOL, schedule
    rpad, _ = model.run(f["input_ids_rpad"], f["attention_mask_rpad"], schedule=schedule)
    real = f["attention_mask_rpad"].astype(bool)
    assert float(np.abs(np.asarray(rpad) - f["logits_rpad"])[real].max()) <= TOL, schedule
    L, _, H, feat, c = f["mem_A"].shape
    want_A, want_z = f["mem_A"][:, 0].reshape(L, H * feat, c), f["mem_z"][:, 0].reshape(L, H * feat)
    rel = lambda got, want: float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
    assert rel(state.A[:, 0], want_A) <= TOL and rel(state.z[:, 0], want_z) <= TOL, schedule


PATHS = ("sequential", "vmap", "grouped")


# Every fixture on every path with -m slow; the default run takes the grouped-GEMM step (interpreted,
# 12-30 s a case) on the memory-heads fixture only.
PARITY_CASES = [
    pytest.param(n, p, marks=pytest.mark.slow) if p == "grouped" and n != "sw_sink_heads2" else (n, p)
    for n in NAMES
    for p in PATHS
]


@pytest.mark.parametrize("name, path", PARITY_CASES)
def test_published_fixture_parity(name, path):
    """Logits (unpadded, right-padded real positions) and the unpadded row's final A and z of the
    reference on the sequential schedule, the diagonal pipeline (vmapped cells) and the grouped-GEMM
    step (Pallas kernel interpreted); the reference's greedy ids (sequential)."""
    d = fixture_dir(name)
    f = np.load(d / "fixture.npz")
    model = jaxlongctx.load(d)
    assert model.armt.sink and model.armt.sliding_window == (name != "nosw_sink")
    if path == "sequential":
        _check_forward(model, f, "sequential")
        new = f["gen_ids_nomask"].shape[1]
        out = jaxlongctx.generate(model, f["input_ids"], SamplingParams(max_new_tokens=new))
        np.testing.assert_array_equal(np.asarray(out)[:, -new:], f["gen_ids_nomask"])
        return
    model.cpu_execution = PIPELINE_ALWAYS
    model.projections = "vmap" if path == "vmap" else DiagonalProjections("grouped_matmul", "interpret")
    _check_forward(model, f, "diagonal")


def test_published_bf16_load():
    """A bf16 load of the fp32 files stays within bf16 rounding of the fp32 logits: as close as the
    float32 computation with the bf16-rounded weights (segment 0, before any memory read: 2% of the
    largest logit)."""
    d = fixture_dir("sw_sink")
    f = np.load(d / "fixture.npz")
    model = jaxlongctx.load(d, "bf16")
    assert model.dtype == jnp.bfloat16
    want = f["logits_nomask"]
    err = lambda m: np.abs(np.asarray(m(f["input_ids"], schedule="sequential")) - want)
    bf16, rounded = err(model), err(model.astype(jnp.float32))
    assert rounded.max() > 0 and bf16.max() <= 2.5 * rounded.max(), (bf16.max(), rounded.max())
    assert bf16[:, :6].max() <= 0.02 * np.abs(want).max()


def test_published_round_trip_bit_exact(tmp_path):
    """convert --armt-hf then --export-armt-hf gives the same tensors, bit for bit, and a config that
    loads to the same model."""
    from safetensors.numpy import load_file

    from convert.cli import main

    d = fixture_dir("nosw_sink")
    assert main(["--armt-hf", str(d), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["--export-armt-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    src, back = (
        load_file(str(d / "model.safetensors")),
        load_file(str(tmp_path / "back" / "model.safetensors")),
    )
    assert sorted(src) == sorted(back)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and np.array_equal(back[name], t), name
    # bf16, as the authors publish: import cast to bf16, export, and the bf16 files load as bf16
    assert main(["--armt-hf", str(d), "--out", str(tmp_path / "ckpt16"), "--dtype", "bf16"]) == 0
    assert main(["--export-armt-hf", str(tmp_path / "ckpt16"), "--out", str(tmp_path / "back16")]) == 0
    bf16 = load_file(str(tmp_path / "back16" / "model.safetensors"))
    assert {str(t.dtype) for t in bf16.values()} == {"bfloat16"}
    assert np.array_equal(bf16["sink"], src["sink"].astype(bf16["sink"].dtype))
    assert jaxlongctx.load(tmp_path / "back16").dtype == jnp.bfloat16
    original = json.loads((d / "config.json").read_text())
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in exported.items() if k != "dtype"} == {
        k: v for k, v in original.items() if k != "dtype"
    }


def _copy(tmp_path: Path, name: str = "sw_sink") -> Path:
    out = tmp_path / "in"
    shutil.copytree(fixture_dir(name), out)
    for p in out.iterdir():
        p.chmod(0o644)
    return out


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"act_on": True}, "act_on"),
        ({"wrap_pos": True}, "wrap_pos"),
        ({"segment_alignment": "right"}, "segment_alignment"),
        ({"wrap_layers": [True, False, True]}, "wrap_layers"),
        ({"base_model_config": None, "base_model_name": "someone/unknown"}, "someone/unknown"),
    ],
)
def test_published_bad_config_refused_by_name(tmp_path, capsys, changes, message):
    """An unsupported option or an unknown base gives one `error:` line naming it; nothing is written."""
    from convert.cli import main

    d = _copy(tmp_path)
    _edit_config(d, **changes)
    assert main(["--armt-hf", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_published_bad_tensors_refused_by_name(tmp_path, capsys):
    """A missing or mis-shaped tensor is named in one `error:` line; nothing is written."""
    from safetensors.numpy import load_file, save_file

    from convert.cli import main

    d = _copy(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    for edit, name in (("drop", "model.model.layers.1.W_mk.weight"), ("shape", "sink")):
        bad = dict(tensors)
        if edit == "drop":
            del bad[name]
        else:
            bad[name] = np.zeros((2, bad[name].shape[1]), bad[name].dtype)
        save_file(bad, str(d / "model.safetensors"))
        assert main(["--armt-hf", str(d), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and name in err[0], err
        assert not (tmp_path / "out").exists()


def test_published_named_base(tmp_path):
    """A config naming its base: the built-in table, or an explicit base config for another name; the
    window flag spelled `sliding_window_enabled`."""
    from convert.armt_hf import KNOWN_BASES, base_config

    cfg = base_config({"base_model_name": "meta-llama/Llama-3.2-1B"}, "config.json")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.tie_word_embeddings) == (2048, 16, 8, True)
    assert cfg.rope_scaling["rope_type"] == "llama3" and "meta-llama/Llama-3.2-1B" in KNOWN_BASES
    d = _copy(tmp_path)
    inline = json.loads((d / "config.json").read_text())["base_model_config"]
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps(inline))
    _edit_config(d, base_model_config=None, base_model_name="org/tiny-base", sliding_window_enabled=True)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["sliding_window"]  # the reference's own save_pretrained spelling alone
    (d / "config.json").write_text(json.dumps(cfg))
    f = np.load(d / "fixture.npz")
    model = jaxlongctx.load(d, base_config=tmp_path / "base")
    assert model.armt.sliding_window
    logits = model(f["input_ids"], schedule="sequential")
    assert float(jnp.abs(logits - f["logits_nomask"]).max()) <= TOL


def test_published_tokenizer_and_chat_template(tmp_path):
    """The directory's tokenizer files give the model its tokenizer and chat template, and travel
    through conversion and export."""
    from tokenizers import Tokenizer, models

    from convert.cli import main

    d = _copy(tmp_path, "nosw_sink")
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0")).save(
        str(d / "tokenizer.json")
    )
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "w2"}))
    model = jaxlongctx.load(d)
    assert model.tokenizer.chat_template == template and model.tokenizer.token_to_id("w7") == 7
    assert main(["--armt-hf", str(d), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["--export-armt-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    back = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert back["chat_template"] == template
