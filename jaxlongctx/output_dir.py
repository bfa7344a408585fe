"""Safe output directories: every writer of a directory (checkpoints, conversions, codebooks,
training runs, benchmark results) goes through :func:`atomic_directory`.

The rules:
- an output that is, or contains, one of the writer's inputs is refused;
- an existing output is replaced only with ``overwrite=True`` and only if it carries our marker
  (a ``.jaxlongctx`` file, or the format file of a checkpoint written before the marker existed);
- the new content is built in a hidden sibling ``.NAME.jaxlongctx-tmp-PID-HEX`` and swapped in by
  renames (one atomic exchange where the file system offers it), so that at every instant the path
  holds either the complete old directory or the complete new one;
- a directory that appears at the path while the writer works is never replaced;
- what a killed writer left behind (its temporary sibling, or an old directory it had moved aside)
  is cleaned up, or moved back into place, by the next writer of the same path, which says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

MARKER = ".jaxlongctx"
_TAG = "jaxlongctx"
# Format files of directories this project wrote before the marker existed.
_LEGACY_FORMAT_FILES = ("config.json", "codebooks.json", "trainer.json", "summary.json")

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


class OutputError(ValueError):
    """An output path that cannot (or must not) be written."""


def _libc_renameat2():
    """`renameat2` from the C library, or None where it does not exist."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def _rename(src: Path, dst: Path, flags: int) -> bool:
    """rename(2) with `flags`; False where the system or file system does not support them."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def is_ours(path: Path) -> bool:
    """True if directory `path` was written by this project (marker, or a legacy format file)."""
    if (path / MARKER).is_file():
        return True
    for name in _LEGACY_FORMAT_FILES:
        f = path / name
        if not f.is_file():
            continue
        try:
            meta = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(meta, dict) and (
            str(meta.get("format", "")).startswith("jaxlongctx")
            or (name == "codebooks.json" and "format_version" in meta)
            or (name == "trainer.json" and "total_steps" in meta)
            or (name == "summary.json" and "model_config" in meta)
        ):
            return True
    return False


def check_output(
    out: str | Path, *, overwrite: bool = False, inputs: Iterable[str | Path | None] = ()
) -> Path:
    """Check, before any long work, that `out` may be written; returns it as an absolute path.

    Refuses an output that is or contains an input, an existing path without `overwrite`, an existing
    path that is not our directory, and a parent directory that cannot be created or written.
    """
    out = Path(out).absolute()
    real = out.resolve()
    for item in inputs:
        if item is None:
            continue
        src = Path(item).resolve()
        if src == real or src.is_relative_to(real):
            raise OutputError(f"{out}: the output is or contains the input {item}; choose another output")
    if os.path.lexists(out):
        if not out.is_dir() or out.is_symlink():
            raise OutputError(f"{out}: exists and is not a directory; refusing to replace it")
        if not overwrite:
            raise OutputError(f"{out}: output already exists (pass --overwrite to replace it)")
        if not is_ours(out):
            raise OutputError(
                f"{out}: exists and was not written by jaxlongctx (no {MARKER} marker); "
                "refusing to replace it, even with --overwrite"
            )
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out}: cannot create its parent directory ({e.strerror})") from None
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: parent directory {parent} is not writable")
    return out


def check_free_space(out: str | Path, needed_bytes: int) -> None:
    """Refuse to start when the file system of `out` has less than `needed_bytes` (+5%) free."""
    parent = Path(out).absolute().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < needed_bytes * 1.05:
        raise OutputError(
            f"{out}: needs about {needed_bytes / 2**20:,.0f} MiB but only "
            f"{free / 2**20:,.0f} MiB are free on its file system"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(out: Path) -> list[tuple[Path, str, int]]:
    """(path, kind 'tmp' | 'old', pid) of the siblings our writers of `out` create."""
    pattern = re.compile(re.escape(f".{out.name}.{_TAG}-") + r"(tmp|old)-(\d+)-[0-9a-z_]+")
    found = []
    if out.parent.is_dir():
        for p in out.parent.iterdir():
            m = pattern.fullmatch(p.name)
            if m and p.is_dir() and not p.is_symlink():
                found.append((p, m.group(1), int(m.group(2))))
    return found


def recover_leftovers(out: str | Path) -> list[str]:
    """Clean up after killed writers of `out`: move an old directory that a killed swap left aside
    back into place when nothing is at `out`, delete the rest. Returns what was done (also printed)."""
    out = Path(out).absolute()
    done = []
    for path, kind, pid in sorted(_leftovers(out), key=lambda t: t[1] != "old"):
        if pid != os.getpid() and _pid_alive(pid):
            continue  # another writer is at work
        if kind == "old" and not out.exists() and is_ours(path):
            os.rename(path, out)
            done.append(f"restored {out} from {path.name}, left aside by a killed run (pid {pid})")
        else:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path}, left by a killed run (pid {pid})")
    for line in done:
        print(f"note: {line}", file=sys.stderr)
    return done


def write_marker(directory: Path, kind: str) -> None:
    """Mark `directory` as ours (`kind` says what it holds)."""
    (directory / MARKER).write_text(json.dumps({"kind": kind}) + "\n")


def _swap_in(tmp: Path, out: Path, overwrite: bool, inputs: Iterable[str | Path | None]) -> None:
    """Move the complete directory `tmp` to `out`; an old `out` is replaced only after it is checked again."""
    if not os.path.lexists(out):
        if _rename(tmp, out, _RENAME_NOREPLACE):
            return
        if not os.path.lexists(out):
            os.rename(tmp, out)  # no renameat2 here: a tiny check-then-act window remains
            return
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "appeared while writing", str(out))
    check_output(out, overwrite=overwrite, inputs=inputs)  # what is there now may not be ours
    if _rename(tmp, out, _RENAME_EXCHANGE):
        shutil.rmtree(tmp)  # tmp now holds the old directory
        return
    aside = out.parent / f".{out.name}.{_TAG}-old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out, aside)  # killed from here to the next line: the next writer moves it back
    os.rename(tmp, out)
    shutil.rmtree(aside)


@contextlib.contextmanager
def atomic_directory(
    out: str | Path,
    *,
    overwrite: bool = False,
    kind: str = "checkpoint",
    inputs: Iterable[str | Path | None] = (),
) -> Iterator[Path]:
    """Yield an empty temporary sibling of `out` to write into; when the block succeeds, mark it as
    ours and swap it in for `out` (see the module docstring for the rules); on error delete it."""
    inputs = tuple(inputs)
    out = check_output(out, overwrite=overwrite, inputs=inputs)
    recover_leftovers(out)
    out = check_output(out, overwrite=overwrite, inputs=inputs)  # a restored old directory counts too
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{_TAG}-tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"{out}: cannot write next to it ({e.strerror})") from None
    try:
        yield tmp
        write_marker(tmp, kind)
        try:
            _swap_in(tmp, out, overwrite, inputs)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise OutputError(
                    f"{out}: appeared while the output was being written; left it untouched"
                ) from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
