"""Deterministic text corpus built from what ships with every CPython install.

Sources, in this order:

* ``pydoc_data.topics.topics`` (the text behind ``help("if")`` etc.), one document per topic;
* the docstrings of the standard-library modules in :data:`MODULES`: one document for the
  module docstring and one per class, function and method defined in the module, in sorted
  qualified-name order.  Docstrings are read from the module *source* with :mod:`ast`,
  so nothing is imported: no import side effects, and monkey-patching by third-party
  packages (``typing_extensions`` patches ``typing``) cannot change the corpus.

Each document is ``"<qualified name>\\n\\n<normalised text>"``.  Documents with a text
already seen are dropped (first occurrence wins), so no text appears in two splits.  The
split of a document is fixed by the sha1 of its identity (``module.Class.method`` or
``pydoc_data.topics:<key>``): 90 % train, 5 % validation, 5 % calibration.  The exact text
depends on the Python version; ``jaxlongctx/assets/corpus_manifest.json`` records the build
the committed assets were made from.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SPLITS: tuple[str, ...] = ("train", "validation", "calibration")

# Pure-python standard-library modules, sorted.  Excluded on purpose: ``antigravity``,
# ``this``, ``idlelib``, ``tkinter``, ``turtle*`` (toys and GUI code), modules removed in
# Python 3.13, thin wrappers of optional C extensions (``sqlite3``, ``ssl``, ``lzma``, ...)
# and ``test``.  A module missing from the running Python is skipped and reported by
# :func:`corpus_stats`.
MODULES: tuple[str, ...] = (
    "_collections_abc",
    "_compat_pickle",
    "_markupbase",
    "_py_abc",
    "_pydatetime",
    "_pydecimal",
    "_pyio",
    "_pylong",
    "_strptime",
    "_threading_local",
    "_weakrefset",
    "abc",
    "argparse",
    "ast",
    "asyncio.base_events",
    "asyncio.base_subprocess",
    "asyncio.coroutines",
    "asyncio.events",
    "asyncio.exceptions",
    "asyncio.futures",
    "asyncio.locks",
    "asyncio.protocols",
    "asyncio.queues",
    "asyncio.runners",
    "asyncio.selector_events",
    "asyncio.sslproto",
    "asyncio.staggered",
    "asyncio.streams",
    "asyncio.subprocess",
    "asyncio.taskgroups",
    "asyncio.tasks",
    "asyncio.timeouts",
    "asyncio.transports",
    "asyncio.unix_events",
    "base64",
    "bdb",
    "bisect",
    "cProfile",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "codeop",
    "collections",
    "collections.abc",
    "colorsys",
    "compileall",
    "concurrent.futures",
    "concurrent.futures._base",
    "concurrent.futures.process",
    "concurrent.futures.thread",
    "configparser",
    "contextlib",
    "contextvars",
    "copy",
    "copyreg",
    "csv",
    "dataclasses",
    "difflib",
    "dis",
    "doctest",
    "email._header_value_parser",
    "email._parseaddr",
    "email._policybase",
    "email.base64mime",
    "email.charset",
    "email.contentmanager",
    "email.encoders",
    "email.errors",
    "email.feedparser",
    "email.generator",
    "email.header",
    "email.headerregistry",
    "email.iterators",
    "email.message",
    "email.mime.base",
    "email.mime.multipart",
    "email.mime.text",
    "email.parser",
    "email.policy",
    "email.quoprimime",
    "email.utils",
    "encodings.idna",
    "encodings.punycode",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "genericpath",
    "getopt",
    "getpass",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.entities",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "importlib._bootstrap",
    "importlib._bootstrap_external",
    "importlib.abc",
    "importlib.machinery",
    "importlib.metadata",
    "importlib.resources.abc",
    "importlib.util",
    "inspect",
    "io",
    "ipaddress",
    "json",
    "json.decoder",
    "json.encoder",
    "json.scanner",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "logging.config",
    "logging.handlers",
    "mailbox",
    "mimetypes",
    "modulefinder",
    "multiprocessing.connection",
    "multiprocessing.context",
    "multiprocessing.heap",
    "multiprocessing.managers",
    "multiprocessing.pool",
    "multiprocessing.process",
    "multiprocessing.queues",
    "multiprocessing.reduction",
    "multiprocessing.shared_memory",
    "multiprocessing.synchronize",
    "multiprocessing.util",
    "netrc",
    "ntpath",
    "numbers",
    "opcode",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "posixpath",
    "pprint",
    "profile",
    "pstats",
    "pty",
    "py_compile",
    "pyclbr",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "rlcompleter",
    "runpy",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "socketserver",
    "stat",
    "statistics",
    "string",
    "stringprep",
    "subprocess",
    "symtable",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "tomllib._parser",
    "trace",
    "traceback",
    "tracemalloc",
    "tty",
    "types",
    "typing",
    "unittest.async_case",
    "unittest.case",
    "unittest.loader",
    "unittest.main",
    "unittest.mock",
    "unittest.result",
    "unittest.runner",
    "unittest.suite",
    "unittest.util",
    "urllib.error",
    "urllib.parse",
    "urllib.request",
    "urllib.response",
    "urllib.robotparser",
    "uuid",
    "venv",
    "warnings",
    "wave",
    "weakref",
    "webbrowser",
    "wsgiref.handlers",
    "wsgiref.headers",
    "wsgiref.simple_server",
    "wsgiref.util",
    "wsgiref.validate",
    "xml.dom",
    "xml.dom.expatbuilder",
    "xml.dom.minicompat",
    "xml.dom.minidom",
    "xml.dom.pulldom",
    "xml.dom.xmlbuilder",
    "xml.etree.ElementPath",
    "xml.etree.ElementTree",
    "xml.sax",
    "xml.sax._exceptions",
    "xml.sax.expatreader",
    "xml.sax.handler",
    "xml.sax.saxutils",
    "xml.sax.xmlreader",
    "xmlrpc.client",
    "xmlrpc.server",
    "zipapp",
    "zipfile",
    "zipfile._path",
    "zipimport",
    "zoneinfo",
    "zoneinfo._zoneinfo",
)

_TRAIN_PERCENT = 90
_VALIDATION_PERCENT = 5


def normalise(text: str) -> str:
    """Dedent, expand tabs, strip trailing spaces and collapse runs of blank lines."""
    text = inspect.cleandoc(text.expandtabs(8))
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def split_of(identity: str) -> str:
    """The split a document belongs to, from the sha1 of its identity."""
    bucket = int(hashlib.sha1(identity.encode("utf-8")).hexdigest(), 16) % 100
    if bucket < _TRAIN_PERCENT:
        return "train"
    if bucket < _TRAIN_PERCENT + _VALIDATION_PERCENT:
        return "validation"
    return "calibration"


def module_path(name: str) -> Path:
    """Source file of a standard-library module (``__init__.py`` for a package)."""
    base = Path(sysconfig.get_paths()["stdlib"]).joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _definitions(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of every class and function defined below ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qualname = f"{prefix}.{child.name}"
            if (doc := ast.get_docstring(child, clean=False)) is not None:
                yield qualname, doc
            yield from _definitions(child, qualname)
        else:  # definitions under if/try/with blocks still belong to the enclosing scope
            yield from _definitions(child, prefix)


def _module_documents(name: str, source: str) -> list[tuple[str, str]]:
    """(identity, docstring) of a module and of its classes and functions, sorted by name."""
    tree = ast.parse(source)
    out = [(name, doc)] if (doc := ast.get_docstring(tree, clean=False)) is not None else []
    # A stable sort keeps conditional redefinitions of one name in source order.
    return out + sorted(_definitions(tree, name), key=lambda item: item[0])


def _raw_documents() -> tuple[list[tuple[str, str]], list[str]]:
    """All (identity, raw text) pairs in corpus order, and the modules that were found."""
    from pydoc_data.topics import topics

    docs = [(f"pydoc_data.topics:{key}", topics[key]) for key in sorted(topics)]
    used = []
    for name in MODULES:
        path = module_path(name)
        if not path.is_file():
            continue
        used.append(name)
        docs.extend(_module_documents(name, path.read_text(encoding="utf-8")))
    return docs, used


@functools.cache
def _build() -> tuple[dict[str, list[str]], dict[str, list[str]], tuple[str, ...]]:
    """Splits of document texts, the matching identities, and the modules used."""
    raw, used = _raw_documents()
    texts: dict[str, list[str]] = {split: [] for split in SPLITS}
    identities: dict[str, list[str]] = {split: [] for split in SPLITS}
    seen: set[str] = set()
    for identity, doc in raw:
        body = normalise(doc)
        if not body or body in seen:
            continue
        seen.add(body)
        split = split_of(identity)
        texts[split].append(f"{identity}\n\n{body}")
        identities[split].append(identity)
    return texts, identities, tuple(used)


def load_corpus() -> dict[str, list[str]]:
    """Documents per split: keys "train", "validation", "calibration" (cached)."""
    texts, _, _ = _build()
    return {split: list(docs) for split, docs in texts.items()}


def document_identities() -> dict[str, list[str]]:
    """Qualified names of the documents per split, aligned with :func:`load_corpus`."""
    _, identities, _ = _build()
    return {split: list(ids) for split, ids in identities.items()}


def split_sha1(split: str) -> str:
    """sha1 of a split's documents joined by a NUL character."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    texts, _, _ = _build()
    return hashlib.sha1("\0".join(texts[split]).encode("utf-8")).hexdigest()


def corpus_stats() -> dict[str, object]:
    """Character and document counts per split, the Python version and the modules used."""
    texts, _, used = _build()
    return {
        "python_version": sys.version.split()[0],
        "splits": {
            split: {"documents": len(docs), "characters": sum(len(d) for d in docs)}
            for split, docs in texts.items()
        },
        "modules": list(used),
        "skipped_modules": [m for m in MODULES if m not in used],
    }
