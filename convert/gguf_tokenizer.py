"""The tokenizer of a GGUF file, rebuilt with the `tokenizers` library from its `tokenizer.*` metadata.

Two vocabularies are supported (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE (tokens spelled in the GPT-2 byte alphabet, plus merges); the text is split
  before BPE as `tokenizer.ggml.pre` names (the split llama.cpp applies for that name);
- `llama`: SentencePiece-style BPE (tokens with scores, `<0xXX>` byte tokens); merges are recovered
  from the scores (a pair merges with the score of the token it makes, best first).
Tokens marked control become special tokens, user-defined ones added tokens, so both stay whole.
The result is written as HF files (`tokenizer.json`, `tokenizer_config.json` with the chat template
and special tokens, `generation_config.json` with the stop ids) that jaxlongctx.tokenizer reads.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from convert.hf_llama import ConversionError
from jaxlongctx.tokenizer import END_OF_TURN_TOKENS, ChatTokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how the text is split before byte-level BPE.
_GPT2_PRE = ("default", "gpt2", "gpt-2", "olmo", "jais", "poro-chat", "viking", "bloom", "gpt3-finnish")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")


def _byte_level_pre_tokenizer(pre: str | None, where: str) -> tuple[Any, bool]:
    """(pre-tokenizer, ignore_merges) for a byte-level vocabulary with `tokenizer.ggml.pre` = `pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ), False
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level]
        ), True
    if pre in _QWEN2_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level]
        ), False
    if pre not in _GPT2_PRE and pre is not None:
        warnings.warn(
            f"{where}: unknown tokenizer.ggml.pre {pre!r}; splitting text as GPT-2 does", stacklevel=3
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def _byte_level_bpe(meta: dict[str, Any], where: str) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" not in meta:
        raise ConversionError(f"{where}: a gpt2 tokenizer without tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre, ignore_merges = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"), where)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    return tok


def _score_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: every split of a normal token into two vocabulary tokens, ordered by
    the score of the token the merge makes (highest first), then by the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, score, kind in zip(tokens, scores, types):
        if kind not in (NORMAL, USER_DEFINED):
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                found.append((-score, ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_bpe(meta: dict[str, Any], where: str) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.scores" not in meta:
        raise ConversionError(f"{where}: a llama (SentencePiece) tokenizer without tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            {t: i for i, t in enumerate(tokens)},
            _score_merges(tokens, meta["tokenizer.ggml.scores"], types),
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix_space else []))
    return tok


def _special(meta: dict[str, Any], name: str) -> str | None:
    """The text of the special token `tokenizer.ggml.<name>_token_id`, or None."""
    i = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if i is None else meta["tokenizer.ggml.tokens"][int(i)]


def _check_vocabulary(meta: dict[str, Any], where: str) -> None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConversionError(f"{where}: tokenizer metadata without tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        raise ConversionError(f"{where}: {len(types)} token types for {len(tokens)} tokens")
    for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        if i is not None and not 0 <= int(i) < len(tokens):
            raise ConversionError(
                f"{where}: tokenizer.ggml.{name}_token_id={i} is outside the {len(tokens)}-token vocabulary"
            )


def build_tokenizer(meta: dict[str, Any], where: str) -> Tokenizer:
    """The `tokenizers.Tokenizer` that GGUF metadata `meta` describes."""
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ConversionError(f"{where}: unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama)")
    _check_vocabulary(meta, where)
    tok = builders[kind](meta, where)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    bos = _special(meta, "bos") if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") else None
    eos = _special(meta, "eos") if meta.get("tokenizer.ggml.add_eos_token", False) else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    specials = [(t, tok.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tok


def tokenizer_parts(meta: dict[str, Any], where: str) -> tuple[Tokenizer, dict[str, Any], dict[str, Any]]:
    """(tokenizer, tokenizer_config.json dict with special tokens and chat template,
    generation_config.json dict with the stop ids) for GGUF metadata `meta`."""
    tok = build_tokenizer(meta, where)
    kind = meta["tokenizer.ggml.model"]
    config: dict[str, Any] = {
        "bos_token": _special(meta, "bos"),
        "eos_token": _special(meta, "eos"),
        "unk_token": _special(meta, "unknown"),
        "pad_token": _special(meta, "padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    stops = [meta[key] for k in ("eos", "eot", "eom") if (key := f"tokenizer.ggml.{k}_token_id") in meta]
    stops += [i for t in END_OF_TURN_TOKENS if (i := tok.token_to_id(t)) is not None]  # for transformers too
    generation = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(i) for i in stops)),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return tok, config, generation


def chat_tokenizer(meta: dict[str, Any], where: str) -> ChatTokenizer:
    """The `ChatTokenizer` (tokenizer, special tokens, stop ids, chat template) of GGUF metadata `meta`."""
    tok, config, generation = tokenizer_parts(meta, where)
    return ChatTokenizer(tok, config, tuple(generation["eos_token_id"]))


def tokenizer_files(meta: dict[str, Any], where: str) -> dict[str, bytes]:
    """HF tokenizer files (name -> content) for GGUF metadata `meta`: tokenizer.json,
    tokenizer_config.json and generation_config.json."""
    tok, config, generation = tokenizer_parts(meta, where)
    return {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode(),
        "generation_config.json": (json.dumps(generation, indent=2) + "\n").encode(),
    }
