"""The on-disk caches that make a second start fast: JAX's persistent compilation cache and the converted
weights of GGUF files and HF model directories (`jaxlongctx.weight_cache`), both under one folder.

The folder is `$JAXLONGCTX_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxlongctx`, else `~/.cache/jaxlongctx`.
The `jaxlongctx` command turns the caches on unless `--no-cache` is given or `JAXLONGCTX_NO_CACHE=1`
is set; library users call `enable_disk_cache()`. Two processes may share the folder at once: compiled
programs are read and written under a file lock (the cache has a size limit, which makes JAX lock it),
and converted weights are written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path

COMPILATION_CACHE_BYTES = 2 * 2**30  # JAX evicts the least recently used programs beyond this
NO_CACHE_ENV = "JAXLONGCTX_NO_CACHE"
CACHE_DIR_ENV = "JAXLONGCTX_CACHE_DIR"

_root: Path | None = None  # set by enable_disk_cache


def default_cache_dir() -> Path:
    """`$JAXLONGCTX_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxlongctx`, else `~/.cache/jaxlongctx`."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "jaxlongctx"


def cache_disabled_by_env() -> bool:
    """True when `JAXLONGCTX_NO_CACHE` is set to anything but "", "0" or "false"."""
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def enable_disk_cache(root: str | Path | None = None) -> Path:
    """Turn on both caches under `root` (default `default_cache_dir()`); returns the folder."""
    global _root
    import jax

    _root = Path(root).expanduser() if root is not None else default_cache_dir()
    compiled = _root / "compiled"
    compiled.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(compiled))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program: they add up
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)  # -> reads/writes locked
    return _root


def weights_cache_dir() -> Path | None:
    """Where converted weights are cached, or None while the disk cache is off."""
    return None if _root is None else _root / "weights"
