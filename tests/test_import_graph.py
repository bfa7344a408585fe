"""The packages' import graph has no cycle: every module of jaxlongctx/, convert/ and pallas_kernels/
sits strictly above the modules it imports (imports inside functions count too).

Pure AST, no module is imported, so the test runs in a fraction of a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxlongctx", "convert", "pallas_kernels")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of every Python file in `PACKAGES` (a package is named by its __init__)."""
    files = {}
    for package in PACKAGES:
        for f in sorted((root / package).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return files


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement anywhere in `tree` asks for (`from a import b` gives `a.b`,
    relative imports resolved against `module`)."""
    names = set()
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parent = here[: len(here) - node.level + 1] if node.level else []
            base = ".".join([*parent, *([node.module] if node.module else [])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the modules of `files` it imports}. A name resolves to its longest prefix that is a
    module (`from pkg import submodule` -> the submodule, `from pkg.mod import func` -> pkg.mod)."""
    graph: dict[str, set[str]] = {}
    for module, f in files.items():
        targets = set()
        for name in imported_names(ast.parse(f.read_text(), str(f)), module, f.name == "__init__.py"):
            parts = name.split(".")
            prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
            target = next((p for p in prefixes if p in files), None)
            if target is not None and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one node (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    """One line per module of a cycle: its imports inside the cycle."""
    inside = set(component)
    lines = [f"{m} -> {', '.join(sorted(graph[m] & inside))}" for m in component]
    return f"{len(component)} modules import each other:\n  " + "\n  ".join(lines)


def test_graph_sees_every_kind_of_import(tmp_path):
    """The graph builder follows absolute, relative, `from pkg import module` and function-level imports,
    and the cycle finder reports exactly the cycle."""
    pkg = tmp_path / "jaxlongctx"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "convert").mkdir()
    (tmp_path / "pallas_kernels").mkdir()
    sources = {
        "jaxlongctx/__init__.py": "from jaxlongctx.low import x\n",
        "jaxlongctx/low.py": "import numpy\n",
        "jaxlongctx/sub/__init__.py": "from . import a\n",
        "jaxlongctx/sub/a.py": "from ..low import x\nfrom .b import y\n",
        "jaxlongctx/sub/b.py": "def f():\n    from jaxlongctx.sub import a\n",
        "convert/c.py": "import jaxlongctx.sub.b\n",
        "pallas_kernels/k.py": "import pallas_kernels.k\n",
    }
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    files = module_files(tmp_path)
    graph = import_graph(files)
    assert graph == {
        "jaxlongctx": {"jaxlongctx.low"},
        "jaxlongctx.low": set(),
        "jaxlongctx.sub": {"jaxlongctx.sub.a"},
        "jaxlongctx.sub.a": {"jaxlongctx.low", "jaxlongctx.sub.b"},
        "jaxlongctx.sub.b": {"jaxlongctx.sub.a"},
        "convert.c": {"jaxlongctx.sub.b"},
        "pallas_kernels.k": set(),
    }
    assert strongly_connected(graph) == [["jaxlongctx.sub.a", "jaxlongctx.sub.b"]]


def test_no_import_cycles():
    """No two modules of the packages import each other, directly or through others."""
    graph = import_graph(module_files())
    assert len(graph) > 50 and "jaxlongctx.model.model" in graph  # the packages were found
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        describe(c, graph) for c in cycles
    )
