"""`jaxlongctx serve` over HTTP with the real `openai` client: a server subprocess on a free port of
127.0.0.1 (one plain; one with `--tp 2` on two fake CPU devices and an API key), serving a small
random chat GGUF. Answers are checked against `jaxlongctx.generate` in this process."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import numpy as np
import openai
import pytest
from serve_helpers import CONTEXT, TEXTS, write_chat_gguf

import jaxlongctx
from bench.serve_process import ServerProcess
from jaxlongctx.chat import stop_ids
from jaxlongctx.sampling import SamplingParams

KEY = "sk-test-key"
MODEL = "chat"  # the served id: the GGUF's file name without .gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_chat_gguf(tmp_path_factory.mktemp("serve") / f"{MODEL}.gguf")


@pytest.fixture(scope="module")
def servers(gguf, tmp_path_factory):
    """Both servers, started together (their start-up overlaps)."""
    logs = tmp_path_factory.mktemp("logs")
    plain = ServerProcess(["--model", str(gguf), "--max-batch", "4"], logs / "plain.log")
    tp = ServerProcess(
        ["--model", str(gguf), "--max-batch", "2", "--tp", "2", "--api-key", KEY, "--prefill-chunk", "32"],
        logs / "tp.log",
        devices=2,
    )
    try:
        yield plain.wait_ready(), tp.wait_ready()
    finally:
        plain.stop()
        tp.stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(gguf):
    return jaxlongctx.load(gguf)


def _reference(model, ids: list[int], max_tokens: int) -> tuple[str, int]:
    """`jaxlongctx.generate`'s greedy answer alone: its text and token count (up to the stop id)."""
    params = SamplingParams(max_tokens, stop_ids=stop_ids(model))
    new = jaxlongctx.generate(model, np.asarray([ids], np.int32), params)[0, len(ids) :].tolist()
    ends = [i for i, t in enumerate(new) if t in params.stop_ids]
    new = new[: ends[0]] if ends else new
    return model.tokenizer.decode(new), len(new)


def _chat(client, text: str, max_tokens: int, stream: bool = False, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        **kw,
    )


def _joined(chunks) -> tuple[str, str | None, object]:
    """Text, last finish_reason and usage of a stream of chat or completion chunks."""
    text, finish, usage = [], None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for choice in c.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_chat_and_completions_equal_generate(client, model):
    messages = [{"role": "user", "content": TEXTS[0]}]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    text, n = _reference(model, ids, 24)
    chat = _chat(client, TEXTS[0], 24)
    assert chat.object == "chat.completion" and chat.model == MODEL
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == text
    assert chat.choices[0].finish_reason == ("length" if n == 24 else "stop")
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(ids), n)
    assert chat.usage.total_tokens == len(ids) + n

    ids = model.tokenizer.encode(TEXTS[2]).ids
    text, n = _reference(model, ids, 30)
    done = client.completions.create(model=MODEL, prompt=TEXTS[2], max_tokens=30, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text == text
    assert done.usage.completion_tokens == n
    # max_completion_tokens (the newer name) wins over max_tokens
    newer = _chat(client, TEXTS[0], 50, max_completion_tokens=5)
    assert newer.usage.completion_tokens <= 5
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_streamed_chunks_join_to_the_whole_answer(client):
    whole = _chat(client, TEXTS[1], 40)
    chunks = list(_chat(client, TEXTS[1], 40, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text, finish, usage = _joined(chunks)
    assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].choices == []  # the usage chunk comes last, without choices

    whole = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=25, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt=TEXTS[0], max_tokens=25, temperature=0, stream=True
    )
    text, finish, _ = _joined(stream)
    assert (text, finish) == (whole.choices[0].text, whole.choices[0].finish_reason)


def test_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": MODEL, "prompt": TEXTS[1], "max_tokens": 6, "temperature": 0, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_strings_end_the_answer(client):
    whole = (
        client.completions.create(model=MODEL, prompt=TEXTS[2], max_tokens=40, temperature=0).choices[0].text
    )
    assert len(whole) > 12
    stop = whole[6:9]
    cut = client.completions.create(
        model=MODEL, prompt=TEXTS[2], max_tokens=40, temperature=0, stop=[stop, "@@@"]
    )
    assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt=TEXTS[2], max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert _joined(stream)[:2] == (cut.choices[0].text, "stop")


def test_16_concurrent_requests_from_8_threads_equal_their_sequential_answers(client, server):
    def ask(i: int) -> tuple[str, str]:
        text, n = f"{TEXTS[i % 3]} {i}", 8 + 4 * (i % 5)
        if i % 2:
            return _joined(_chat(client, text, n, stream=True))[:2]
        answer = _chat(client, text, n)
        return answer.choices[0].message.content, answer.choices[0].finish_reason

    sequential = [ask(i) for i in range(16)]
    before = server.metrics()
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(ask, range(16)))
    assert concurrent == sequential
    after = server.metrics()
    assert after["busy_slots"] == 0 and after["queue_depth"] == 0
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["generated_tokens"] - before["generated_tokens"]
    assert tokens / steps > 1.5  # several requests shared each decode step


def test_disconnect_mid_stream_frees_the_slot(server):
    before = server.metrics()["requests"]["cancelled"]
    body = {"model": MODEL, "prompt": TEXTS[0], "max_tokens": CONTEXT - 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 20
    while (m := server.metrics())["busy_slots"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m["busy_slots"] == 0 and m["requests"]["cancelled"] == before + 1


def test_errors_in_openai_shape(server, client):
    r = httpx.post(
        server.url + "/v1/chat/completions", content=b'{"model": "chat", "messages": [', timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", temperature=5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
    assert e.value.body["param"] == "n"

    long_text = " ".join(TEXTS) * 20
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long_text, max_tokens=10)
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match=r"\(\d+ in the prompt, 1000 in the completion\)"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1000)

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=3)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_api_key_and_tensor_parallel_on_two_devices(servers, model):
    plain, tp = servers
    assert httpx.get(tp.url + "/health", timeout=30).status_code == 200  # no key needed
    wrong = openai.OpenAI(base_url=tp.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(tp.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=30)  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    keyed = openai.OpenAI(base_url=tp.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    prompt = " ".join(TEXTS)  # 82 tokens: prefilled in chunks of 32 over the two devices
    ids = model.tokenizer.encode(prompt).ids
    assert len(ids) > 64
    text, _ = _reference(model, ids, 16)
    answer = keyed.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert answer.choices[0].text == text
    assert "tp" not in plain.metrics()  # the plain server needs no key for its metrics either


def test_bounded_load_loses_no_request_and_leaves_no_slot_busy(server, client):
    """8 threads send mixed requests (streamed or not, greedy or sampled, some dropped mid-stream) for
    about 10 s: every request ends, the counters add up and no slot stays busy."""
    deadline = time.monotonic() + 10
    outcomes: list[str] = []
    lock = threading.Lock()
    before = server.metrics()["requests"]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            kw = {
                "max_tokens": rng.randint(1, 40),
                "temperature": rng.choice([0, 0.8]),
                "seed": rng.randint(0, 99),
            }
            prompt = rng.choice(TEXTS)[: rng.randint(5, 60)]
            if rng.random() < 0.15:  # dropped mid-stream
                body = {"model": MODEL, "prompt": prompt, "stream": True, **kw, "max_tokens": 200}
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                    next(r.iter_lines())
                outcome = "dropped"
            elif rng.random() < 0.5:
                outcome = _joined(client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw))[1]
            else:
                outcome = client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].finish_reason
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert outcomes and set(outcomes) <= {"stop", "length", "dropped"}
    deadline = time.monotonic() + 20
    while (m := server.metrics())["busy_slots"] and time.monotonic() < deadline:
        time.sleep(0.1)
    counts = {k: m["requests"][k] - before[k] for k in before}
    assert counts["received"] == len(outcomes) and counts["failed"] == counts["rejected"] == 0
    assert counts["finished"] + counts["cancelled"] == len(outcomes)
    assert counts["cancelled"] <= outcomes.count("dropped")
    assert m["busy_slots"] == 0 and m["queue_depth"] == 0


def test_sigterm_finishes_the_requests_in_flight(server, client):
    """Last (it stops the server): a stream in flight at SIGTERM runs to its end; then the server exits 0."""
    stream = client.completions.create(
        model=MODEL,
        prompt=TEXTS[1],
        max_tokens=150,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [next(stream)]
    server.terminate()
    chunks += list(stream)
    _, finish, usage = _joined(chunks)
    assert finish in ("length", "stop") and usage is not None
    assert finish == "stop" or usage.completion_tokens == 150
    assert server.proc.wait(60) == 0
