"""Tensor-parallel checks that need several (fake CPU) devices, run in a subprocess by test_parallel.py.

    python tests/parallel_worker.py meshes OUT.json TP:DP ...          # needs 8 fake devices (set by the caller)
    python tests/parallel_worker.py armt OUT.json TP:DP ...            # ARMT schedules on those meshes
    python tests/parallel_worker.py armt_published OUT.json TP:DP ...  # the published ARMT cell on them
    python tests/parallel_worker.py kv_replicas OUT.json tokens|logits K:TP ...  # tp past the kv heads K
    python tests/parallel_worker.py process PORT NPROC RANK CKPT OUT.json  # one process of a multi-process run

Each command writes its measurements as JSON; the test compares them with single-device results.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_armt_utils import TinyTokenizer

import jaxlongctx
from jaxlongctx.config import ModelConfig
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.model.attention_strategies import SlotAttention
from jaxlongctx.model.llama import forward_hidden, positions_from_mask
from jaxlongctx.parallel import make_mesh, shard_model
from jaxlongctx.sharding import cache_sharding, put_batch

# GQA (2 q heads per kv head) that splits over tp up to 8; biases check "bias added once".
CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=8,
    qkv_bias=True,
    o_bias=True,
    eos_token_id=2,
)
# Tied embeddings + q/k norm (Qwen3-like), for the sharded loading path.
TIED = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    qk_norm=True,
    tie_word_embeddings=True,
    model_type="qwen3",
)
NEW_TOKENS = 4
GREEDY = jaxlongctx.SamplingParams(NEW_TOKENS, stop_ids=())  # exactly NEW_TOKENS greedy tokens
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def make_model(config: ModelConfig = CFG, seed: int = 1) -> jaxlongctx.Model:
    """A random model whose biases and norms are random too (so "added once" is visible)."""
    model = jaxlongctx.Model.init(config, seed=seed)
    graphdef, state = nnx.split(model.module)
    pure = nnx.to_pure_dict(state)
    rng = np.random.default_rng(seed)
    for name in ("bq", "bk", "bv", "bo", "input_norm", "post_norm", "q_norm", "k_norm"):
        if name in pure["layers"]:
            leaf = pure["layers"][name]
            pure["layers"][name] = jnp.asarray(
                rng.normal(1.0 if "norm" in name else 0.0, 0.1, leaf.shape), leaf.dtype
            )
    nnx.replace_by_pure_dict(state, pure)
    return jaxlongctx.Model(nnx.merge(graphdef, state))


def sample_inputs(config: ModelConfig = CFG) -> tuple[np.ndarray, np.ndarray]:
    """A padded batch of 4 prompts (row 1 left-padded)."""
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (4, 9)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, :3] = False
    return ids, mask


def long_inputs(config: ModelConfig = CFG) -> tuple[np.ndarray, np.ndarray]:
    """A padded batch of 4 prompts longer than the 32 tokens that choose observed ones (row 1 left-padded)."""
    ids = np.random.default_rng(7).integers(3, config.vocab_size, (4, 44)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, :3] = False
    return ids, mask


def reference(config: ModelConfig = CFG) -> dict[str, Any]:
    """Single-device logits and greedy tokens (no mesh at all)."""
    model, (ids, mask) = make_model(config), sample_inputs(config)
    return {
        "logits": np.asarray(model(ids, mask)),
        "tokens": jaxlongctx.generate(model, ids, GREEDY, attention_mask=mask),
    }


def device0_param_bytes(model: jaxlongctx.Model) -> int:
    """Parameter bytes held by the first device of the model's mesh."""
    device = model.mesh.devices.flat[0]
    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(model.params)
        for s in leaf.addressable_shards
        if s.device == device
    )


def replicated_param_bytes(model: jaxlongctx.Model) -> int:
    """Bytes of the parameters that stay whole on every device (norms, output bias)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model.params) if leaf.sharding.is_fully_replicated)


def layer_collectives(model: jaxlongctx.Model) -> dict[str, int]:
    """Collectives in the compiled HLO of one decoder layer (norm, q/k/v, attention, output, MLP)."""
    graphdef, state = nnx.split(model.module.layers)
    first = jax.tree.map(lambda x: x[0], state)
    ids, mask = sample_inputs()
    h = put_batch(np.ones((*ids.shape, CFG.hidden_size), np.float32), model.mesh)
    mask = put_batch(mask, model.mesh)

    def one_layer(layer_state, h, mask):
        layer = nnx.merge(graphdef, layer_state)
        cos, sin = model.module.rope(positions_from_mask(mask))
        slots = jnp.broadcast_to(jnp.arange(mask.shape[1]), mask.shape)
        return layer(h, cos, sin, SlotAttention(slots, mask))[0]

    hlo = jax.jit(one_layer).lower(first, h, mask).compile().as_text()
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def forward_collectives(model: jaxlongctx.Model) -> dict[str, Any]:
    """Collectives in the compiled full forward (embedding, scanned layers, head), and the shapes
    the all-gathers produce (only the logits should be gathered, never a weight)."""
    ids, mask = (put_batch(x, model.mesh) for x in sample_inputs())
    hlo = model._forward.lower(model.params, ids, mask).compile().as_text()
    counts: dict[str, Any] = {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}
    counts["all_gather_shapes"] = re.findall(r"= (\S+?)\{[^}]*\} all-gather(?:-start)?\(", hlo)
    return counts


def prefill_cache(model: jaxlongctx.Model) -> DenseCache:
    """The dense KV cache that prefill builds on the model's mesh (checked to be laid out as `cache_sharding`)."""
    ids, mask = sample_inputs(model.config)

    def fill(params, ids, mask):
        _, (k, v) = forward_hidden(model.merge(params), ids, mask, collect_kv=True)
        return DenseCache.from_prefill(k, v, mask, 16)

    cache = jax.jit(fill)(model.params, put_batch(ids, model.mesh), put_batch(mask, model.mesh))
    assert cache.k.sharding.is_equivalent_to(cache_sharding(model.mesh), cache.k.ndim), cache.k.sharding
    return cache


def prefill_cache_spec(model: jaxlongctx.Model) -> str:
    """PartitionSpec of the dense KV cache that prefill builds on the model's mesh."""
    return str(prefill_cache(model).k.sharding.spec)


def run_meshes(meshes: list[tuple[int, int]]) -> dict[str, Any]:
    """Logits, greedy tokens and per-device memory on each (tp, dp) mesh, against one device."""
    base = make_model()
    ref = reference()
    ids, mask = sample_inputs()
    out: dict[str, Any] = {"total_param_bytes": base.param_bytes(), "meshes": []}
    for tp, dp in meshes:
        model = shard_model(base, make_mesh(tp=tp, dp=dp))
        logits = model(ids, mask)
        tokens = jaxlongctx.generate(model, ids, GREEDY, attention_mask=mask)
        out["meshes"].append(
            {
                "tp": tp,
                "dp": dp,
                "logit_max_diff": float(np.abs(np.asarray(logits) - ref["logits"]).max()),
                "tokens_equal": bool((tokens == ref["tokens"]).all()),
                "device0_param_bytes": device0_param_bytes(model),
                "replicated_param_bytes": replicated_param_bytes(model),
                "wq_spec": str(model.module.layers.wq[...].sharding.spec),
            }
        )
    tp4 = shard_model(base, make_mesh(tp=4))
    out["layer_collectives_tp4"] = layer_collectives(tp4)
    out["forward_collectives_tp4"] = forward_collectives(tp4)
    out["cache_spec_2x2"] = prefill_cache_spec(shard_model(base, make_mesh(tp=2, dp=2)))
    out["loading"] = check_sharded_loading()
    out["pq_attention"] = check_pq_attention()
    out["pq_generate"] = check_pq_generation(base, meshes)
    return out


def pq_teacher_forced(
    model: jaxlongctx.Model,
    codebooks: Any,
    ids: np.ndarray,
    mask: np.ndarray,
    forced: np.ndarray,
    window: int,
    sinks: int = 0,
    observed: int = 0,
) -> tuple[np.ndarray, Any]:
    """Logits `[B, 1 + steps, V]` of a PQ prefill (its first `sinks` and `observed` attended-to prompt
    tokens exact) then decode steps fed `forced` `[B, steps]` (several window flushes), and the final
    cache, on the model's mesh (or none)."""
    from jaxlongctx.pq_generate import place_codebooks, pq_decode_hidden, pq_prefill

    capacity = ids.shape[1] + forced.shape[1] + window

    def run(params, placed, ids, mask, forced):
        module, (k_cent, v_cent, k_w, v_w) = model.merge(params), placed
        logits, cache = pq_prefill(
            module, k_cent, v_cent, capacity, window, False, ids, mask, sinks, observed, k_w, v_w
        )
        positions = mask.sum(axis=1)

        def step(cache, xs):  # one forced token [B] at offset i
            token, i = xs
            h, cache = pq_decode_hidden(
                module, k_cent, v_cent, token[:, None], (positions + i)[:, None], cache,
                recent=window, k_weights=k_w, v_weights=v_w,
            )  # fmt: skip
            return cache, module.head(h)[:, 0]

        cache, steps = jax.lax.scan(step, cache, (forced.T, jnp.arange(forced.shape[1])))
        return jnp.concatenate([logits[:, None], steps.swapaxes(0, 1)], axis=1), cache

    placed = place_codebooks(codebooks, model.mesh)
    logits, cache = jax.jit(run)(
        model.params, placed, *(put_batch(x, model.mesh) for x in (ids, mask, forced))
    )
    return np.asarray(logits), cache


def check_pq_generation(base: jaxlongctx.Model, meshes: list[tuple[int, int]]) -> dict[str, Any]:
    """PQ-cache decoding (layer_head codebooks; shared ones on 2x2; attention-weighted layer_head and
    layer ones with pinned sink and observed prompt tokens) on `meshes` vs one device: teacher-forced
    logits, greedy tokens, and the code buffers split over batch and kv heads."""
    from jaxlongctx.kvcache.calibrate import calibrate

    short, long = sample_inputs(), long_inputs()
    stream = np.random.default_rng(5).integers(3, CFG.vocab_size, 2048)
    window = 4
    cases = (  # name, granularity, weighting, sinks, observed, inputs, meshes
        ("layer_head", "layer_head", "none", 0, 0, short, meshes),
        ("shared", "shared", "none", 0, 0, short, [(2, 2)]),
        ("layer_head weighted pinned", "layer_head", "attention", 2, 3, long, meshes),
        ("layer weighted pinned", "layer", "attention", 2, 3, long, [(2, 2)]),
    )
    out: dict[str, Any] = {}
    for name, granularity, weighting, sinks, observed, (ids, mask), case_meshes in cases:
        forced = np.random.default_rng(6).integers(3, CFG.vocab_size, (ids.shape[0], 10)).astype(np.int32)
        cb = calibrate(
            base, stream, ds=2, bits=4, granularity=granularity, iters=4, seq_len=64, max_tokens=1024,
            weighting=weighting,
        )  # fmt: skip
        generate = lambda m: jaxlongctx.generate(
            m,
            ids,
            jaxlongctx.SamplingParams(NEW_TOKENS + window, stop_ids=()),
            cache=jaxlongctx.PQKV(
                cb, window=window, keep_prompt_tail_exact=False, sinks=sinks, observed=observed
            ),
            attention_mask=mask,
        )
        forced_run = lambda m: pq_teacher_forced(m, cb, ids, mask, forced, window, sinks, observed)
        want_logits, want_cache = forced_run(base)
        want_tokens = generate(base)
        for tp, dp in case_meshes:
            model = shard_model(base, make_mesh(tp=tp, dp=dp))
            logits, cache = forced_run(model)
            shard = cache.k_codes.addressable_shards[0].data.shape
            out[f"{name} dp{dp}xtp{tp}"] = {
                "logit_max_diff": float(np.abs(logits - want_logits).max()),
                "tokens_equal": bool((generate(model) == want_tokens).all()),
                "codes_equal": bool((np.asarray(cache.k_codes) == np.asarray(want_cache.k_codes)).all()),
                "window_max_diff": float(
                    np.abs(np.asarray(cache.k_window) - np.asarray(want_cache.k_window)).max()
                ),
                "codes_spec": str(cache.k_codes.sharding.spec),
                "codes_shard_fraction": [a // b for a, b in zip(cache.k_codes.shape, shard)],
                "lengths_after": np.asarray(cache.lengths).tolist(),
                "pinned": np.asarray(cache.pinned_counts()).tolist(),
            }
    return out


def check_sharded_loading() -> dict[str, Any]:
    """Save a tied-embedding model, export it to HF, and load both with `mesh=`: shards and logits."""
    from convert.hf_llama import export_ckpt_to_hf
    from jaxlongctx.checkpoint import save_model

    model = make_model(TIED)
    ids, mask = sample_inputs(TIED)
    want = np.asarray(model(ids, mask))
    mesh = make_mesh(tp=2, dp=2)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_model(model.module, Path(tmp) / "ckpt")
        hf = export_ckpt_to_hf(ckpt, Path(tmp) / "hf")
        for name, path in (("checkpoint", ckpt), ("hf", hf)):
            loaded = jaxlongctx.load(path, mesh=mesh)
            result[name] = {
                "embed_spec": str(loaded.module.embed[...].sharding.spec),
                "w_down_spec": str(loaded.module.layers.w_down[...].sharding.spec),
                "embed_shard_shape": list(loaded.module.embed[...].addressable_shards[0].data.shape),
                "logit_max_diff": float(np.abs(np.asarray(loaded(ids, mask)) - want).max()),
            }
    return result


def check_pq_attention() -> dict[str, Any]:
    """The PQ decode kernel under shard_map on a 2x2 mesh (kv heads over tp, batch over dp) vs one device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxlongctx.sharding import sharded_pq_decode_attention

    rng = np.random.default_rng(0)
    b, kv, group, hd, ds, cap, window, cents = 4, 4, 2, 16, 2, 24, 4, 16
    m = hd // ds
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    codes = lambda: rng.integers(0, cents, (b, kv, cap, m)).astype(np.uint8)
    host = (
        normal(b, kv * group, hd),
        codes(),
        codes(),
        normal(kv, m, cents, ds),
        normal(kv, m, cents, ds),
        np.array([0, 7, 24, 13], np.int32),
        normal(b, kv, window, hd),
        normal(b, kv, window, hd),
        np.array([1, 4, 2, 3], np.int32),
    )
    mesh = make_mesh(tp=2, dp=2)
    specs = (
        P("dp", "tp", None),
        P("dp", "tp", None, None),
        P("dp", "tp", None, None),
        P("tp", None, None, None),
        P("tp", None, None, None),
        P("dp"),
        P("dp", "tp", None, None),
        P("dp", "tp", None, None),
        P("dp"),
    )
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(host, specs)]
    out: dict[str, Any] = {}
    for backend in ("xla", "interpret"):
        fn = jax.jit(lambda *a, be=backend: sharded_pq_decode_attention(*a, hd**-0.5, backend=be))
        want = np.asarray(fn(*[jnp.asarray(x) for x in host]))  # no mesh: the kernel called directly
        got = fn(*placed)
        hlo = fn.lower(*placed).compile().as_text()
        out[backend] = {
            "max_diff": float(np.abs(np.asarray(got) - want).max()),
            "out_spec": str(got.sharding.spec),
            "collectives": sum(len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in COLLECTIVES),
        }
    return out


def run_armt(meshes: list[tuple[int, int]]) -> dict[str, Any]:
    """ARMT sequential and diagonal schedules (random memory weights, a padded batch of 4 rows) on
    each (tp, dp) mesh vs one device, and how the memory weights and state are laid out."""
    from jaxlongctx.armt import ARMTConfig, ARMTModel
    from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS

    armt_cfg = ARMTConfig(segment_size=8, num_mem_tokens=4, d_mem=8)
    ids = np.random.default_rng(0).integers(3, CFG.vocab_size, (4, 27)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, 20:] = mask[3, :5] = False
    base = make_model()

    def armt(model: jaxlongctx.Model, segmentation: str = "fixed"):
        armt = ARMTModel.wrap(model, armt_cfg, jax.random.key(0)).randomize_memory_params(
            jax.random.key(1), 0.5
        )
        armt.cpu_execution = PIPELINE_ALWAYS  # these short inputs would otherwise run in sequential order
        if segmentation == "sentences":  # every 7th id ends a sentence, so the rows are cut apart
            armt.tokenizer = TinyTokenizer(CFG.vocab_size, periods=tuple(range(3, CFG.vocab_size, 7)))
            armt.segmentation = segmentation
        return armt

    def stream(model) -> np.ndarray:  # chunks of 10 tokens, then a flush: logits of row 0
        state, rows = model.init_state(ids.shape[0]), []
        for start in range(0, ids.shape[1], 10):
            state, out = model.feed(state, ids[:, start : start + 10])
            rows.append(np.asarray(out[0]))
        rows.append(np.asarray(model.flush(state)[1][0]))
        return np.concatenate(rows)

    plain = armt(base)
    want = {s: plain.run(ids, mask, schedule=s) for s in ("sequential", "diagonal")}
    want_tokens = jaxlongctx.generate(plain, ids, GREEDY, attention_mask=mask)
    want_stream = stream(plain)
    sentences = armt(base, "sentences")
    want_sentences = (
        sentences(ids, mask),
        jaxlongctx.generate(sentences, ids, GREEDY, attention_mask=mask),
        stream(sentences),
    )
    out: dict[str, Any] = {}
    for tp, dp in meshes:
        model = armt(shard_model(base, make_mesh(tp=tp, dp=dp)))
        row: dict[str, Any] = {"wv_spec": str(model.memory.wv[...].sharding.spec)}
        for schedule, (logits, state) in want.items():
            got_logits, got_state = model.run(ids, mask, schedule=schedule)
            row[schedule] = float(np.abs(np.asarray(got_logits) - np.asarray(logits)).max())
            row[f"{schedule}_A_rel"] = float(
                np.abs(np.asarray(got_state.A) - np.asarray(state.A)).max()
                / np.abs(np.asarray(state.A)).max()
            )
            row["A_spec"] = str(got_state.A.sharding.spec)
        row["tokens_equal"] = bool(
            (jaxlongctx.generate(model, ids, GREEDY, attention_mask=mask) == want_tokens).all()
        )
        row["stream"] = float(np.abs(stream(model) - want_stream).max())
        model = armt(shard_model(base, make_mesh(tp=tp, dp=dp)), "sentences")  # segments cut after sentences
        row["sentences_diagonal"] = float(
            np.abs(np.asarray(model(ids, mask)) - np.asarray(want_sentences[0])).max()
        )
        row["sentences_tokens_equal"] = bool(
            (jaxlongctx.generate(model, ids, GREEDY, attention_mask=mask) == want_sentences[1]).all()
        )
        row["sentences_stream"] = float(np.abs(stream(model) - want_sentences[2]).max())
        out[f"dp{dp}xtp{tp}"] = row
    with tempfile.TemporaryDirectory() as tmp:  # an ARMT checkpoint restored straight into its shards
        loaded = jaxlongctx.load(plain.save(Path(tmp) / "armt"), mesh=make_mesh(tp=2, dp=2))
        logits, _ = loaded.run(ids, mask, schedule="diagonal")
        out["loaded_2x2"] = {
            "wv_spec": str(loaded.memory.wv[...].sharding.spec),
            "wq_spec": str(loaded.base.module.layers.wq[...].sharding.spec),
            "diagonal": float(np.abs(np.asarray(logits) - np.asarray(want["diagonal"][0])).max()),
        }
    out["sentences_differ_from_grid"] = float(
        np.abs(np.asarray(want_sentences[0]) - np.asarray(want["diagonal"][0])).max()
    )
    return out


def run_armt_published(meshes: list[tuple[int, int]]) -> dict[str, Any]:
    """The published ARMT cell (sink, sliding window, 2 memory heads) with 2 kv heads on tp meshes up
    to and past the kv-head count (kv heads replicated) vs one device: both schedules on a padded
    batch, greedy tokens, and how the window K/V is split."""
    from jaxlongctx.armt import ARMTConfig, ARMTModel
    from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS

    config = dataclasses.replace(CFG, num_heads=8, num_kv_heads=2, qkv_bias=False, o_bias=False)
    armt_cfg = ARMTConfig(
        segment_size=4,
        num_mem_tokens=2,
        d_mem=8,
        sink=True,
        sliding_window=True,
        normalize_features=True,
        gamma_eps=0.0,
        mem_heads=2,
    )
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (4, 13)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, 9:] = mask[3, :3] = False
    base = make_model(config)

    def armt(model: jaxlongctx.Model) -> ARMTModel:
        out = ARMTModel.wrap(model, armt_cfg, jax.random.key(0)).randomize_memory_params(
            jax.random.key(1), 0.5
        )
        out.cpu_execution = PIPELINE_ALWAYS
        return out

    plain = armt(base)
    want = {s: np.asarray(plain(ids, mask, schedule=s)) for s in ("sequential", "diagonal")}
    want_tokens = jaxlongctx.generate(plain, ids, GREEDY, attention_mask=mask)
    out: dict[str, Any] = {}
    for tp, dp in meshes:
        model = armt(shard_model(base, make_mesh(tp=tp, dp=dp)))
        row: dict[str, Any] = {}
        for schedule, logits in want.items():
            got, state = model.run(ids, mask, schedule=schedule)
            row[schedule] = float(np.abs(np.asarray(got) - logits).max())
            row["wk_spec"] = str(state.wk.sharding.spec)
        row["tokens_equal"] = bool(
            (jaxlongctx.generate(model, ids, GREEDY, attention_mask=mask) == want_tokens).all()
        )
        out[f"dp{dp}xtp{tp}"] = row
    return out


def run_kv_replicas(combos: list[tuple[int, int]], tokens: bool) -> dict[str, Any]:
    """For each (kv heads K, tp): a 16-head model with K kv heads on a tp mesh (kv heads replicated when
    tp > K) against one device: dense logits, PQ teacher-forced logits (also with pinned sink and observed
    prompt tokens), ARMT diagonal logits (and greedy tokens of dense, PQ and ARMT if `tokens`), and how many
    kv heads each device holds in the caches."""
    from jaxlongctx.armt import ARMTConfig, ARMTModel
    from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS
    from jaxlongctx.kvcache.calibrate import calibrate

    window, out = 4, {}
    forced = np.random.default_rng(6).integers(3, CFG.vocab_size, (4, 6)).astype(np.int32)

    def outputs(model: jaxlongctx.Model, codebooks: Any) -> dict[str, Any]:
        """name -> (logits, greedy tokens or None) for dense, PQ and ARMT, and the ARMT model and PQ cache."""
        ids, mask = sample_inputs(model.config)
        armt = ARMTModel.wrap(model, ARMTConfig(segment_size=4, num_mem_tokens=2, d_mem=4), jax.random.key(0))
        armt.cpu_execution = PIPELINE_ALWAYS  # this short input would otherwise run in sequential order
        armt.randomize_memory_params(jax.random.key(1), 0.5)
        pq = {"cache": jaxlongctx.PQKV.bare(codebooks, window=window)}
        greedy = lambda m, **kw: (
            jaxlongctx.generate(m, ids, GREEDY, attention_mask=mask, **kw) if tokens else None
        )
        pq_logits, pq_cache = pq_teacher_forced(model, codebooks, ids, mask, forced, window)
        long_ids, long_mask = long_inputs(model.config)  # 2 sinks and 3 observed tokens pinned
        pinned_logits, _ = pq_teacher_forced(model, codebooks, long_ids, long_mask, forced, window, 2, 3)
        armt_logits, armt_state = armt.run(ids, mask)
        return {
            "dense": (np.asarray(model(ids, mask)), greedy(model)),
            "pq": (pq_logits, greedy(model, **pq)),
            "pq_pinned": (pinned_logits, None),
            "armt": (np.asarray(armt_logits), greedy(armt)),
            "pq_cache": pq_cache,
            "armt_state": armt_state,
        }

    for kv in sorted({k for k, _ in combos}):
        base = make_model(dataclasses.replace(CFG, num_kv_heads=kv, num_layers=1))
        cb = calibrate(
            base,
            np.random.default_rng(5).integers(3, CFG.vocab_size, 512),
            ds=2,
            bits=4,
            granularity="layer_head",
            iters=2,
            seq_len=64,
            max_tokens=256,
        )
        want = outputs(base, cb)
        for tp in (t for k, t in combos if k == kv):
            model = shard_model(base, make_mesh(tp=tp))
            got = outputs(model, cb)
            row: dict[str, Any] = {
                "mesh": dict(model.mesh.shape),
                "wq_spec": str(model.module.layers.wq[...].sharding.spec),
                "wk_spec": str(model.module.layers.wk[...].sharding.spec),
                "wv_local_heads": model.module.layers.wv[...].addressable_shards[0].data.shape[-1]
                // CFG.head_dim,
                "dense_cache_local_heads": prefill_cache(model).k.addressable_shards[0].data.shape[2],
                "pq_codes_local_heads": got["pq_cache"].k_codes.addressable_shards[0].data.shape[2],
                "armt_A_spec": str(got["armt_state"].A.sharding.spec),
            }
            for name in ("dense", "pq", "pq_pinned", "armt"):
                row[f"{name}_logit_max_diff"] = float(np.abs(got[name][0] - want[name][0]).max())
                if tokens and want[name][1] is not None:
                    row[f"{name}_tokens_equal"] = bool((got[name][1] == want[name][1]).all())
            out[f"kv{kv}xtp{tp}"] = row
    return out


def run_process(port: int, nproc: int, rank: int, ckpt: str) -> dict[str, Any]:
    """One process of a multi-process run: load `ckpt` with tp over every process's devices (each
    process restoring only its shards), then logits + greedy tokens."""
    from jaxlongctx.distributed import initialize

    address = f"127.0.0.1:{port}"
    initialize(address, nproc, rank, bind_address=address, timeout_s=120)
    model = jaxlongctx.load(ckpt, mesh=make_mesh(tp=len(jax.devices())))
    ids, mask = sample_inputs()
    logits = np.asarray(model(ids, mask))
    tokens = jaxlongctx.generate(model, ids, GREEDY, attention_mask=mask)
    return {
        "process": jax.process_index(),
        "global_devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "logits": logits.tolist(),
        "tokens": tokens.tolist(),
        "wq_local_shape": list(model.module.layers.wq[...].addressable_shards[0].data.shape),
    }


def main(argv: list[str]) -> None:
    """Dispatch a worker command and write its JSON result."""
    pairs = lambda args: [tuple(int(x) for x in a.split(":")) for a in args]  # "a:b" -> (a, b)
    if argv[0] in ("meshes", "armt", "armt_published"):  # OUT TP:DP...
        run = {"meshes": run_meshes, "armt": run_armt, "armt_published": run_armt_published}[argv[0]]
        result, out = run(pairs(argv[2:])), argv[1]
    elif argv[0] == "kv_replicas":
        combos = pairs(argv[3:])
        result, out = run_kv_replicas(combos, argv[2] == "tokens"), argv[1]
    elif argv[0] == "process":
        port, nproc, rank = (int(x) for x in argv[1:4])
        result, out = run_process(port, nproc, rank, argv[4]), argv[5]
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
