"""Converted weights of GGUF files and HF model directories, cached on disk so that a second load skips
the conversion (GGUF dequantization, safetensors import) and the checkpoint library.

An entry lives under `<weights cache>/<hash of the source's path>/<source fingerprint>-<dtype>/`:
`config.json` (the model config and the source it came from), `params.json` (name, dtype, shape and
byte offset of each parameter), `params.bin` (the raw parameter bytes) and the tokenizer files. The
fingerprint covers each source file's size, modification time and a hash of its first, middle and
last MiB, so a changed file misses and the entries of its old versions are deleted when the new one is
written. Entries are built in a temporary folder and renamed into place: a reader sees a whole entry
or none, and of two processes converting at once the first rename wins. Nothing is ever written next
to the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "jaxlongctx-weight-cache-v1"  # bump when the conversion changes what it produces
CHUNK = 2**20  # bytes hashed at the start, middle and end of each source file
HF_FILES = ("*.json", "*.safetensors", "*.model")  # the files of a HF model directory that make the model


def source_files(source: Path) -> list[Path]:
    """The files a model source is made of: the GGUF file, or a HF directory's config, weights and tokenizer."""
    if source.is_file():
        return [source]
    return sorted({f for pattern in HF_FILES for f in source.glob(pattern) if f.is_file()})


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Size, modification time (ns) and SHA-256 of the first, middle and last MiB of `path`."""
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for offset in sorted({0, max(0, stat.st_size // 2 - CHUNK // 2), max(0, stat.st_size - CHUNK)}):
            f.seek(offset)
            digest.update(f.read(CHUNK))
    return {
        "name": path.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": digest.hexdigest(),
    }


def source_fingerprint(source: Path) -> str:
    """One hash over `file_fingerprint` of every file of `source` and the cache format."""
    parts = [FORMAT, *(json.dumps(file_fingerprint(f), sort_keys=True) for f in source_files(source))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def entry_dir(root: Path, source: Path, dtype: str) -> Path:
    """The entry of `source` (as it is now) loaded as `dtype` under the weights cache `root`."""
    place = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
    return root / place / f"{source_fingerprint(source)}-{dtype}"


def read_entry(entry: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """(config dict, {parameter path: array}) of a cache entry, or None when there is none; the arrays
    are views of one memory map of `params.bin`."""
    try:
        meta = json.loads((entry / "config.json").read_text())
        index = json.loads((entry / "params.json").read_text())
        blob = np.memmap(entry / "params.bin", np.uint8, mode="r")
    except (OSError, ValueError):  # no entry (or one deleted under us): convert again
        return None
    if meta.get("format") != FORMAT:
        return None
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    arrays = {}
    for name, (dtype, shape, offset) in index.items():
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(blob, np.dtype(dtype), count, offset).reshape(shape)
    return meta["config"], arrays


def write_entry(
    entry: Path, source: Path, config: dict[str, Any], arrays: dict[str, np.ndarray], tokenizer: Any
) -> None:
    """Write an entry atomically (built beside it, renamed into place; a concurrent writer's entry is
    kept), then delete the entries of older versions of the same source."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=entry.parent))
    try:
        index, offset = {}, 0
        with (tmp / "params.bin").open("wb") as f:
            for name, array in arrays.items():
                array = np.ascontiguousarray(array)
                index[name] = (array.dtype.name, list(array.shape), offset)
                f.write(array.tobytes())
                offset += array.nbytes
            f.flush()
            os.fsync(f.fileno())
        (tmp / "params.json").write_text(json.dumps(index))
        if tokenizer is not None:
            tokenizer.save_to(tmp)
        meta = {"format": FORMAT, "source": str(source.resolve()), "config": config}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            tmp.rename(entry)
        except OSError:  # another process wrote this entry first
            if not entry.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    version = entry.name.rsplit("-", 1)[0]  # the source's fingerprint: its entries in other dtypes stay
    for old in entry.parent.iterdir():  # older versions of the source, and leftovers of killed writers
        stale = old.name.startswith(".writing-") and _older_than_a_day(old)
        if stale or not old.name.startswith((version, ".writing-")):
            shutil.rmtree(old, ignore_errors=True)


def _older_than_a_day(path: Path) -> bool:
    import time

    try:
        return time.time() - path.stat().st_mtime > 86400
    except OSError:
        return False
