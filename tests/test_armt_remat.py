"""Rematerialised cells (`ARMTModel.remat`, for training): the same logits, memory and gradients in both
schedules, with the cells really wrapped in `jax.checkpoint`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_armt_utils import VOCAB, make_armt

from jaxlongctx.armt.segments import compact, segment


def _loss_fn(armt, segs, schedule):
    def loss(params):
        state, logits = armt.run_segments(params, segs, schedule)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(segs.ids)[..., None], -1)), state

    return loss


@pytest.mark.parametrize("schedule", ["sequential", pytest.param("diagonal", marks=pytest.mark.slow)])
def test_remat_changes_nothing_but_what_is_kept(schedule):
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, 20))  # 3 segments of 8 over 2 layers
    results = []
    for remat in (False, True):
        armt = make_armt(layers=2)  # a model per setting: compiled schedules are cached per model object
        armt.remat = remat
        segs = segment(*compact(ids, np.ones(ids.shape, bool))[:2], armt.armt.segment_size)
        loss = _loss_fn(armt, segs, schedule)
        program = str(jax.make_jaxpr(jax.grad(lambda p: loss(p)[0]))(armt.params))
        assert ("checkpoint" in program or "remat" in program) == remat
        (value, state), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(armt.params)
        results.append((value, state, grads))
    (v0, s0, g0), (v1, s1, g1) = results
    assert float(jnp.abs(s0.A).max()) > 0  # the memory was written
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves((s1, g1)), jax.tree.leaves((s0, g0)), strict=True):
        # the same arithmetic, fused differently: equal up to float reassociation
        assert float(jnp.linalg.norm(a - b)) <= 1e-5 * float(jnp.linalg.norm(b))
