"""Command-line options that several subcommands share: the model flag, one name everywhere."""

from __future__ import annotations

import argparse
from typing import Any


def add_model_argument(
    parser: Any, help_text: str, *, old: str, flag: str = "--model", dest: str = "model", **kwargs: Any
) -> argparse.Action:
    """Add the model option `flag` (default `--model`) with its old spelling `old` kept as an alias for
    one release (named in the help)."""
    return parser.add_argument(
        flag, old, dest=dest, help=f"{help_text} ({old}: old name, removed in the next release)", **kwargs
    )
