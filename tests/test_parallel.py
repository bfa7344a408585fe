"""Tensor/data parallelism on fake CPU devices: the same numbers as one device, 1/tp of the memory.

The multi-device checks run in subprocesses (tests/parallel_worker.py) because this pytest process
has already initialised JAX with a single CPU device.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import AbstractMesh

from jaxlongctx.cli import add_parallel_arguments, mesh_from_args
from jaxlongctx.config import ModelConfig
from jaxlongctx.parallel import check_divisible, make_mesh, param_shardings

WORKER = Path(__file__).parent / "parallel_worker.py"
TOLERANCE = 1e-4
EVERY_MESH = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2)]  # (tp, dp)
# The default run checks tp alone and tp with dp; `-m slow` checks every mesh.
FEW_MESHES = [(4, 1), (2, 2)]
MESH_LISTS = [FEW_MESHES, pytest.param(EVERY_MESH, marks=pytest.mark.slow)]


def _worker_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    return env


def _run_worker(command: str, out: Path, meshes: list[tuple[int, int]], timeout: int) -> dict:
    """Run a worker command on 8 fake devices over `meshes`; its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), command, str(out), *(f"{tp}:{dp}" for tp, dp in meshes)],
        env=_worker_env(8),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=MESH_LISTS, ids=["few_meshes", "every_mesh"])
def meshes(request, tmp_path_factory) -> dict:
    """Results of the single-process mesh checks on one list of meshes (one 8-device subprocess);
    "requested" is that list."""
    out = tmp_path_factory.mktemp("tp") / "meshes.json"
    got = _run_worker("meshes", out, request.param, timeout=900)  # minutes on 2 cores
    return {**got, "requested": request.param}


def _mesh_ids(meshes: dict) -> list[str]:
    return [f"dp{m['dp']}xtp{m['tp']}" for m in meshes["meshes"]]


def test_logits_and_greedy_tokens_match_one_device(meshes):
    for name, m in zip(_mesh_ids(meshes), meshes["meshes"]):
        assert m["logit_max_diff"] <= TOLERANCE, (name, m)
        assert m["tokens_equal"], name
    assert [(m["tp"], m["dp"]) for m in meshes["meshes"]] == meshes["requested"]


def test_per_device_parameter_bytes_divide_by_tp(meshes):
    total = meshes["total_param_bytes"]
    for m in meshes["meshes"]:
        replicated = m["replicated_param_bytes"] if m["tp"] > 1 else 0  # norms and the output bias
        assert m["device0_param_bytes"] == (total - replicated) // m["tp"] + replicated, m
        assert replicated < total / 100


def test_one_layer_has_exactly_two_all_reduces(meshes):
    assert meshes["layer_collectives_tp4"] == {
        "all-reduce": 2,
        "all-gather": 0,
        "reduce-scatter": 0,
        "all-to-all": 0,
        "collective-permute": 0,
    }


def test_forward_reduces_once_per_pair_and_gathers_only_logits(meshes):
    got = meshes["forward_collectives_tp4"]
    assert got["all-reduce"] == 3  # vocab-parallel embedding + the two pairs in the scanned layer body
    assert got["all_gather_shapes"] == ["f32[4,9,128]"]  # the logits [B, T, V]; no weight is gathered
    assert got["reduce-scatter"] == got["all-to-all"] == got["collective-permute"] == 0


def test_kv_cache_is_sharded_over_kv_heads_and_batch(meshes):
    assert meshes["cache_spec_2x2"] == "P(None, 'dp', 'tp', None, None)"


@pytest.mark.parametrize("source", ["checkpoint", "hf"])
def test_load_restores_into_shards(meshes, source):
    got = meshes["loading"][source]
    assert got["embed_spec"] == "P('tp', None)" and got["embed_shard_shape"] == [64, 64]
    assert got["w_down_spec"] == "P(None, 'tp', None)"
    assert got["logit_max_diff"] <= TOLERANCE


def test_pq_generation_matches_one_device(meshes):
    got = meshes["pq_generate"]
    head_cases = ("layer_head", "layer_head weighted pinned")
    want = [f"{c} dp{dp}xtp{tp}" for c in head_cases for tp, dp in meshes["requested"]]
    assert sorted(got) == sorted(want + ["shared dp2xtp2", "layer weighted pinned dp2xtp2"])
    for name, m in got.items():
        assert m["logit_max_diff"] <= TOLERANCE and m["tokens_equal"], (name, m)
        assert m["codes_equal"] and m["window_max_diff"] <= TOLERANCE, (name, m)
        dp, tp = (int(x) for x in name.split(" dp")[1].split("xtp"))
        assert m["codes_spec"] == (
            "P(None, 'dp', 'tp', None, None)" if dp > 1 else "P(None, None, 'tp', None, None)"
        )
        assert m["codes_shard_fraction"] == [1, dp, tp, 1, 1], (name, m)
        if "pinned" in name:  # 2 sinks + 3 observed pinned per row: 44 (41) prompt tokens less those
            # coded at prefill, + 2 flushed windows of 4
            assert m["pinned"] == [5, 5, 5, 5], (name, m)
            assert m["lengths_after"] == [47, 44, 47, 47], (name, m)
        else:  # 9 (6) prompt tokens + 2 flushed windows of 4
            assert m["pinned"] == [0, 0, 0, 0] and m["lengths_after"] == [17, 14, 17, 17], (name, m)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_pq_kernel_runs_per_kv_head_shard(meshes, backend):
    got = meshes["pq_attention"][backend]
    assert got["max_diff"] <= 1e-5 and got["out_spec"] == "P('dp', 'tp', None)" and got["collectives"] == 0


@pytest.mark.parametrize(
    "mesh_list",
    [
        [(4, 1), (2, 2)],
        pytest.param([(2, 1), (4, 1), (8, 1), (2, 2)], marks=pytest.mark.slow, id="every_mesh"),
    ],
)
def test_armt_published_on_meshes_matches_one_device(tmp_path, mesh_list):
    """The published cell (sink, sliding window, memory heads) on tp meshes up to and past its 2 kv
    heads: both schedules and greedy decoding equal one device; the window K/V splits over kv heads."""
    got = _run_worker("armt_published", tmp_path / "armt_published.json", mesh_list, timeout=600)
    assert sorted(got) == sorted(f"dp{dp}xtp{tp}" for tp, dp in mesh_list)
    for name, m in got.items():
        assert m["sequential"] <= TOLERANCE and m["diagonal"] <= TOLERANCE, (name, m)
        assert m["tokens_equal"], name
        assert "tp" in m["wk_spec"], (name, m["wk_spec"])


@pytest.mark.parametrize(
    "mesh_list",
    [
        pytest.param([(2, 2)], id="few_meshes"),
        pytest.param(EVERY_MESH[1:], marks=pytest.mark.slow, id="every_mesh"),
    ],
)
def test_armt_on_meshes_matches_one_device(tmp_path, mesh_list):
    """Both schedules, streaming and generation with random memory weights and a padded batch, on
    tp x dp meshes, on the grid and with sentence segments; W_mv and the memory state A split their
    value columns over tp and rows over dp."""
    got = _run_worker("armt", tmp_path / "armt.json", mesh_list, timeout=600)
    assert sorted(got) == sorted(
        [f"dp{dp}xtp{tp}" for tp, dp in mesh_list] + ["loaded_2x2", "sentences_differ_from_grid"]
    )
    assert got.pop("sentences_differ_from_grid") > 1e-2  # the sentence cut is not the grid's
    for name, m in got.items():
        if name == "loaded_2x2":
            continue
        for key in ("sequential", "diagonal", "stream", "sentences_diagonal", "sentences_stream"):
            assert m[key] <= TOLERANCE, (name, key, m)
        assert m["sequential_A_rel"] <= 1e-5 and m["diagonal_A_rel"] <= 1e-5, (name, m)
        assert m["tokens_equal"] and m["sentences_tokens_equal"], name
        assert m["wv_spec"] == "P(None, None, 'tp')"
        assert m["A_spec"] == (
            "P(None, 'dp', None, 'tp')" if name.startswith("dp2") else "P(None, None, None, 'tp')"
        )
    loaded = got["loaded_2x2"]
    assert loaded["wv_spec"] == "P(None, None, 'tp')" and loaded["wq_spec"] == "P(None, None, 'tp')"
    assert loaded["diagonal"] <= TOLERANCE


KV_REPLICA_CASES = [(kv, tp) for kv in (2, 4) for tp in (2, 4, 8)]  # (kv heads, tp)


def _check_kv_replicas(tmp_path, cases: list[tuple[int, int]], tokens: bool) -> None:
    """Dense, PQ (also with pinned prompt tokens) and ARMT on tp devices with K kv heads (replicated when
    tp > K) equal one device, and each device holds max(K / tp, 1) kv heads of the weights and of both
    caches."""
    out = tmp_path / "kv_replicas.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(WORKER),
            "kv_replicas",
            str(out),
            "tokens" if tokens else "logits",
            *(f"{kv}:{tp}" for kv, tp in cases),
        ],
        env=_worker_env(8),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert sorted(got) == sorted(f"kv{kv}xtp{tp}" for kv, tp in cases)
    for kv, tp in cases:
        row = got[f"kv{kv}xtp{tp}"]
        for name in ("dense", "pq", "pq_pinned", "armt"):
            assert row[f"{name}_logit_max_diff"] <= TOLERANCE, (kv, tp, name, row)
            assert row.get(f"{name}_tokens_equal", True), (kv, tp, name, row)
        assert (
            row["wv_local_heads"]
            == row["dense_cache_local_heads"]
            == row["pq_codes_local_heads"]
            == max(kv // tp, 1)
        )
        if tp > kv:  # kv heads over tp groups of tp / kv devices; everything else over all tp devices
            assert row["mesh"] == {"dp": 1, "tp": kv, "kv_rep": tp // kv}, row
            assert (
                row["wk_spec"] == "P(None, None, 'tp')"
                and row["wq_spec"] == "P(None, None, ('tp', 'kv_rep'))"
            )
            assert row["armt_A_spec"] == "P(None, None, None, ('tp', 'kv_rep'))"
        else:
            assert (
                row["mesh"] == {"dp": 1, "tp": tp}
                and row["wk_spec"] == row["wq_spec"] == "P(None, None, 'tp')"
            )
    assert tokens == ("dense_tokens_equal" in got[f"kv{cases[0][0]}xtp{cases[0][1]}"])


def test_tp_past_the_kv_heads_matches_one_device(tmp_path):
    """tp 8 over 2 kv heads: each kv head on 4 devices (logits of dense prefill, PQ decode and ARMT)."""
    _check_kv_replicas(tmp_path, [(2, 8)], tokens=False)


@pytest.mark.slow
def test_tp_vs_kv_heads_sweep(tmp_path):
    _check_kv_replicas(tmp_path, KV_REPLICA_CASES, tokens=True)


def test_two_processes_match_one(tmp_path):
    from parallel_worker import make_model, reference

    from jaxlongctx.checkpoint import save_model

    ckpt = save_model(make_model().module, tmp_path / "ckpt")
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "process", str(port), "2", str(r), str(ckpt), str(outs[r])],
            env=_worker_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    ref = reference()
    for out in outs:
        got = json.loads(out.read_text())
        assert got["global_devices"] == 4 and got["local_devices"] == 2
        assert got["wq_local_shape"] == [2, 64, 16 * 8 // 4]  # [L, D, H*hd / tp]: only this shard was read
        assert np.abs(np.asarray(got["logits"]) - ref["logits"]).max() <= TOLERANCE
        np.testing.assert_array_equal(got["tokens"], ref["tokens"])


def test_mesh_and_rules_on_one_device():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"dp": 1, "tp": 1}
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        qkv_bias=True,
    )
    shardings = param_shardings(cfg, mesh)
    assert str(shardings["layers"]["wo"].spec) == "P(None, 'tp', None)"
    assert str(shardings["layers"]["bk"].spec) == "P(None, 'tp')"
    assert str(shardings["lm_head"].spec) == "P(None, 'tp')"


def test_clear_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(tp=8, dp=2)
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=24,
        num_layers=1,
        num_heads=12,
        num_kv_heads=3,
        head_dim=4,
    )
    check_divisible(cfg, AbstractMesh((1, 3), ("dp", "tp")))
    check_divisible(cfg, AbstractMesh((1, 6), ("dp", "tp")))  # each kv head replicated on 2 devices
    with pytest.raises(ValueError, match="num_kv_heads=3 to divide tp"):
        check_divisible(cfg, AbstractMesh((1, 2), ("dp", "tp")))
    with pytest.raises(ValueError, match="num_heads divisible by 8"):
        check_divisible(cfg, AbstractMesh((1, 8), ("dp", "tp")))


def test_cli_helpers():
    p = argparse.ArgumentParser()
    add_parallel_arguments(p)
    assert mesh_from_args(p.parse_args([])) is None
    with pytest.raises(ValueError, match="needs 2 devices"):
        mesh_from_args(p.parse_args(["--tp", "2"]))
