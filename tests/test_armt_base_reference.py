"""Memory-only ARMT checkpoints: they name their base (path or package resource + fingerprint), load
it back through `jaxlongctx.load` and refuse a different or missing base."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.armt import ARMTConfig, ARMTModel
from jaxlongctx.armt.base_reference import (
    BaseReference,
    describe_base,
    resolve_base_argument,
    source_fingerprint,
)
from jaxlongctx.checkpoint import CheckpointError, save_model
from jaxlongctx.model.model import Model
from jaxlongctx.pretrained import SMOLLM2_FILE, smollm2_gguf
from tests.test_armt_utils import tiny_config


def _armt_on(base_dir, seed: int = 0) -> ARMTModel:
    """An ARMT model with random memory on the base checkpoint at `base_dir`."""
    base = jaxlongctx.load(base_dir)
    armt = ARMTModel.wrap(base, ARMTConfig(8, 4, d_mem=8), jax.random.key(seed))
    return armt.randomize_memory_params(jax.random.key(seed + 1))


def _assert_same_params(a: ARMTModel, b: ARMTModel) -> None:
    """Every base and memory parameter of `a` equals `b`'s, bit for bit (so do their outputs)."""
    assert a.armt == b.armt and a.config == b.config
    flat_a, flat_b = jax.tree.leaves_with_path(a.params), jax.tree.leaves_with_path(b.params)
    assert [k for k, _ in flat_a] == [k for k, _ in flat_b]
    for (name, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(name))


def test_memory_only_checkpoint_round_trips_and_refuses_another_base(tmp_path):
    base_dir = save_model(Model.init(tiny_config(2), seed=0, dtype=jnp.float32).module, tmp_path / "base")
    armt = _armt_on(base_dir)
    reference = describe_base(base_dir)
    assert reference.kind == "path" and reference.where == str(base_dir.absolute())
    assert reference.fingerprint == source_fingerprint(base_dir)
    armt.save(tmp_path / "armt", base_reference=reference, training_record={"runs": [{"steps": 1}]})

    stored = {p.name for p in (tmp_path / "armt").iterdir()}
    assert "params" not in stored and "armt_memory" in stored  # no copy of the base weights
    meta = json.loads((tmp_path / "armt/config.json").read_text())
    assert BaseReference.from_dict(meta["base"]) == reference and meta["memory_dtype"] == "float32"
    assert json.loads((tmp_path / "armt/training.json").read_text())["runs"] == [{"steps": 1}]

    loaded = jaxlongctx.load(tmp_path / "armt")
    assert isinstance(loaded, ARMTModel) and loaded.base_reference == reference
    _assert_same_params(loaded, armt)
    with pytest.raises(CheckpointError, match=r"load it with jaxlongctx\.load"):
        ARMTModel.load(tmp_path / "armt")

    # the same path now holds other weights: refused, naming both fingerprints
    save_model(Model.init(tiny_config(2), seed=1, dtype=jnp.float32).module, base_dir, overwrite=True)
    other = source_fingerprint(base_dir)
    with pytest.raises(CheckpointError, match="a different base") as err:
        jaxlongctx.load(tmp_path / "armt")
    assert reference.fingerprint in str(err.value) and other in str(err.value)
    shutil.rmtree(base_dir)
    with pytest.raises(CheckpointError, match="is missing"):
        jaxlongctx.load(tmp_path / "armt")


def test_full_checkpoints_still_hold_their_base(tmp_path):
    base_dir = save_model(Model.init(tiny_config(2), seed=0, dtype=jnp.float32).module, tmp_path / "base")
    armt = _armt_on(base_dir)
    armt.save(tmp_path / "armt")
    shutil.rmtree(base_dir)  # a full checkpoint needs nothing else
    loaded = jaxlongctx.load(tmp_path / "armt")
    assert loaded.base_reference is None and (tmp_path / "armt/params").is_dir()
    _assert_same_params(loaded, armt)


def test_smollm2_is_referenced_as_a_package_resource(tmp_path):
    path = resolve_base_argument("smollm2")
    assert path == smollm2_gguf()
    reference = describe_base(path)
    assert reference.kind == "package_resource" and reference.where.endswith(SMOLLM2_FILE)
    assert reference.locate() == path and reference.fingerprint.startswith("sha256:")
    copy = tmp_path / "copy.gguf"
    with open(copy, "wb") as f:  # the same bytes elsewhere: a path reference, the same fingerprint
        f.write(path.read_bytes())
    assert describe_base(copy) == BaseReference("path", str(copy), reference.fingerprint)
    with pytest.raises(CheckpointError, match="not installed"):
        BaseReference("package_resource", "no_such_package/x.gguf", reference.fingerprint).locate()
    with pytest.raises(CheckpointError, match="kind"):
        BaseReference.from_dict({"kind": "url", "where": "x", "fingerprint": "y"})
