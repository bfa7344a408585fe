"""The demo's real-model part: the planted-fact document, the missing-package path, and (slow) SmolLM2's answers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

import jaxlongctx.pretrained as pretrained
from jaxlongctx.demo import (
    ASSETS,
    REAL_ANSWER,
    REAL_FACT,
    REAL_QUESTION,
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


@pytest.mark.slow
def test_smollm2_answers_with_dense_and_pq_caches():
    lines: list[str] = []
    result = real_model_part(1200, 24, lines.append)
    assert result["dense"]["correct"], result["dense"]["answer"]
    assert result["pq"]["cache_bytes"] < result["dense"]["cache_bytes"]
    assert any(REAL_ANSWER in line for line in lines)


def test_cli_rejects_a_negative_document_length(capsys):
    from jaxlongctx.cli import main

    assert main(["demo", "--real-doc-tokens", "-1"]) == 2
    assert "--real-doc-tokens must be >= 0" in capsys.readouterr().err
