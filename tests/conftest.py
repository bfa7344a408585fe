"""Shared fixtures: tiny HF oracle models saved once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Commands run by the tests (in this process or in the ones it starts) leave the user's disk cache
# alone; tests/test_disk_cache.py turns the cache on in a folder of its own.
os.environ["JAXLONGCTX_NO_CACHE"] = "1"

from hf_oracle import FAMILIES, make_hf_model


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: one process runs the whole suite, and
    without this it keeps every program every module compiled (gigabytes by the end of the run)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def hf_family_dir(tmp_path_factory):
    """Factory: family name -> (HF dir, torch model), built once per session."""
    made: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(family) / "hf"
            made[family] = (out, make_hf_model(family, out))
        return made[family]

    return get


@pytest.fixture(scope="session")
def smollm2_fp32():
    """SmolLM2-135M-Instruct (the shipped GGUF) in float32, loaded once per session."""
    import jaxlongctx
    from jaxlongctx.pretrained import smollm2_gguf

    return jaxlongctx.load(smollm2_gguf(), "fp32")


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    """Every supported model family."""
    return request.param
