"""Loaded parameters live on the device as jax Arrays, so jitted calls never copy the weights again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlongctx
from jaxlongctx.checkpoint import save_model
from jaxlongctx.demo import ARMT_MODEL


def _assert_on_device(tree) -> None:
    leaves = jax.tree.leaves(tree)
    assert leaves
    for leaf in leaves:
        assert isinstance(leaf, jax.Array), type(leaf)
        assert leaf.committed and len(leaf.devices()) == 1


def _forward_without_host_transfers(model) -> None:
    """A jitted forward with inputs already on the device: any weight copied from the host raises."""
    ids = jax.device_put(np.array([[3, 4, 5]], np.int32))
    mask = jax.device_put(np.ones((1, 3), bool))
    with jax.transfer_guard_host_to_device("disallow"):
        jax.block_until_ready(model._forward(model.params, ids, mask))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hf_directory_loads_onto_the_device(hf_family_dir, dtype):
    model = jaxlongctx.load(hf_family_dir("llama32")[0], dtype)
    _assert_on_device(model.params)
    assert model.dtype == jnp.dtype(jnp.float32 if dtype == "fp32" else jnp.bfloat16)
    _forward_without_host_transfers(model)


def test_checkpoint_loads_onto_the_device(hf_family_dir, tmp_path):
    saved = jaxlongctx.load(hf_family_dir("llama2")[0])
    save_model(saved.module, tmp_path / "ckpt")
    model = jaxlongctx.load(tmp_path / "ckpt")
    _assert_on_device(model.params)
    _forward_without_host_transfers(model)


def test_numpy_parameters_would_be_caught(hf_family_dir):
    """The transfer guard above fails for host (numpy) parameters, so the checks can fail."""
    model = jaxlongctx.load(hf_family_dir("llama32")[0])
    host = jax.tree.map(np.asarray, model.params)
    ids, mask = jax.device_put(np.array([[3, 4]], np.int32)), jax.device_put(np.ones((1, 2), bool))
    with jax.transfer_guard_host_to_device("disallow"), pytest.raises(Exception, match=r"[Dd]isallowed"):
        model._forward(host, ids, mask)


def test_armt_checkpoint_loads_onto_the_device():
    armt = jaxlongctx.load(ARMT_MODEL, "fp32")
    _assert_on_device(armt.params)
