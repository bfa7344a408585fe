"""The serving engine in-process: greedy answers under continuous batching equal `jaxlongctx.generate`
alone (dense and PQ caches, ARMT one at a time), per-slot sampling, stop strings, and the HTTP
errors that need a particular engine state (a full queue: 429; shutting down: 503), through the
real `openai` client on the app in-process."""

from __future__ import annotations

import threading
import time

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


@pytest.mark.parametrize("kind", ["dense", "pq"])
def test_batched_greedy_equals_generate_alone(base_model, kind):
    """6 requests of different lengths through 3 slots (slots are reused, requests join mid-batch):
    each answer equals generate's for it alone, token for token; the PQ window of 8 flushes often."""
    cache = None
    if kind == "pq":
        cache = PQKV(load_codebooks_for(base_model, f"{ASSETS}/base_model_pq_ds2"), window=8)
    engine = Engine(
        base_model, EngineOptions(max_batch=3, max_context=256, **({"cache": cache} if cache else {}))
    )
    engine.start()
    prompts = _prompts(6, base_model.config.vocab_size)
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


def test_armt_served_one_at_a_time_equals_generate():
    model = jaxlongctx.load(f"{ASSETS}/armt_model")
    engine = Engine(model, EngineOptions(max_batch=4, max_context=256)).start()
    prompts = _prompts(3, model.config.vocab_size, seed=1)
    try:
        results = _run(engine, prompts, [20, 12, 20], temperature=0.0)
    finally:
        engine.shutdown(60)
    assert engine.one_at_a_time
    for p, n, r in zip(prompts, [20, 12, 20], results):
        assert list(r.ids) == _alone(model, p, n)


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
