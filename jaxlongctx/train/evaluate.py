"""Evaluation: perplexity on a corpus split (with a pluggable K/V transform) against a unigram
baseline, and haystack answer accuracy against context length (the `jaxlongctx eval-ppl` command is
`jaxlongctx.commands.eval_ppl`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jaxlongctx.armt.segments import grid_starts
from jaxlongctx.data.haystack import CODE_DIGITS, FILLER_SPLIT, code_split_by_starts, held_out_batch
from jaxlongctx.data.tokenizer import load_default_tokenizer
from jaxlongctx.model.attention_strategies import CausalPrefill, KVTransformed, RecentExactKV
from jaxlongctx.model.layers import DecoderLayer
from jaxlongctx.model.llama import Llama, positions_from_mask
from jaxlongctx.train.data import eval_windows

# (k, v, layer) -> (k, v): applied to every layer's post-RoPE keys/values `[B, T, K, hd]` before
# attention (e.g. fake quantization); `layer` is the traced layer index.
KVTransform = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]]


def forward_with_kv_transform(
    model: Llama,
    ids: jnp.ndarray,
    mask: jnp.ndarray,
    kv_transform: KVTransform | None = None,
    exact_recent: int = 0,
) -> jnp.ndarray:
    """Logits `[B, T, V]` of the full causal forward, with `kv_transform` applied to post-RoPE k/v; with
    `exact_recent` > 0 each query still reads its last `exact_recent` keys (its own included) exactly."""
    cos, sin = model.rope(positions_from_mask(mask))

    def body(layer: DecoderLayer, h, index):
        attend = CausalPrefill(mask)
        if kv_transform is not None:
            transform = lambda k, v: kv_transform(k, v, index)
            if exact_recent > 0:
                attend = RecentExactKV(mask, transform, exact_recent)
            else:
                attend = KVTransformed(attend, transform)
        return layer(h, cos, sin, attend)

    h, _ = model.scan_layers(body, model.embed_ids(ids), jnp.arange(model.config.num_layers))
    return model.head(h)


def token_nll(
    model: Llama,
    ids: jnp.ndarray,
    mask: jnp.ndarray,
    kv_transform: KVTransform | None = None,
    exact_recent: int = 0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Summed next-token NLL and number of predicted tokens for windows ids/mask `[B, T+1]`."""
    logits = forward_with_kv_transform(model, ids[:, :-1], mask[:, :-1], kv_transform, exact_recent)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
    weight = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * weight), jnp.sum(weight)


def perplexity(
    module: Llama,
    tokens: np.ndarray,
    context: int,
    batch_size: int = 8,
    kv_transform: KVTransform | None = None,
    exact_recent: int = 0,
    progress: bool = False,
) -> dict[str, float]:
    """Mean NLL (nats/token) and perplexity over every token of `tokens`, in windows of `context`
    (`kv_transform` and `exact_recent`: see `forward_with_kv_transform`)."""
    graphdef, params = nnx.split(module)
    step = jax.jit(
        lambda p, ids, mask: token_nll(nnx.merge(graphdef, p), ids, mask, kv_transform, exact_recent)
    )
    return windows_perplexity(
        lambda ids, mask: step(params, ids, mask),
        tokens,
        context,
        module.config.vocab_size,
        batch_size,
        progress,
    )


def windows_perplexity(
    step: Callable[[jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]],
    tokens: np.ndarray,
    context: int,
    vocab_size: int,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, float]:
    """Mean NLL and perplexity over every token of `tokens` in windows of `context`, batches of windows
    ids/mask `[batch_size, context + 1]` scored by `step` -> (summed NLL, predicted tokens)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"the text holds token id {int(tokens.max())} but the model's vocabulary has "
            f"{vocab_size} ids: the tokenizer does not belong to this model"
        )
    windows = eval_windows(tokens, context)
    total, count = 0.0, 0.0
    n = windows["ids"].shape[0]
    for start in tqdm(range(0, n, batch_size), desc="perplexity", unit="batch", disable=not progress):
        ids, mask = windows["ids"][start : start + batch_size], windows["mask"][start : start + batch_size]
        if ids.shape[0] < batch_size:  # pad the last batch so there is one compiled shape
            pad = batch_size - ids.shape[0]
            ids = np.concatenate([ids, np.zeros((pad, ids.shape[1]), ids.dtype)])
            mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
        s, c = step(jnp.asarray(ids), jnp.asarray(mask))
        total, count = total + float(s), count + float(c)
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens": int(count)}


def unigram_baseline(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> dict[str, float]:
    """NLL and perplexity on `eval_tokens` of an add-one-smoothed unigram model fit on `train_tokens`."""
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    loss = float(-logp[np.asarray(eval_tokens)].mean())
    return {"loss": loss, "ppl": math.exp(loss), "tokens": int(np.asarray(eval_tokens).size)}


DIGIT_CHANCE = 0.1  # per answer digit; exact match of all CODE_DIGITS digits: 0.1 ** CODE_DIGITS


def answer_inputs(ids: np.ndarray, answer_ids: np.ndarray) -> np.ndarray:
    """Prompt `[B, P]` + all answer digits but the last -> `[B, P + CODE_DIGITS - 1]` (teacher forcing)."""
    return np.concatenate([ids, answer_ids[:, :-1]], axis=1).astype(np.int32)


def retrieval_accuracy(
    model: Callable[[np.ndarray, int], jnp.ndarray],
    length: int,
    samples: int,
    batch_size: int = 1,
    num_facts: int = 4,
    segment_size: int | None = None,
    shared_word: bool = False,
    filler_split: str = FILLER_SPLIT,
    split_facts: bool = False,
    target_depth: float | None = None,
    progress: bool = False,
    segment_starts: Callable[[np.ndarray, np.ndarray], list[np.ndarray]] | None = None,
) -> dict[str, float | None]:
    """Greedy exact-match and per-digit accuracy on held-out haystack prompts of `length` tokens
    (teacher-forced argmax: all digits right under teacher forcing == greedy decode right).

    `model(ids, prompt_length)` gives the logits `[B, T, V]` that decoding after the first
    `prompt_length` tokens of ids computes (a full-attention model ignores the length; ARMT:
    `ARMTModel.generation_logits`). With `segment_size` (ARMT), also split the samples: `in_segment_*`
    where the asked fact lies in the decoding window (the prompt's last segment, in view of every answer
    digit) and `from_memory_*` for the rest (facts only the memory can bring); `code_split_*` where a
    segment boundary separates the asked fact's subject from its code's last digit (the binding then
    spans two segments: `code_split_by_starts`) and `code_whole_*` for the rest; an empty split is None.
    The segments are those of `segment_starts(ids [B, P], lengths [B])`, each prompt row's segment starts
    under the model's segmentation (`ARMTModel.segment_starts`); without it, the fixed grid of `segment_size`.
    `by_depth` splits the samples by the asked fact's relative position in the prompt, in quarters
    (depth 0 = the first token, far from the question). `shared_word_*` / `distinct_words_*` split
    them by whether another fact's subject shares the asked subject's colour or object.
    `wrong_digit_rate [CODE_DIGITS]` is the share of samples wrong at each answer digit, and
    `first_digit_other_fact_rate` the share whose first digit is wrong and starts another fact's code:
    teacher forcing feeds the right first digit to the later ones, so a sample whose greedy answer is
    another fact's code shows here as a wrong first digit (that digit picks the fact). With
    `shared_word` every sample is a near miss (`make_sample(shared_word=True)`). The filler comes from the
    corpus split `filler_split` (by default the validation split, which the base model never trained on).
    With `split_facts` (needs `segment_size`) every sample is shifted so that a segment boundary splits its
    asked fact (`held_out_batch(split_segment=segment_size)`): the code_split case on every sample.
    `target_depth` puts every asked fact at that relative depth of the filler (`held_out_batch`);
    `asked_depth` is then the mean position of the asked facts over the prompt length.
    `progress` shows a bar over the samples.
    """
    if samples < 1 or batch_size < 1:
        raise ValueError(f"samples and batch_size must be >= 1, got {samples} and {batch_size}")
    if split_facts and segment_size is None:
        raise ValueError("split_facts needs segment_size (the segments whose boundary splits the facts)")
    tokenizer = load_default_tokenizer()
    if segment_starts is None and segment_size is not None:

        def segment_starts(ids, lengths):  # the fixed grid
            return grid_starts(lengths, segment_size)

    hits, asked, shared, other_start, in_window, code_split = [], [], [], [], [], []
    bar = tqdm(total=samples, desc=f"retrieval at {length:,} tokens", unit="sample", disable=not progress)
    for i in range(0, samples, batch_size):
        b = min(batch_size, samples - i)
        raw = held_out_batch(
            range(i, i + b),
            length,
            tokenizer,
            num_facts=num_facts,
            shared_word=shared_word,
            filler_split=filler_split,
            split_segment=segment_size if split_facts else None,
            target_depth=target_depth,
        )
        logits = model(answer_inputs(raw["ids"], raw["answer_ids"]), length)  # B T V
        pred = np.asarray(jnp.argmax(logits[:, length - 1 : length - 1 + CODE_DIGITS], axis=-1))
        hits.append(pred == raw["answer_ids"])
        asked.append(raw["fact_positions"][np.arange(b), raw["target_fact"]])
        shared.append(raw["shares_word"])
        if segment_starts is not None:
            cuts = segment_starts(raw["ids"], np.full(b, length))  # B x [nS]
            in_window.append(asked[-1] >= np.array([c[-1] for c in cuts]))  # the window: the last segment
            code_split.append(code_split_by_starts(raw["code_start"], cuts))
        starts = pred[:, None, 0] == raw["fact_answer_ids"][:, :, 0]  # B F: first digit starts fact f's code
        starts[np.arange(b), raw["target_fact"]] = False
        other_start.append(starts.any(axis=1) & (pred[:, 0] != raw["answer_ids"][:, 0]))
        bar.update(b)
    bar.close()
    hit, fact_at, shared = np.concatenate(hits), np.concatenate(asked), np.concatenate(shared)  # N D, N, N
    out = {
        "length": length,
        "num_facts": num_facts,
        "shared_word_haystack": shared_word,
        "split_facts": split_facts,
        "target_depth": target_depth,
        "asked_depth": float(fact_at.mean() / length),
        **_scores(hit),
        "by_depth": _by_depth(hit, fact_at / length),
        "wrong_digit_rate": (1.0 - hit.mean(axis=0)).tolist(),
        "first_digit_other_fact_rate": float(np.concatenate(other_start).mean()),
    }
    splits = [("shared_word", shared), ("distinct_words", ~shared)]
    if segment_starts is not None:
        where, split = np.concatenate(in_window), np.concatenate(code_split)  # N: in the decoding window, N
        splits += [
            ("in_segment", where),
            ("from_memory", ~where),
            ("code_split", split),
            ("code_whole", ~split),
        ]
    for name, rows in splits:
        out.update({f"{name}_{key}": value for key, value in _scores(hit[rows]).items()})
    return out


def _scores(hit: np.ndarray) -> dict[str, Any]:
    """Sample count, exact-match (with its 95% Wilson interval) and per-digit accuracy of
    `hit [N, CODE_DIGITS]`; None when N is 0."""
    if not len(hit):
        return {"samples": 0, "exact_match": None, "exact_match_ci95": None, "digit_accuracy": None}
    right = int(hit.all(axis=1).sum())
    return {
        "samples": len(hit),
        "exact_match": right / len(hit),
        "exact_match_ci95": exact_match_interval(right, len(hit)),
        "digit_accuracy": float(hit.mean()),
    }


def exact_match_interval(right: int, samples: int, confidence: float = 0.95) -> list[float]:
    """Wilson score interval `[low, high]` of a success rate from `right` of `samples` answers: the
    range the true accuracy lies in at `confidence` (16 samples with 14 right: about [0.64, 0.97])."""
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    p, zz = right / samples, z * z / samples
    centre = (p + zz / 2) / (1 + zz)
    half = z * math.sqrt(p * (1 - p) / samples + zz / (4 * samples)) / (1 + zz)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def _by_depth(hit: np.ndarray, depth: np.ndarray, parts: int = 4) -> list[dict[str, Any]]:
    """`_scores` of the samples whose fact depth falls in each of `parts` equal ranges of [0, 1]
    (hit `[N, CODE_DIGITS]`, depth `[N]`)."""
    bucket = np.minimum((depth * parts).astype(int), parts - 1)
    return [{"depth": [k / parts, (k + 1) / parts], **_scores(hit[bucket == k])} for k in range(parts)]
