"""Which cache `jaxlongctx.generate` decodes over, as an object: `DenseKV()` (the default for
full-attention models), `PQKV(codebooks)` (MILLION product quantization) or `ARMTMemory()` (an ARMT
model's own recurrent memory, the only choice for ARMT). Also each choice's size report and the
`--kv-cache` command-line options."""

from __future__ import annotations

import abc
import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from jaxlongctx.config import ModelConfig
from jaxlongctx.kvcache.codebooks import Codebooks, check_cache_bits
from jaxlongctx.kvcache.dense import dense_cache_bytes
from jaxlongctx.kvcache.pq_cache import DEFAULT_WINDOW, pq_cache_report
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.validation import check_positive_int

ARMT_SCHEDULES = ("diagonal", "sequential")


@dataclass(frozen=True)
class DenseKV:
    """Every token's keys and values in the model's dtype (full-attention models; their default)."""

    kind: ClassVar[str] = "dense"

    def bytes_report(self, config: ModelConfig, tokens: int, batch: int = 1) -> dict[str, Any]:
        """Bytes of this cache for `tokens` tokens per row, beside a dense bf16 cache."""
        dense = dense_cache_bytes(config, tokens, batch)
        return {
            "kv_cache": self.kind,
            "tokens": tokens,
            "batch": batch,
            "total_bytes": dense,
            "dense_bf16_bytes": dense,
        }


# The defaults of `PQKV`: on 6K-token documents with a planted fact (SmolLM2, 4-bit ds 1 codebooks) they
# answered the 11 of 12 questions that the dense cache answered, the bare cache (`PQKV.bare`) 7 of 12
DEFAULT_SINKS = 4
DEFAULT_OBSERVED = 256


@dataclass(frozen=True, eq=False)
class PQKV:
    """Product-quantized keys and values with lookup-table decode attention (MILLION): `codebooks` from
    `jaxlongctx.calibrate` or `jaxlongctx.load_codebooks` (attention-weighted ones encode with their
    channel weights; `jaxlongctx.shipped_codebooks(model)` has SmolLM2's).

    The defaults keep the tokens that answers need exact, so that a question about a long prompt is
    answered as with the dense cache: the last `window` tokens stay exact (R);
    `keep_prompt_tail_exact` keeps the prompt's last tokens in that window instead of coding them all;
    `sinks`: the prompt's first tokens stay exact; `observed`: per layer and kv head, that many prompt
    tokens which the prompt's last tokens attend to most stay exact
    (`jaxlongctx.kvcache.observed_tokens`; prompts of at most `OBSERVE` tokens have none).
    `PQKV.bare(codebooks)` is the reference cache without them (every prompt token coded).
    `backend` picks the decode-attention kernel ("auto", "xla", "pallas", "interpret")."""

    kind: ClassVar[str] = "pq"
    codebooks: Codebooks
    window: int = DEFAULT_WINDOW
    keep_prompt_tail_exact: bool = True
    backend: str = "auto"
    sinks: int = DEFAULT_SINKS
    observed: int = DEFAULT_OBSERVED

    @classmethod
    def bare(cls, codebooks: Codebooks, window: int = DEFAULT_WINDOW, backend: str = "auto") -> PQKV:
        """The reference MILLION cache: every prompt token coded, only the `window` recent tokens exact
        (smaller at short contexts, but it loses answers about long prompts)."""
        return cls(codebooks, window, keep_prompt_tail_exact=False, backend=backend, sinks=0, observed=0)

    def __post_init__(self) -> None:
        if not isinstance(self.codebooks, Codebooks):
            raise ValueError(
                "PQKV needs codebooks (from jaxlongctx.calibrate or jaxlongctx.load_codebooks), "
                f"got {type(self.codebooks).__name__}"
            )
        check_cache_bits(self.codebooks.bits)
        object.__setattr__(self, "window", check_positive_int(self.window, "PQKV window"))
        object.__setattr__(self, "keep_prompt_tail_exact", bool(self.keep_prompt_tail_exact))
        for name in ("sinks", "observed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PQKV {name} must be an int >= 0, got {value!r}")

    @property
    def pinned_slots(self) -> int:
        """Window slots that hold pinned prompt tokens (sinks and observed), beside the R recent ones."""
        return self.sinks + self.observed

    def bytes_report(self, config: ModelConfig, tokens: int, batch: int = 1) -> dict[str, Any]:
        """Bytes of this cache for `tokens` tokens per row (codes, exact window, codebooks), beside dense bf16."""
        exact = self.window + self.pinned_slots
        return {"kv_cache": self.kind, **pq_cache_report(config, self.codebooks, tokens, exact, batch)}


@dataclass(frozen=True)
class ARMTMemory:
    """An ARMT model's own memory (its only cache and its default); `schedule` runs the prompt's
    segments ("diagonal", or "sequential", the reference)."""

    schedule: str = "diagonal"

    def __post_init__(self) -> None:
        if self.schedule not in ARMT_SCHEDULES:
            raise ValueError(f"ARMTMemory schedule must be one of {ARMT_SCHEDULES}, got {self.schedule!r}")


CacheChoice = DenseKV | PQKV | ARMTMemory


class OwnMemoryModel(abc.ABC):
    """A model that decodes over its own memory instead of a KV cache (ARMT): `jaxlongctx.generate`
    hands it the whole call."""

    @abc.abstractmethod
    def generate(self, ids: Any, params: SamplingParams, **options: Any) -> np.ndarray:
        """ids `[B, T]` -> ids `[B, T + max_new_tokens]`; `options` are `jaxlongctx.generate`'s (cache,
        attention_mask, progress, timings, stream)."""


# --- CLI: generate --kv-cache pq -------------------------------------------------------------------
KV_CACHES = ("dense", "pq")


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV-cache options of `jaxlongctx generate`."""
    parser.add_argument("--kv-cache", choices=KV_CACHES, default="dense", help="decode cache (default dense)")
    add_pq_cache_arguments(parser)
    parser.add_argument(
        "--stats", action="store_true", help="print the KV cache bytes (vs dense bf16) as JSON"
    )


def add_pq_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a PQ cache (`PQKV`), for `--kv-cache pq` of `generate` and `eval-ppl`."""
    parser.add_argument(
        "--codebooks",
        help="codebooks directory for --kv-cache pq (default: the ones shipped for the model, for "
        "SmolLM2-135M-Instruct; other models: from `jaxlongctx calibrate`)",
    )
    parser.add_argument(
        "--pq-window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"exact recent tokens R of the PQ cache (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--keep-prompt-tail-exact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the prompt's last tokens in the exact window instead of coding them all (default on)",
    )
    parser.add_argument(
        "--pq-sinks",
        type=int,
        default=None,
        help=f"the prompt's first tokens kept exact in the PQ cache (default {DEFAULT_SINKS})",
    )
    parser.add_argument(
        "--pq-observed",
        type=int,
        default=None,
        help="prompt tokens per layer and kv head kept exact in the PQ cache: those the prompt's last "
        f"tokens attend to most, for questions about a long prompt (default {DEFAULT_OBSERVED})",
    )
    parser.add_argument(
        "--pq-bare",
        action="store_true",
        help="the reference PQ cache: every prompt token coded, only the --pq-window recent tokens exact "
        "(smaller at short contexts; it loses answers about long prompts)",
    )


def _pq_options_given(args: argparse.Namespace) -> dict[str, Any]:
    """The PQ options given on the command line (those left out take `PQKV`'s defaults)."""
    exact = {
        "keep_prompt_tail_exact": args.keep_prompt_tail_exact,
        "sinks": args.pq_sinks,
        "observed": args.pq_observed,
    }
    return {name: value for name, value in exact.items() if value is not None}


def pq_cache_from_args(args: argparse.Namespace, model: Any) -> PQKV:
    """The `PQKV` of the parsed PQ options: codebooks from `--codebooks` (checked against `model`) or
    the ones shipped for it."""
    from jaxlongctx.kvcache.model_codebooks import load_codebooks_for, shipped_codebooks

    if args.pq_window < 1:
        raise ValueError(f"--pq-window must be >= 1, got {args.pq_window}")
    given = _pq_options_given(args)
    if args.pq_bare and given:
        raise ValueError(
            "--pq-bare leaves every prompt token coded; drop --pq-sinks, --pq-observed and "
            "--keep-prompt-tail-exact"
        )
    if args.codebooks is not None:
        codebooks = load_codebooks_for(model, args.codebooks)
    else:
        codebooks = shipped_codebooks(model)
        if codebooks is None:
            raise ValueError(
                "--kv-cache pq needs --codebooks for this model (codebooks ship for SmolLM2-135M-Instruct "
                "only); make them with `jaxlongctx calibrate`"
            )
    if args.pq_bare:
        return PQKV.bare(codebooks, args.pq_window)
    return PQKV(codebooks, args.pq_window, **given)


def check_no_pq_options(args: argparse.Namespace, kind: str) -> None:
    """Refuse `--codebooks` and the `--pq-*` options with a cache `kind` other than pq."""
    if args.codebooks is not None or _pq_options_given(args) or args.pq_bare:
        raise ValueError(f"--codebooks and the --pq-* options go with --kv-cache pq, not {kind}")


def kv_cache_from_args(args: argparse.Namespace, model: Any) -> DenseKV | PQKV:
    """The cache choice of the parsed KV-cache options of `generate`."""
    if args.kv_cache == "pq":
        return pq_cache_from_args(args, model)
    check_no_pq_options(args, args.kv_cache)
    return DenseKV()
