"""The demo's real-model part: the planted-fact document, the missing-package path, and (slow) SmolLM2's answers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

import jaxlongctx.pretrained as pretrained
from jaxlongctx.demo import (
    ASSETS,
    REAL,
    REAL_ANSWER,
    REAL_FACT,
    REAL_QUESTION,
    SECOND,
    answer_text,
    planted_prompt,
    real_document_messages,
    real_model_part,
)


def test_document_plants_the_fact_and_asks_the_question():
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    (message,) = real_document_messages(tok, 1500)
    text = message["content"]
    assert message["role"] == "user" and text.count(REAL_FACT) == 1 and text.endswith(REAL_QUESTION)
    document = text[: text.index("\n\nAnswer from the text above.")]
    assert (
        1000 < len(tok.encode(document, add_special_tokens=False).ids) <= 1500 + 64
    )  # + the fact and separators
    before, after = document.split(REAL_FACT)
    assert len(before) > 0.2 * len(document) and len(after) > 0.2 * len(
        document
    )  # planted inside, not at an end


def test_missing_model_package_is_skipped_with_the_install_command(monkeypatch):
    monkeypatch.setattr(pretrained, "package_file", lambda package, name: None)
    lines: list[str] = []
    result = real_model_part(500, 4, lines.append)
    assert "skipped" in result and pretrained.SMOLLM2_INSTALL in result["skipped"]
    assert any(pretrained.SMOLLM2_INSTALL in line for line in lines)


def test_the_second_question_asks_about_other_documents():
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    (first,) = real_document_messages(tok, 1500)
    (second,) = real_document_messages(tok, 1500, SECOND)
    assert second["content"].count(SECOND.fact) == 1 and second["content"].endswith(SECOND.question)
    first_docs = set(first["content"].split("\n\n")[:-1]) - {REAL.fact}
    second_docs = set(second["content"].split("\n\n")[:-1]) - {SECOND.fact}
    assert first_docs and second_docs and not first_docs & second_docs


def test_default_pq_cache_with_shipped_codebooks_answers_as_dense(smollm2_fp32):
    """SmolLM2 with `PQKV(codebooks)` (the defaults, the shipped 4-bit codebooks) answers both planted
    questions about 2,500-token documents, as the dense cache does."""
    from jaxlongctx import PQKV, DenseKV, SamplingParams, generate, shipped_codebooks

    model = smollm2_fp32
    codebooks = shipped_codebooks(model)
    assert (codebooks.bits, codebooks.ds, codebooks.granularity, codebooks.weighted) == (4, 1, "layer", True)
    params = SamplingParams(20, stop_ids=model.tokenizer.stop_ids)
    for planted in (REAL, SECOND):
        ids = planted_prompt(model.tokenizer, 2500, planted)
        for cache in (DenseKV(), PQKV(codebooks)):
            answer = answer_text(model.tokenizer, generate(model, ids, params, cache=cache), ids.shape[1])
            assert planted.answer in answer, (planted.question, cache.kind, answer)


@pytest.mark.slow
def test_bare_pq_cache_loses_the_second_answer(smollm2_fp32):
    """Without the exact tokens of the defaults (`PQKV.bare`), the second question is answered wrong."""
    from jaxlongctx import PQKV, SamplingParams, generate, shipped_codebooks

    model = smollm2_fp32
    ids = planted_prompt(model.tokenizer, 2500, SECOND)
    params = SamplingParams(20, stop_ids=model.tokenizer.stop_ids)
    out = generate(model, ids, params, cache=PQKV.bare(shipped_codebooks(model)))
    assert SECOND.answer not in answer_text(model.tokenizer, out, ids.shape[1])


@pytest.mark.slow
def test_smollm2_answers_with_dense_and_pq_caches():
    lines: list[str] = []
    result = real_model_part(2500, 24, lines.append)
    for cache in ("dense", "pq"):
        assert result[cache]["correct"], result[cache]["answer"]
        assert result[cache]["decode_tokens_per_s"] > 0 and result[cache]["compile_s"] >= 0
    assert result["pq"]["cache_bytes"] < result["dense"]["cache_bytes"]
    assert any(REAL_ANSWER in line for line in lines)
    assert any(line.strip().startswith("compile (first call only):") for line in lines)


def test_cli_rejects_a_negative_document_length(capsys):
    from jaxlongctx.cli import main

    assert main(["demo", "--real-doc-tokens", "-1"]) == 2
    assert "--real-doc-tokens must be >= 0" in capsys.readouterr().err
