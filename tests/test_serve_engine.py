"""The serving engine in-process: greedy answers under continuous batching equal `jaxlongctx.generate`
alone (dense and PQ caches, ARMT one at a time), per-slot sampling, stop strings, and the HTTP
errors that need a particular engine state (a full queue: 429; shutting down: 503), through the
real `openai` client on the app in-process."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

import jaxlongctx
from jaxlongctx.cache_choice import PQKV
from jaxlongctx.chat import stop_ids
from jaxlongctx.kvcache.model_codebooks import load_codebooks_for
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.serve import Engine, EngineOptions, GenerationRequest
from jaxlongctx.serve.api import create_app
from jaxlongctx.serve.chunked_prefill import chunk_plan
from jaxlongctx.serve.engine import Finished, Overloaded, PromptTooLong
from jaxlongctx.serve.text import OutputText

ASSETS = "jaxlongctx/assets"


@pytest.fixture(scope="module")
def base_model():
    return jaxlongctx.load(f"{ASSETS}/base_model", "fp32")


def _run(engine: Engine, prompts: list[list[int]], max_tokens: list[int], **sampling) -> list[Finished]:
    """Submit every prompt (staggered, so that requests join a running batch) and wait for all."""
    results: dict[int, Finished] = {}
    done = [threading.Event() for _ in prompts]

    def sink(i):
        def emit(event):
            if isinstance(event, Finished):
                results[i] = event
                done[i].set()

        return emit

    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.submit(GenerationRequest(p, sink(i), max_tokens=n, **sampling))
        time.sleep(0.02 * (i % 3))
    for d in done:
        assert d.wait(120)
    return [results[i] for i in range(len(prompts))]


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 5 to 30 tokens (two compile buckets)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(5, 30))).tolist() for _ in range(n)]


def _alone(model, prompt, n, cache=None) -> list[int]:
    """What `jaxlongctx.generate` answers for this request alone, up to its stop id."""
    params = SamplingParams(n, stop_ids=stop_ids(model))
    out = jaxlongctx.generate(model, np.asarray([prompt], np.int32), params, cache=cache)[0, len(prompt) :]
    new = out.tolist()
    ends = [i for i, t in enumerate(new) if t in params.stop_ids]
    return new[: ends[0]] if ends else new


def _cache(model, kind: str) -> PQKV | None:
    """The test PQ cache (a window of 8 that flushes often) or None (dense)."""
    return PQKV(load_codebooks_for(model, f"{ASSETS}/base_model_pq_ds2"), window=8) if kind == "pq" else None


@pytest.mark.parametrize("kind", ["dense", "pq"])
def test_batched_greedy_equals_generate_alone(base_model, kind):
    """6 requests of different lengths through 3 slots (slots are reused, requests join mid-batch),
    two of them longer than the prefill chunk (read in 3 chunks while the others decode): each answer
    equals generate's for it alone, token for token; the PQ window of 8 flushes often."""
    cache = _cache(base_model, kind)
    options = EngineOptions(max_batch=3, max_context=256, prefill_chunk=32)
    engine = Engine(base_model, replace(options, cache=cache) if cache else options)
    engine.start()
    prompts = _prompts(6, base_model.config.vocab_size)
    rng = np.random.default_rng(3)
    prompts[1], prompts[4] = (rng.integers(3, base_model.config.vocab_size, n).tolist() for n in (70, 100))
    lengths = [12, 20] * 3
    try:
        results = _run(engine, prompts, lengths, temperature=0.0)
    finally:
        engine.shutdown(60)
    for p, n, r in zip(prompts, lengths, results):
        assert list(r.ids) == _alone(base_model, p, n, cache)
        assert r.reason == ("length" if len(r.ids) == n else "stop")
    m = engine.metrics_snapshot()
    assert m["busy_slots"] == 0 and m["queue_depth"] == 0 and m["requests"]["finished"] == 6
    assert 1 / 3 < m["mean_batch_occupancy"] <= 1  # slots were shared
    _check_chunked_equals_whole(engine.decoder, prompts[4], kind)


def _check_chunked_equals_whole(decoder, ids: list[int], kind: str) -> None:
    """A 100-token prompt read in chunks of 32 (the last one of 32, the one before it shortened to 4)
    gives the whole-prompt prefill's logits and cache row: the same keys and values (dense), the same
    codes, window and exact tokens (PQ)."""
    job = decoder.start_reading(ids)
    assert decoder.chunked(ids) and job.plan == [(0, 32), (32, 32), (64, 4), (68, 32)]
    while not job.finished:
        decoder.read_next_chunk(job)
    padded = np.zeros((1, 128), np.int32)
    padded[0, :100] = ids
    whole_logits, whole = decoder._prefill_row(padded, padded > 0)
    chunked = decoder._row_from_prompt(
        128, job.k, job.v, jnp.int32(100), job.q_observed, *decoder._row_args()
    )
    np.testing.assert_allclose(job.logits, whole_logits, rtol=1e-4, atol=1e-4)
    for name, a, b in zip(whole._fields, whole, chunked):
        if a is None:
            continue
        if kind == "dense" and name in ("k", "v"):  # [L, 1, K, S, hd]: the pads' slots differ, unread
            a, b = a[:, :, :, :100], b[:, :, :, :100]
        if name.endswith("window"):  # [L, 1, K, P + R, hd]: the row's exact tokens
            a, b = (x[:, :, :, : int(whole.window_lengths[0])] for x in (a, b))
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
        elif name.endswith("codes"):  # the coded tokens' slots: at most a rare nearest-centroid tie apart
            coded = int(whole.lengths[0])
            assert coded > 10 and np.mean(np.asarray(a[..., :coded, :] == b[..., :coded, :])) > 0.999, name
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    with pytest.raises(ValueError, match="chunk must be >= 32"):
        chunk_plan(100, 16)
    assert chunk_plan(64, 32) == [(0, 32), (32, 32)] and chunk_plan(80, 32) == [(0, 32), (32, 16), (48, 32)]


@pytest.fixture(scope="module")
def armt_model():
    return jaxlongctx.load(f"{ASSETS}/armt_model")


def test_armt_served_one_at_a_time_equals_generate(armt_model):
    model = armt_model
    engine = Engine(model, EngineOptions(max_batch=4, max_context=256)).start()
    prompts = _prompts(3, model.config.vocab_size, seed=1)
    try:
        results = _run(engine, prompts, [20, 12, 20], temperature=0.0)
    finally:
        engine.shutdown(60)
    assert engine.one_at_a_time
    for p, n, r in zip(prompts, [20, 12, 20], results):
        assert list(r.ids) == _alone(model, p, n)


def test_armt_streams_and_a_cancel_stops_its_generation(armt_model):
    """An ARMT answer streams token by token: cancelled at its first piece, it ends there, long
    before its 200 tokens."""
    model = armt_model
    engine = Engine(model, EngineOptions(max_context=256)).start()
    events, finished = [], threading.Event()

    def emit(event):
        events.append(event)
        if isinstance(event, str) and event:
            req.cancel()
        if isinstance(event, Finished):
            finished.set()

    prompt = _prompts(1, model.config.vocab_size, seed=1)[0]  # compiled already, with these settings
    req = GenerationRequest(prompt, emit, max_tokens=200)
    try:
        engine.submit(req)
        assert finished.wait(120)
    finally:
        engine.shutdown(60)
    assert events[-1].reason == "cancelled" and 1 <= events[-1].completion_tokens < 10
    assert engine.metrics_snapshot()["busy_slots"] == 0


def test_per_slot_sampling_and_context_limit(base_model):
    """Greedy and sampled slots in one batch: a top_p so small that only the best token stays equals
    greedy; a seed repeats its sample in any slot; the context bounds prompt + max_tokens."""
    engine = Engine(base_model, EngineOptions(max_batch=4, max_context=128)).start()
    prompt = _prompts(1, base_model.config.vocab_size, seed=2)[0]
    settings = [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_p": 1e-6, "seed": 5},
        {"temperature": 1.5, "seed": 7},
        {"temperature": 1.5, "seed": 7},
        {"temperature": 1.5, "seed": 8},
    ]
    try:
        greedy = _run(engine, [prompt], [24], **settings[0])[0].ids
        done: dict[int, Finished] = {}
        finished = threading.Event()

        def sink(i):
            def emit(event):
                if isinstance(event, Finished):
                    done[i] = event
                    if len(done) == len(settings) - 1:
                        finished.set()

            return emit

        for i, kw in enumerate(settings[1:]):  # four slots, decoded together
            engine.submit(GenerationRequest(prompt, sink(i), max_tokens=24, **kw))
        assert finished.wait(120)
        with pytest.raises(
            PromptTooLong, match=r"maximum context length is 128 tokens.*\(100 in the prompt, 29"
        ):
            engine.submit(GenerationRequest([5] * 100, print, max_tokens=29))
    finally:
        engine.shutdown(60)
    narrow, seven, seven_again, eight = (done[i].ids for i in range(4))
    assert narrow == greedy
    assert seven == seven_again != eight  # same seed, same sample; another seed, another
    assert seven != greedy


class _CharTokenizer:
    """Ids are characters (and 0xF0 stands for the first byte of a two-id character)."""

    def decode(self, ids):
        out = "".join(chr(i) for i in ids)
        return out.replace("\xf0\xa9", "é").replace("\xf0", "\ufffd")


def test_output_text_holds_back_and_stops_at_stop_strings():
    text = OutputText(_CharTokenizer(), ("END", "xy"))
    pieces = [text.add(ord(c)) for c in "abEN"]
    assert pieces == ["a", "b", "", ""]  # "EN" may start "END"
    assert text.add(ord("c")) == "ENc"
    assert text.add(0xF0) == "" and text.add(0xA9) == "é"  # a partial character waits
    assert text.add(ord("x")) == "" and text.add(ord("y")) == "" and text.stopped
    assert text.text == "abENcé" and text.finish() == ""
    assert text.add(ord("z")) == ""  # nothing after a stop
    plain = OutputText(_CharTokenizer())
    assert [plain.add(ord(c)) for c in "EN"] == ["E", "N"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from serve_helpers import write_chat_gguf

    return jaxlongctx.load(write_chat_gguf(tmp_path_factory.mktemp("serve") / "chat.gguf"))


def _client(engine: Engine) -> openai.OpenAI:
    http = TestClient(create_app(engine, "chat"))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_full_queue_answers_429_and_shutdown_503(chat_model):
    engine = Engine(chat_model, EngineOptions(max_batch=1, max_queue=0)).start()
    client = _client(engine)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="chat", prompt="Hello", max_tokens=4)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        with pytest.raises(Overloaded):
            engine.submit(GenerationRequest([5, 6], print, max_tokens=2))
        assert engine.metrics_snapshot()["requests"]["rejected"] == 2
        engine.stop_accepting()
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="chat", prompt="Hello", max_tokens=4)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "server_error"
    finally:
        engine.shutdown(60)
