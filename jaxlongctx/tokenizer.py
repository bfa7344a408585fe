"""`ChatTokenizer`: a `tokenizers.Tokenizer` with the special tokens, stop ids and chat template of a
model directory (HF `tokenizer_config.json` / `generation_config.json`, which the GGUF import writes too).

Everything a `tokenizers.Tokenizer` has (`encode(...).ids`, `decode`, `token_to_id`, ...) works on it
unchanged; it adds `apply_chat_template`, `bos_token`/`eos_token`/`pad_token`, `stop_ids`, and
`TextStream` turns generated ids into text as they arrive.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxlongctx.chat_template import ChatTemplateError, render_chat

# Control tokens that end an assistant turn in the chat formats we know.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


class ChatTokenizer:
    """A `tokenizers.Tokenizer` (`backend`, whose attributes it forwards) plus chat support."""

    def __init__(self, backend: Any, config: dict[str, Any] | None = None, stop_ids: tuple[int, ...] = ()):
        self.backend = backend
        config = config or {}
        self.special_tokens: dict[str, str | None] = {n: _token_text(config.get(n)) for n in _SPECIAL_NAMES}
        template = config.get("chat_template")
        if isinstance(template, list):  # HF's named templates: [{"name": "default", "template": ...}, ...]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        self.chat_template: str | None = template
        turn_ends = [backend.token_to_id(t) for t in END_OF_TURN_TOKENS]
        eos = backend.token_to_id(self.eos_token) if self.eos_token else None
        self.stop_ids: tuple[int, ...] = tuple(
            dict.fromkeys(int(i) for i in (*stop_ids, eos, *turn_ends) if i is not None)
        )

    @classmethod
    def from_directory(cls, directory: str | Path) -> ChatTokenizer | None:
        """The tokenizer of a model directory (tokenizer.json + optional tokenizer_config.json and
        generation_config.json), or None when it has no tokenizer.json."""
        from tokenizers import Tokenizer

        directory = Path(directory)
        if not (directory / "tokenizer.json").exists():
            return None
        eos = _read_json(directory / "generation_config.json").get("eos_token_id")  # an int or a list
        stops = tuple(np.atleast_1d(eos).astype(int).tolist()) if eos is not None else ()
        return cls(
            Tokenizer.from_file(str(directory / "tokenizer.json")),
            _read_json(directory / "tokenizer_config.json"),
            stops,
        )

    def save_to(self, directory: str | Path) -> None:
        """Write the tokenizer as `from_directory` reads it: tokenizer.json, and tokenizer_config.json
        (chat template, special tokens) and generation_config.json (stop ids) when it has them."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {n: t for n, t in self.special_tokens.items() if t is not None}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        if config:
            (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.stop_ids:
            stops = {"eos_token_id": list(self.stop_ids)}
            (directory / "generation_config.json").write_text(json.dumps(stops, indent=2) + "\n")

    def __getattr__(self, name: str) -> Any:
        if name == "backend":  # not yet set (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.backend, name)

    @property
    def bos_token(self) -> str | None:
        """Beginning-of-sequence token text."""
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        """End-of-sequence token text."""
        return self.special_tokens["eos_token"]

    @property
    def pad_token(self) -> str | None:
        """Padding token text."""
        return self.special_tokens["pad_token"]

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        """`tokenizers.Encoding` of `text` (`.ids`)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """The prompt the model's chat template makes of `messages` ([{"role", "content"}, ...]),
        as `transformers` renders it; `tokenize=True` returns its ids (no extra special tokens)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template (tokenizer_config.json "
                "'chat_template' or GGUF 'tokenizer.chat_template')"
            )
        text = render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False).ids if tokenize else text


class TextStream:
    """Turns generated ids, fed one step at a time, into text pieces for `emit` (e.g. a print):
    each piece is what decoding all ids so far adds, held back while it ends in a partial character
    (call `flush` after the last step)."""

    def __init__(self, tokenizer: Any, emit: Callable[[str], None], stop_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.emit = emit
        self.stop_ids = frozenset(stop_ids)
        self.ids: list[int] = []
        self.stopped = False
        self._shown = ""

    def __call__(self, ids: np.ndarray) -> None:
        """Take the next token of row 0 (`ids [B]`); ignores everything after a stop id."""
        if self.stopped:
            return
        tok = int(np.asarray(ids).reshape(-1)[0])
        if tok in self.stop_ids:
            self.stopped = True
            return
        self.ids.append(tok)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd") and len(text) > len(self._shown) and text.startswith(self._shown):
            self.emit(text[len(self._shown) :])
            self._shown = text

    def flush(self) -> None:
        """Emit what is still held back (a partial character at the end of generation)."""
        text = self.text
        if len(text) > len(self._shown) and text.startswith(self._shown):
            self.emit(text[len(self._shown) :])
            self._shown = text

    @property
    def text(self) -> str:
        """All text decoded so far."""
        return self.tokenizer.decode(self.ids)
