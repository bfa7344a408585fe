"""Chat templates: the Jinja templates HF `tokenizer_config.json` and GGUF `tokenizer.chat_template`
carry, rendered in the environment `transformers` renders them in (sandboxed, `trim_blocks`,
`lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant", "content": str}


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered, or messages it cannot take."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """A compiled Jinja template (cached per source text)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not parse ({e})") from None


def check_messages(messages: Any) -> list[Message]:
    """Messages as a list of {"role": str, "content": str} dicts, or a ChatTemplateError saying what is wrong."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ChatTemplateError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
    return list(messages)


def render_chat(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool = False,
    special_tokens: dict[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text `template` makes of `messages` (+ the assistant's opening when
    `add_generation_prompt`); `special_tokens` (bos_token, eos_token, ...) and `kwargs` are template variables."""
    import jinja2

    try:
        return compile_template(template).render(
            messages=check_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **(special_tokens or {}),
            **kwargs,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render ({e})") from None
