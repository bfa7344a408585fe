"""PQ KV cache on the real model (SmolLM2): calibration, attention-weighted codebooks, exact tokens
(recent window, sinks), the chat retrieval set and answers over a quantized prompt cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlongctx.cache_choice import PQKV, DenseKV
from jaxlongctx.data.chat_retrieval import retrieval_set
from jaxlongctx.data.tokenizer import encode_corpus
from jaxlongctx.generate import generate
from jaxlongctx.kv_quality import kv_transform
from jaxlongctx.kv_retrieval import PromptCache, answer
from jaxlongctx.kvcache.calibrate import calibrate
from jaxlongctx.kvcache.codebooks import load_codebooks, save_codebooks, train_codebooks
from jaxlongctx.kvcache.exact_window import keep_sinks_exact, recent_exact_attention
from jaxlongctx.kvcache.pq_codec import encode
from jaxlongctx.model.attention import causal_prefill_attention
from jaxlongctx.model.llama import forward_hidden
from jaxlongctx.sampling import SamplingParams


def _small_calibration(model, weighting="none"):
    return calibrate(
        model,
        encode_corpus("calibration", model.tokenizer),
        ds=4,
        bits=4,
        granularity="layer",
        iters=3,
        seq_len=128,
        max_tokens=256,
        points_per_centroid=16,
        weighting=weighting,
    )


@pytest.fixture(scope="module")
def weighted_codebooks(smollm2_fp32):
    return _small_calibration(smollm2_fp32, "attention")


def test_calibration_on_real_text_is_deterministic_and_round_trips(
    smollm2_fp32, weighted_codebooks, tmp_path
):
    a, b = weighted_codebooks, _small_calibration(smollm2_fp32, "attention")
    for name in ("key_centroids", "value_centroids", "key_weights", "value_weights"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.weighted and a.metadata["calibration_tokens"] == 256
    back = load_codebooks(save_codebooks(a, tmp_path / "cb"), expected_fingerprint=a.model_fingerprint)
    for name in ("key_centroids", "value_centroids", "key_weights", "value_weights"):
        want, got = getattr(a, name), getattr(back, name)
        assert (want is None) == (got is None)
        if want is not None:
            np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
    assert back.metadata == a.metadata


def test_pq_generation_with_a_full_exact_window_equals_dense_greedy(smollm2_fp32):
    model = smollm2_fp32
    cb = _small_calibration(model)
    ids = np.asarray(model.tokenizer.encode("The capital of France is", add_special_tokens=False).ids)[None]
    params = SamplingParams(6)
    dense = generate(model, ids, params, cache=DenseKV())
    exact = generate(model, ids, params, cache=PQKV(cb, window=64, keep_prompt_tail_exact=True))
    np.testing.assert_array_equal(dense, exact)


def test_retrieval_set_is_deterministic_and_fits_its_context(smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    a, b = retrieval_set(tok, 3, 1024), retrieval_set(tok, 3, 1024)
    assert [x.seed for x in a] == [x.seed for x in b] and len({x.seed for x in a}) == 3
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.prompt, y.prompt)
        np.testing.assert_array_equal(x.answer_prefix, y.answer_prefix)
        assert x.answer == y.answer and x.prompt.size + x.answer_prefix.size + 4 <= 1024
        assert tok.decode([int(t) for t in x.answer_ids]) == x.answer
        assert "What is the code of the" in tok.decode([int(t) for t in x.prompt])
    assert [x.depth for x in a] == [0.1, 0.3, 0.5]
    later = retrieval_set(tok, 1, 1024, first_index=3)[0]
    assert later.seed not in {x.seed for x in a}
    named = retrieval_set(tok, 1, 1024, noun="secret number")[0]  # the same fact, renamed
    assert named.answer == a[0].answer and named.prompt.size + named.answer_prefix.size + 4 <= 1024
    assert "What is the secret number of the" in tok.decode([int(t) for t in named.prompt])
    prefix = tok.decode([int(t) for t in named.answer_prefix])
    assert prefix.startswith("The secret number of the") and prefix.endswith(" is ")


@pytest.mark.slow
def test_dense_answer_over_prompt_cache_equals_greedy_generation(smollm2_fp32):
    model = smollm2_fp32
    item = retrieval_set(model.tokenizer, 1, 512)[0]
    cache = PromptCache(model, item.prompt, 512)
    digits = answer(model, cache, item, None)
    prompt = np.concatenate([item.prompt, item.answer_prefix])[None]
    greedy = generate(model, prompt, SamplingParams(4), cache=DenseKV())[0, prompt.shape[1] :]
    np.testing.assert_array_equal(digits, greedy)
    # an identity transform takes the quantized-cache path and must answer the same
    np.testing.assert_array_equal(answer(model, cache, item, lambda k, v, layer: (k, v)), digits)


def test_weighted_encode_is_the_weighted_nearest_centroid():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 8)).astype(np.float32)
    cent = rng.normal(size=(4, 16, 2)).astype(np.float32)  # M=4, C=16, ds=2
    w = rng.uniform(0.05, 20.0, size=8).astype(np.float32)
    codes = np.asarray(encode(x, cent, w))
    d = (x.reshape(50, 4, 1, 2) - cent[None]) ** 2 * w.reshape(1, 4, 1, 2)
    np.testing.assert_array_equal(codes, d.sum(-1).argmin(-1))
    assert not np.array_equal(codes, np.asarray(encode(x, cent)))  # the weights matter here


def test_weighted_training_with_uniform_weights_is_plain_training():
    rng = np.random.default_rng(1)
    keys = jnp.asarray(rng.normal(size=(2, 64, 1, 4)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(2, 64, 1, 4)), jnp.float32)
    kw = dict(ds=2, bits=3, granularity="layer", iters=2, key=jax.random.key(0), progress=False)
    plain = train_codebooks(keys, values, **kw)
    ones = jnp.full((2, 4), 4.0)  # a uniform scale changes no distance order
    weighted = train_codebooks(keys, values, **kw, key_weights=ones, value_weights=ones)
    np.testing.assert_allclose(weighted.key_centroids, plain.key_centroids, rtol=1e-5, atol=1e-6)
    assert weighted.weighted and not plain.weighted
    with pytest.raises(ValueError, match="both key_weights and value_weights"):
        train_codebooks(keys, values, **kw, key_weights=ones)
    with pytest.raises(ValueError, match="shape"):
        train_codebooks(keys, values, **kw, key_weights=jnp.ones(4), value_weights=jnp.ones(4))


def test_recent_exact_attention_between_all_quantized_and_all_exact():
    rng = np.random.default_rng(2)
    b, t, h, kv, hd = 2, 24, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, hd)), jnp.float32) for n in (h, kv, kv))
    kq, vq = k + 0.3, v - 0.2
    valid = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 5]]))
    exact = causal_prefill_attention(q, k, v, valid)
    quant = causal_prefill_attention(q, kq, vq, valid)
    np.testing.assert_allclose(recent_exact_attention(q, k, v, kq, vq, valid, t, 16), exact, atol=1e-5)
    np.testing.assert_allclose(recent_exact_attention(q, k, v, kq, vq, valid, 0, 16), quant, atol=1e-5)
    # a window of 1: query s reads its own key exactly, the earlier ones quantized
    mixed = np.asarray(recent_exact_attention(q, k, v, kq, vq, valid, 1, 16))
    s = 7
    keys = jnp.concatenate([kq[:, :s], k[:, s : s + 1]], axis=1)
    vals = jnp.concatenate([vq[:, :s], v[:, s : s + 1]], axis=1)
    one = causal_prefill_attention(q[:, : s + 1], keys, vals, valid[:, : s + 1])[:, s]
    np.testing.assert_allclose(mixed[:, s], one, atol=1e-5)


def test_sinks_stay_exact():
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.normal(size=(1, 10, 2, 4)), jnp.float32) for _ in range(2))
    shifted = keep_sinks_exact(lambda k, v, layer: (k + 1.0, v - 1.0), 3)
    kq, vq = shifted(k, v, 0)
    np.testing.assert_array_equal(kq[:, :3], k[:, :3])
    np.testing.assert_array_equal(vq[:, 3:], v[:, 3:] - 1.0)
    with pytest.raises(ValueError, match="sinks"):
        keep_sinks_exact(shifted, -1)


def test_weighted_codebooks_quantize_through_kv_transform(weighted_codebooks):
    cb = weighted_codebooks
    rng = np.random.default_rng(4)
    k = jnp.asarray(rng.normal(size=(1, 5, 3, 64)), jnp.float32)
    kq, _ = kv_transform("pq", cb)(k, k, 2)
    k_w = cb.stacked_weights()[0][2]
    from jaxlongctx.kvcache.pq_codec import decode

    codes = encode(k.transpose(0, 2, 1, 3), cb.key_centroids[2], k_w)
    np.testing.assert_allclose(kq, decode(codes, cb.key_centroids[2]).transpose(0, 2, 1, 3), atol=1e-6)


def test_pq_generation_encodes_with_the_codebooks_weights(smollm2_fp32, weighted_codebooks):
    """Attention-weighted codebooks: the PQ cache's codes are the weighted nearest centroids (not the
    plain ones), at prefill and at window flushes; generation runs on them."""
    from jaxlongctx.kvcache.pq_cache import encode_layers
    from jaxlongctx.pq_generate import pq_decode_hidden, pq_prefill

    model = smollm2_fp32
    k_cent, v_cent = weighted_codebooks.stacked()
    k_w, v_w = weighted_codebooks.stacked_weights()
    ids = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    mask = jnp.ones(ids.shape, bool)
    _, cache = pq_prefill(model.module, k_cent, v_cent, 16, 2, False, ids, mask, k_weights=k_w, v_weights=v_w)
    _h, (k, _v) = forward_hidden(model.module, ids, mask, collect_kv=True)
    k = k.transpose(0, 1, 3, 2, 4)  # [L, B, K, T, D]
    np.testing.assert_array_equal(cache.k_codes[:, :, :, :9], encode_layers(k, k_cent, k_w))
    assert not np.array_equal(cache.k_codes[:, :, :, :9], encode_layers(k, k_cent))
    step = lambda c, i: pq_decode_hidden(
        model.module, k_cent, v_cent, ids[:, i : i + 1], jnp.asarray([[9 + i]]), c, "auto", None, k_w, v_w
    )[1]
    cache = step(step(cache, 0), 1)  # the window's 2 slots full
    window_k = cache.k_window
    cache = step(cache, 2)  # flushes them first
    np.testing.assert_array_equal(cache.lengths, 11)
    np.testing.assert_array_equal(cache.k_codes[:, :, :, 9:11], encode_layers(window_k, k_cent, k_w))
    out = generate(model, np.asarray(ids), SamplingParams(2), cache=PQKV(weighted_codebooks))
    assert out.shape == (1, 11)


def _tiny_retrieval_case(observe):
    """A random 2-layer model, a 40-token prompt as a retrieval item, and its prompt cache."""
    import jaxlongctx
    from jaxlongctx.config import ModelConfig
    from jaxlongctx.data.chat_retrieval import RetrievalItem

    cfg = ModelConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
    )
    model = jaxlongctx.Model.init(cfg, seed=5)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 97, 40).astype(np.int32)
    item = RetrievalItem(prompt, rng.integers(3, 97, 3).astype(np.int32), np.zeros(4, np.int32), "", 0.5, 0)
    return model, item, PromptCache(model, prompt, 64, observe=observe)


def test_recent_exact_prompt_tokens_bypass_the_transform():
    """Answers over a destroyed prompt cache with every prompt token in the exact recent window equal
    the dense answers; with none exact they are the destroyed cache's."""
    model, item, cache = _tiny_retrieval_case(observe=0)
    scramble = lambda k, v, layer: (-3.0 * k[..., ::-1, :, :], jnp.flip(v, axis=2) * 0.0)
    dense = answer(model, cache, item, None)
    np.testing.assert_array_equal(answer(model, cache, item, scramble, recent_exact=item.prompt.size), dense)
    assert not np.array_equal(answer(model, cache, item, scramble), dense)


def test_observing_prefill_returns_the_last_tokens_queries():
    """The observing prefill gives the plain prefill's keys/values and, as observed queries, the first
    layer's post-RoPE queries of the prompt's last tokens (projected here from the embeddings)."""
    from jaxlongctx.model.llama import positions_from_mask

    model, item, cache = _tiny_retrieval_case(observe=8)
    plain = PromptCache(model, item.prompt, 64)
    np.testing.assert_allclose(cache.k, plain.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cache.v, plain.v, rtol=1e-6, atol=1e-6)
    assert cache.q_observed.shape == (2, 1, 8, 4, 12)
    n = item.prompt.size
    module = model.merge(model.params)
    ids = jnp.zeros((1, 64), jnp.int32).at[0, :n].set(jnp.asarray(item.prompt))
    cos, sin = module.rope(positions_from_mask(cache.mask))
    h = module.embed_ids(ids)
    _, queries = module.scan_layers(lambda layer, c, _: (c, layer._project_qkv(h, cos, sin)[0]), None)
    np.testing.assert_allclose(cache.q_observed[0], queries[0][:, n - 8 : n], rtol=1e-5, atol=1e-5)
    assert not np.allclose(cache.q_observed[1], queries[1][:, n - 8 : n], atol=1e-3)  # layer 1 sees layer 0


def test_observed_exact_mask_keeps_the_most_attended_keys():
    """A key the observed queries point at is chosen with its pooled neighbours, `keep` per row and kv
    head, never at or after the first observed slot."""
    from jaxlongctx.kvcache.observed_tokens import observed_exact_mask, observed_slots

    rows = jnp.asarray([[1] * 6 + [0] * 2, [1] * 8, [0, 1, 1, 0, 1, 1, 0, 0]], bool)
    np.testing.assert_array_equal(observed_slots(rows, 3), [[3, 4, 5], [5, 6, 7], [2, 4, 5]])
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((2, 50, 2, 8)) * 0.1, jnp.float32)  # [B, S, K, hd]
    target = jnp.zeros(8).at[0].set(1.0)
    k = k.at[0, 17, 1].set(target * 10).at[1, 3, 0].set(target * 10)  # row 0 head 1 at 17, row 1 head 0 at 3
    q = jnp.broadcast_to(target * 10, (2, 4, 4, 8))  # [B, W, H, hd]: every head looks for `target`
    start = jnp.asarray([40, 45])
    candidates = jnp.arange(50)[None] < start[:, None]
    mask = observed_exact_mask(q, k, candidates, keep=5, span=(1, 1))  # [B, S, K]
    assert mask.shape == (2, 50, 2)
    np.testing.assert_array_equal(mask.sum(axis=1), 5)
    assert bool(mask[0, 17, 1]) and bool(mask[0, 16, 1]) and bool(mask[0, 18, 1])  # pooled neighbours
    assert bool(mask[1, 3, 0]) and not mask[0, 40:].any() and not mask[1, 45:].any()
    # the default span keeps the 8 tokens after an attended one (what a copy reads next) and 2 before
    mask = observed_exact_mask(q, k, candidates, keep=11)
    np.testing.assert_array_equal(np.flatnonzero(mask[0, :, 1]), np.arange(15, 26))
    np.testing.assert_array_equal(np.flatnonzero(mask[1, :, 0]), np.arange(1, 12))
    with pytest.raises(ValueError, match="keep must be"):
        observed_exact_mask(q, k, candidates, keep=0)
    with pytest.raises(ValueError, match="span must be"):
        observed_exact_mask(q, k, candidates, keep=5, span=(-1, 2))


def test_observed_exact_prompt_tokens_bypass_the_transform():
    """With every token before the observed ones chosen and the observed ones in the recent window, a
    destroyed prompt cache answers as dense; asking for observed tokens needs an observing prefill."""
    model, item, cache = _tiny_retrieval_case(observe=8)
    scramble = lambda k, v, layer: (-3.0 * k[..., ::-1, :, :], jnp.flip(v, axis=2) * 0.0)
    dense = answer(model, cache, item, None)
    n = item.prompt.size
    np.testing.assert_array_equal(
        answer(model, cache, item, scramble, recent_exact=8, observed_exact=n - 8), dense
    )
    assert not np.array_equal(answer(model, cache, item, scramble, recent_exact=8, observed_exact=4), dense)
    with pytest.raises(ValueError, match="made with observe"):
        answer(model, PromptCache(model, item.prompt, 64), item, scramble, observed_exact=4)
    with pytest.raises(ValueError, match="observe must be"):
        PromptCache(model, item.prompt, 64, observe=n)


def test_observed_exact_tokens_count_in_bits_per_element(smollm2_fp32, weighted_codebooks):
    """Each observed token is a bf16 K/V entry instead of a code, plus its position (int32)."""
    from bench.pq_real_model import bits_per_element, pq

    cfg, tokens = smollm2_fp32.config, 8192
    base = pq(4, "layer", "attention", 4, 128, bits=4)
    with_observed = pq(4, "layer", "attention", 4, 128, bits=4, observed=256)
    assert with_observed.name == base.name + " obs256 span8+2"
    extra = bits_per_element(with_observed, cfg, tokens, weighted_codebooks) - bits_per_element(
        base, cfg, tokens, weighted_codebooks
    )
    code_bits = 4 / 4  # 4-bit codes over ds 4
    want = 256 * (16 - code_bits) / tokens + 32 * 256 / (2 * cfg.head_dim * tokens)
    assert extra == pytest.approx(want, rel=0.02)
