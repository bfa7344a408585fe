"""Users' files are never destroyed and bad input never answers garbage: output-directory safety,
kill -9 during writes, checkpoint integrity checks, degenerate values, and one-line CLI errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.checkpoint import CheckpointError, save_model
from jaxlongctx.cli import main
from jaxlongctx.loading import load
from jaxlongctx.output_dir import MARKER, OutputError, atomic_directory, recover_leftovers
from jaxlongctx.train.lm import QUICK_CONFIG

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "kill_worker.py"


def _tiny_checkpoint(path: Path, value: float = 1.0) -> Path:
    from kill_worker import tiny_model

    from jaxlongctx.data.tokenizer import TOKENIZER_PATH

    return save_model(tiny_model(value), path, tokenizer_file=TOKENIZER_PATH)


def _user_dir(path: Path) -> Path:
    """A directory of someone else's files."""
    path.mkdir(parents=True)
    (path / "thesis.txt").write_text("years of work")
    (path / "sub").mkdir()
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return path


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".jaxlongctx-" in p.name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return _tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


@pytest.fixture(scope="module")
def hf_dir(ckpt, tmp_path_factory) -> Path:
    """A HF directory exported from the tiny checkpoint (no torch needed)."""
    from convert.hf_llama import export_ckpt_to_hf

    return export_ckpt_to_hf(ckpt, tmp_path_factory.mktemp("hf") / "hf")


# --- data loss ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["convert", "calibrate"])
def test_overwrite_refuses_a_directory_we_did_not_write(command, hf_dir, ckpt, tmp_path, capsys):
    user = _user_dir(tmp_path / "user")
    before = _snapshot(user)
    argv = (
        ["convert", "--hf-dir", str(hf_dir)]
        if command == "convert"
        else ["calibrate", "--model", str(ckpt), "--iters", "1", "--max-tokens", "256"]
    )
    assert main([*argv, "--out", str(user), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "not written by jaxlongctx" in err and err.count("error:") == 1
    assert _snapshot(user) == before
    assert _leftovers(tmp_path) == []


def test_output_equal_to_or_containing_the_input_is_refused(tmp_path, capsys):
    from convert.hf_llama import export_ckpt_to_hf

    src = export_ckpt_to_hf(_tiny_checkpoint(tmp_path / "ck"), tmp_path / "models" / "hf")
    (src / MARKER).unlink()  # a user's HF directory
    before = _snapshot(src)
    for out in (src, src.parent):
        assert main(["convert", "--hf-dir", str(src), "--out", str(out), "--overwrite"]) == 2
        assert "is or contains the input" in capsys.readouterr().err
    assert _snapshot(src) == before


@pytest.mark.parametrize("command", ["train-lm", "train-armt"])
def test_train_save_refuses_existing_or_foreign_directories_before_training(command, tmp_path, capsys):
    user = _user_dir(tmp_path / "user")
    before = _snapshot(user)
    run = (
        ["train-lm", "--quick"]
        if command == "train-lm"
        else ["train-armt", "--base", str(REPO / "jaxlongctx/assets/base_model"), "--curriculum", "128:1:1"]
    )
    t0 = time.perf_counter()
    assert main([*run, "--out", str(tmp_path / "run"), "--save", str(user), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (
        main([*run, "--out", str(tmp_path / "run"), "--save", str(user), "--overwrite", "--no-progress"]) == 2
    )
    assert "not written by jaxlongctx" in capsys.readouterr().err
    assert time.perf_counter() - t0 < 60  # refused up front, not after training
    assert _snapshot(user) == before
    # A run directory full of someone else's files is refused too.
    assert main([*run, "--out", str(user), "--no-progress"]) == 2
    assert "holds no jaxlongctx training run" in capsys.readouterr().err
    assert _snapshot(user) == before


def test_replace_keeps_unrelated_files_and_swaps_whole_directories(tmp_path):
    path = _tiny_checkpoint(tmp_path / "model", 1.0)
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(OutputError, match="already exists"):
        _tiny_checkpoint(path, 2.0)
    from kill_worker import tiny_model

    save_model(tiny_model(2.0), path, overwrite=True)
    assert float(load(path).module.embed[0, 0]) == 2.0
    assert (tmp_path / "notes.txt").read_text() == "keep"
    assert _leftovers(tmp_path) == []


def test_a_directory_created_at_the_output_while_writing_is_left_untouched(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="appeared while"), atomic_directory(out) as tmp:
        (tmp / "ours").write_text("x")
        _user_dir(out)
    assert (out / "thesis.txt").read_text() == "years of work" and not (out / "ours").exists()
    # an empty one too
    with pytest.raises(OutputError, match="appeared while"), atomic_directory(tmp_path / "empty"):
        (tmp_path / "empty").mkdir()
    assert (tmp_path / "empty").is_dir()
    assert _leftovers(tmp_path) == []


def test_leftovers_of_a_killed_writer_are_cleaned_or_restored(tmp_path, capsys):
    path = _tiny_checkpoint(tmp_path / "model", 1.0)
    dead = 2**22 + 12345  # beyond pid_max's default: no such process
    stale_tmp = tmp_path / f".model.jaxlongctx-tmp-{dead}-abc"
    stale_tmp.mkdir()
    (stale_tmp / "half").write_text("x")
    os.rename(path, tmp_path / f".model.jaxlongctx-old-{dead}-def")  # killed between the two renames
    done = recover_leftovers(path)
    assert len(done) == 2 and any("restored" in line for line in done)
    assert float(load(path).module.embed[0, 0]) == 1.0
    assert _leftovers(tmp_path) == []


def _kill_during(mode: str, target: Path, delay: float, *extra: str) -> list[str]:
    """Run the looping writer, kill -9 it `delay` s after its first write; returns its output lines."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(target), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
    )
    try:
        first = proc.stdout.readline().strip()
        assert first == "ready", f"worker failed to start ({first!r})"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        out = proc.communicate()[0]
    return ["ready", *out.split()]


@pytest.mark.parametrize("mode,kills", [("replace", 3), ("convert", 2)])
def test_kill_9_while_replacing_leaves_a_complete_checkpoint(mode, kills, hf_dir, tmp_path):
    rng = random.Random(f"kill-{mode}")
    (tmp_path / "unrelated.txt").write_text("keep")
    target = tmp_path / "model"
    extra = (str(hf_dir),) if mode == "convert" else ()
    for delay in sorted(rng.uniform(0.0, 0.6) for _ in range(kills)):
        _kill_during(mode, target, delay, *extra)
        model = load(target)  # the old or the new one, complete, with nothing repaired first
        assert model.config == QUICK_CONFIG or mode == "convert"
        recover_leftovers(target)  # what the next writer does first
        assert _leftovers(tmp_path) == []
    assert (tmp_path / "unrelated.txt").read_text() == "keep"


def test_kill_9_while_training_leaves_a_resumable_run(tmp_path):
    import optax

    from jaxlongctx.train.trainer import Trainer, TrainerConfig, latest_checkpoint

    run = tmp_path / "run"
    for delay in (0.05, 0.3):
        _kill_during("train", run, delay)
        assert latest_checkpoint(run) is not None
        trainer = Trainer(
            lambda p, _f, b: jnp.mean((p["w"] - b["x"]) ** 2),
            {"w": jnp.ones((64, 64))},
            optax.sgd(0.1),
            lambda step: {"x": np.zeros((64, 64), np.float32)},
            TrainerConfig(steps=10**6, out_dir=run, ckpt_every=1, progress=False),
        )
        assert trainer.maybe_resume() and trainer.step >= 1


def test_convert_checks_free_space_before_it_starts(hf_dir, tmp_path, monkeypatch, capsys):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**6, 10**6 - 1000, 1000))
    assert main(["convert", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "out")]) == 2
    assert "MiB are free" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB file system (tmpfs), smaller than the tiny model,, where mounting is permitted (root on Linux)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); free space is still checked by the test above")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_an_error_not_a_crash(hf_dir, tiny_disk, monkeypatch, capsys):
    import collections

    usage = collections.namedtuple("usage", "total used free")  # the estimate passes; the disk is still full
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**12, 0, 10**12))
    assert main(["convert", "--hf-dir", str(hf_dir), "--out", str(tiny_disk / "out")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error:") and "No space left" in last
    assert list(tiny_disk.iterdir()) == []


# --- silent wrong results -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value,match",
    [("num_layers", 3, "layers"), ("vocab_size", 300, "embed"), ("hidden_size", 48, "embed")],
)
def test_config_not_matching_the_stored_tensors_is_refused(ckpt, tmp_path, field, value, match):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    meta = json.loads((bad / "config.json").read_text())
    meta["config"][field] = value
    (bad / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=match):
        load(bad)
    meta = json.loads((ckpt / "config.json").read_text())
    meta["dtype"] = "bfloat16"  # stored float32
    (bad / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="stored as float32"):
        load(bad)


def test_weights_with_nan_are_refused_at_import(hf_dir, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "hf_nan"
    shutil.copytree(hf_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name][3, 5] = np.nan
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "--hf-dir", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert f"tensor {name!r} holds NaN" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), 1e-45, -1.0])
def test_degenerate_temperature_is_refused(temperature):
    from jaxlongctx.sampling import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(2, temperature=temperature)


def test_non_finite_codebooks_and_learning_rate_are_refused(tmp_path):
    import dataclasses

    from jaxlongctx.kvcache.codebooks import load_codebooks, save_codebooks, train_codebooks
    from jaxlongctx.train.optim import OptimConfig

    keys = np.random.default_rng(0).normal(size=(2, 64, 1, 8)).astype(np.float32)  # [L, N, K, hd]
    cb = train_codebooks(keys, keys, 2, 2, "shared", 2, key=jax.random.key(0), progress=False)
    path = save_codebooks(cb, tmp_path / "cb")
    bad = dataclasses.replace(cb, key_centroids=cb.key_centroids.at[0].set(jnp.nan))
    with pytest.raises(ValueError, match="non-finite"):
        save_codebooks(bad, tmp_path / "cb2")
    assert load_codebooks(path).ds == 2
    for lr in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="lr"):
            OptimConfig(lr=lr)


def test_eval_ppl_refuses_a_vocabulary_smaller_than_the_tokenizer(tmp_path, capsys):
    from jaxlongctx.config import ModelConfig
    from jaxlongctx.data.tokenizer import TOKENIZER_PATH
    from jaxlongctx.model.model import Model

    small = ModelConfig(**{**QUICK_CONFIG.to_dict(), "vocab_size": 200})
    save_model(Model.init(small, dtype=jnp.float32).module, tmp_path / "small", tokenizer_file=TOKENIZER_PATH)
    assert main(["eval-ppl", "--ckpt", str(tmp_path / "small"), "--max-tokens", "512"]) == 2
    assert "vocabulary has 200 ids" in capsys.readouterr().err


def test_resume_with_changed_settings_is_refused(tmp_path, capsys):
    run = [
        "train-lm",
        "--quick",
        "--steps",
        "2",
        "--ckpt-every",
        "1",
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    assert main([*run, "--lr", "0.003"]) == 0
    capsys.readouterr()
    assert main([*run, "--lr", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "changed settings" in err and "lr" in err
    assert main([*run, "--lr", "0.003", "--batch-size", "2"]) == 2
    assert "batch_size" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--context"])
def test_zero_sizes_are_refused_not_defaulted(flag, tmp_path, capsys):
    assert main(["train-lm", "--quick", flag, "0", "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_quick_bench_runs_do_not_overwrite_full_results(tmp_path, monkeypatch):
    import bench.common as common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(common, "_QUICK", False)
    full = common.write_result("thing", {"x": 1})
    common.use_quick_results(True)
    quick = common.write_result("thing", {"x": 2})
    assert common.plot_path("thing").name == "thing_quick.png"
    assert json.loads(full.read_text())["x"] == 1 and quick.name == "thing_quick.json"


# --- crashes become one error line ---------------------------------------------------------------
def _bad_inputs(root: Path, ckpt: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, text the error line must contain)."""

    def variant(name: str, edit) -> Path:
        d = root / name
        shutil.copytree(ckpt, d)
        edit(d)
        return d

    def config_edit(change):
        def edit(d: Path) -> None:
            meta = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps(change(meta)))

        return edit

    def drop(key):
        return config_edit(lambda m: {k: v for k, v in m.items() if k != key})

    hf = root / "hf_zero_heads"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 0,
            }
        )
    )
    hf_str = root / "hf_string"
    shutil.copytree(hf, hf_str)
    (hf_str / "config.json").write_text(
        (hf / "config.json").read_text().replace('"hidden_size": 8', '"hidden_size": "eight"')
    )
    gen = ["generate", "--ids", "1 2"]
    return {
        "config_is_list": (
            [*gen, "--ckpt", str(variant("list", lambda d: (d / "config.json").write_text("[1, 2]")))],
            "config.json",
        ),
        "zero_heads": ([*gen, "--ckpt", str(hf)], "num_attention_heads"),
        "string_number": ([*gen, "--ckpt", str(hf_str)], "hidden_size"),
        "garbage_tokenizer": (
            [
                *gen,
                "--ckpt",
                str(
                    variant("garbage_tok", lambda d: (d / "tokenizer.json").write_bytes(b"\xff\xfe garbage"))
                ),
            ],
            "tokenizer.json",
        ),
        "tokenizer_is_dir": (
            [
                *gen,
                "--ckpt",
                str(
                    variant(
                        "dir_tok", lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").mkdir())
                    )
                ),
            ],
            "tokenizer.json",
        ),
        "no_config_field": ([*gen, "--ckpt", str(variant("noconf", drop("config")))], "'config'"),
        "no_dtype_field": ([*gen, "--ckpt", str(variant("nodtype", drop("dtype")))], "'dtype'"),
        "huge_id": (["generate", "--ckpt", str(ckpt), "--ids", "99999999999"], "outside the vocabulary"),
        "bad_prompt_bytes": (["generate", "--ckpt", str(ckpt), "--prompt", "caf\udce9"], "prompt"),
        "unwritable_out": (["convert", "--export", str(ckpt), "--out", "/proc/jaxlongctx/out"], "/proc"),
        "eval_ppl_on_armt": (["eval-ppl", "--ckpt", str(REPO / "jaxlongctx/assets/armt_model")], "ARMTModel"),
        "missing_model": ([*gen, "--ckpt", str(root / "nowhere")], "nowhere"),
    }


def test_bad_inputs_end_in_one_error_line(ckpt, tmp_path, capsys):
    failures = []
    for name, (argv, expect) in _bad_inputs(tmp_path, ckpt).items():
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        error_lines = [line for line in err if line.startswith("error:")]
        if (
            code != 2
            or len(error_lines) != 1
            or expect not in error_lines[0]
            or "Traceback" in "\n".join(err)
        ):
            failures.append((name, code, err[-3:]))
    assert not failures, failures


def test_the_command_line_program_exits_2_with_one_error_line(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text("[]")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxlongctx.cli", "generate", "--ckpt", str(bad), "--ids", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{bad / 'config.json'}: must hold a JSON object" in errors[0]
    assert "Traceback" not in proc.stderr
