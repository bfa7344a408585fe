"""Text in, text out: prompt sources, the streaming API, chat sessions and the `chat` / `generate`
commands, on a small random GGUF model with a real byte-level tokenizer and chat template."""

from __future__ import annotations

import io

import numpy as np
import pytest
from gguf_synthetic import gpt2_chat_tokenizer, hf_weights, write_gguf

import jaxlongctx
from jaxlongctx.chat import ChatSession, chat_messages, read_prompt_text, stop_ids, stream_answer
from jaxlongctx.cli import main as cli_main
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.tokenizer import TextStream

TEXTS = [
    "Hello there, how are you today? I am fine, thanks.",
    "def f(x):\n    return x + 1\n",
    "The sky is blue because air scatters blue light more than red light.",
]
CONTEXT = 128


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    """A small random llama GGUF with a chat tokenizer (<|im_start|>/<|im_end|>, ids 1/2) and a
    CONTEXT-token context."""
    path = tmp_path_factory.mktemp("chat") / "chat.gguf"
    write_gguf(
        path,
        "llama",
        hf_weights("llama", seed=3),
        "Q8_0",
        tokenizer=gpt2_chat_tokenizer(TEXTS),
        context_length=CONTEXT,
    )
    return path


@pytest.fixture(scope="module")
def chat_model(chat_gguf):
    return jaxlongctx.load(chat_gguf)


def test_read_prompt_text(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("from a file\n")
    assert read_prompt_text("text", None) == "text"
    assert read_prompt_text(None, str(f)) == "from a file"
    assert read_prompt_text("-", None, io.StringIO("from stdin\n")) == "from stdin"
    assert read_prompt_text(None, "-", io.StringIO("line 1\nline 2\n")) == "line 1\nline 2"
    assert read_prompt_text(None, None) is None
    with pytest.raises(ValueError, match="not both"):
        read_prompt_text("a", str(f))
    with pytest.raises(ValueError, match=r"missing\.txt: no such file"):
        read_prompt_text(None, str(tmp_path / "missing.txt"))
    f.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="UTF-8"):
        read_prompt_text(None, str(f))


def test_stream_callback_sees_every_token(chat_model):
    ids = np.asarray([chat_model.tokenizer.encode(TEXTS[0]).ids] * 2, np.int32)
    seen = []
    params = SamplingParams(12, stop_ids=())
    out = jaxlongctx.generate(chat_model, ids, params, stream=lambda tok: seen.append(tok.copy()))
    np.testing.assert_array_equal(np.stack(seen, axis=1), out[:, ids.shape[1] :])
    np.testing.assert_array_equal(out, jaxlongctx.generate(chat_model, ids, params))

    pieces = []
    text = TextStream(chat_model.tokenizer, pieces.append)  # shows row 0
    jaxlongctx.generate(chat_model, ids, params, stream=text)
    text.flush()
    assert "".join(pieces) == text.text == chat_model.tokenizer.decode(out[0, ids.shape[1] :])


def test_stream_stops_at_end_of_turn(chat_model):
    """Generation with a stop id ends right after it is generated; its text is not shown."""
    prompt = chat_model.tokenizer.apply_chat_template(
        chat_messages(TEXTS[2]), add_generation_prompt=True, tokenize=True
    )
    free = jaxlongctx.generate(chat_model, np.asarray([prompt]), SamplingParams(24, stop_ids=()))
    free = free[0, len(prompt) :].tolist()
    stop = free[5]  # make the sixth token a stop id
    answer = stream_answer(chat_model, prompt, lambda piece: None, SamplingParams(24, stop_ids=stop))
    first = free.index(stop)
    assert answer.ids == free[:first] and not answer.interrupted
    assert answer.text == chat_model.tokenizer.decode(free[:first])


def test_chat_session_history_reset_trim_and_interrupt(chat_model):
    session = ChatSession(chat_model, system="Be brief.", params=SamplingParams(6))
    a1 = session.reply("Hello there", lambda piece: None)
    session.reply("How are you?", lambda piece: None)
    assert [m["role"] for m in session.history] == ["user", "assistant", "user", "assistant"]
    assert session.history[1]["content"] == a1.text
    rendered = chat_model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + session.history[:3], add_generation_prompt=True
    )
    assert "Be brief." in rendered and "Hello there" in rendered and "How are you?" in rendered
    assert session.params.stop_ids == stop_ids(chat_model) and 2 in session.params.stop_ids

    def interrupt(piece):
        raise KeyboardInterrupt  # what Ctrl-C raises while an answer streams

    cut = session.reply("Tell me more", interrupt)
    assert cut.interrupted and len(session.history) == 6 and session.history[-1]["content"] == cut.text
    session.reset()
    assert session.history == []

    long = ChatSession(chat_model, params=SamplingParams(8))  # CONTEXT - 8 tokens for the prompt
    for _ in range(8):
        long.reply(TEXTS[2], lambda piece: None)
        sent = chat_model.tokenizer.apply_chat_template(
            long.history[:-1], add_generation_prompt=True, tokenize=True
        )
        assert len(sent) <= CONTEXT - 8  # the prompt of the last reply
    assert 2 <= len(long.history) < 16  # oldest exchanges dropped to fit
    with pytest.raises(ValueError, match=f"at most {CONTEXT - 8} fit"):
        long.reply("blue " * CONTEXT, lambda piece: None)


def test_chat_command(chat_gguf, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n/reset\n\nHow are you?\n/exit\nnever read\n"))
    assert cli_main(["chat", "--ckpt", str(chat_gguf), "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.count(">>> ") == 5 and err.count("tokens/s") == 2 and "[history cleared]" in err


def test_generate_command_prompt_file_and_chat_on_stdin(chat_gguf, chat_model, tmp_path, monkeypatch, capsys):
    f = tmp_path / "prompt.txt"
    f.write_text(TEXTS[2] + "\n")
    base = ["generate", "--ckpt", str(chat_gguf), "--max-new-tokens", "10"]
    assert cli_main(base + ["--prompt-file", str(f)]) == 0
    ids = np.asarray([chat_model.tokenizer.encode(TEXTS[2]).ids])
    expected = chat_model.tokenizer.decode(
        jaxlongctx.generate(chat_model, ids, SamplingParams(10))[0, ids.shape[1] :]
    )
    assert capsys.readouterr().out == expected + "\n"

    monkeypatch.setattr("sys.stdin", io.StringIO(TEXTS[0] + "\n"))
    assert cli_main(base + ["--chat", "--system", "Be brief.", "--prompt", "-"]) == 0
    prompt = chat_model.tokenizer.apply_chat_template(
        chat_messages(TEXTS[0], "Be brief."), add_generation_prompt=True, tokenize=True
    )
    free = jaxlongctx.generate(chat_model, np.asarray([prompt]), SamplingParams(10, stop_ids=()))
    free = free[0, len(prompt) :].tolist()
    stops = set(stop_ids(chat_model))
    end = next((i for i, t in enumerate(free) if t in stops), len(free))
    assert capsys.readouterr().out == chat_model.tokenizer.decode(free[:end]) + "\n"

    assert cli_main(base + ["--chat", "--ids", "1 2 3"]) == 2
    assert "--chat needs a text prompt" in capsys.readouterr().err


_TEMPLATES = [  # whitespace control, loop controls, namespace, tojson of non-ASCII, special tokens
    "{{ bos_token }}{% for m in messages %}\n  {% if m['role'] == 'system' %}{% continue %}{% endif %}\n"
    "  <{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>{{ eos_token if loop.last }}\n{% endfor %}\n"
    "{% if add_generation_prompt %}<assistant>{% endif %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ m | tojson }}{% if ns.n >= 2 %}{% break %}{% endif %}\n{% endfor %}",
]


def test_chat_templates_render_as_transformers_renders_them(chat_gguf, chat_model):
    from transformers import AutoTokenizer

    from jaxlongctx.chat_template import render_chat

    ref = AutoTokenizer.from_pretrained(chat_gguf.parent, gguf_file=chat_gguf.name)
    messages = [
        {"role": "system", "content": "Sé breve."},
        {"role": "user", "content": "  Hola, ¿qué tal? 日本 "},
        {"role": "assistant", "content": "Bien."},
    ]
    for template in _TEMPLATES:
        for gen in (True, False):
            ours = render_chat(
                template,
                messages,
                add_generation_prompt=gen,
                special_tokens=chat_model.tokenizer.special_tokens,
            )
            assert ours == ref.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=gen, tokenize=False
            ), template


def test_chat_template_errors():
    from jaxlongctx.chat_template import ChatTemplateError, render_chat

    refuses_tools = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="refused the messages: no tools"):
        render_chat(refuses_tools, [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="message 0 must be a dict"):
        render_chat(refuses_tools, [{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", [])


def test_saved_armt_model_keeps_the_chat_template_and_stop_ids(chat_model, tmp_path):
    """A full ARMT checkpoint of a chat model chats like its base: the template, special tokens and
    stop ids travel with tokenizer.json."""
    import jax

    from jaxlongctx.armt import ARMTConfig, ARMTModel

    armt = ARMTModel.wrap(chat_model, ARMTConfig(16, 4, d_mem=8), jax.random.key(0))
    armt.save(tmp_path / "armt")
    loaded = jaxlongctx.load(tmp_path / "armt")
    messages = [{"role": "user", "content": "How are you?"}]
    assert loaded.tokenizer.chat_template == chat_model.tokenizer.chat_template is not None
    assert loaded.tokenizer.stop_ids == chat_model.tokenizer.stop_ids
    assert loaded.tokenizer.special_tokens == chat_model.tokenizer.special_tokens
    assert loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
        chat_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    )
