"""The small random chat GGUF the server tests serve."""

from __future__ import annotations

from pathlib import Path

from gguf_synthetic import gpt2_chat_tokenizer, hf_weights, write_gguf

TEXTS = [
    "Hello there, how are you today? I am fine, thanks.",
    "def f(x):\n    return x + 1\n",
    "The sky is blue because air scatters blue light more than red light.",
]
CONTEXT = 384  # the served model's context: long enough for an answer that outlasts a disconnect


def write_chat_gguf(path: Path) -> Path:
    """A small random llama GGUF with a byte-level chat tokenizer and template, CONTEXT tokens of context."""
    weights = hf_weights("llama", seed=3)
    write_gguf(path, "llama", weights, "Q8_0", tokenizer=gpt2_chat_tokenizer(TEXTS), context_length=CONTEXT)
    return path
