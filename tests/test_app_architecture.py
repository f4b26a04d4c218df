"""The apps' imports, read with ``ast`` (nothing is imported): no import circle among the
modules of ``apps/``, and the commands (``python -m apps.<app>.<command>``) are thin tops that
no module imports.

Every import counts, wherever it stands: at the top, inside a function (lazy) or under
``if TYPE_CHECKING:`` (type-only): a reader of A still needs B. ``from apps.x import y``
is an arrow to the module ``apps.x.y`` when that is a module, else to ``apps.x``. Unlike the
library (``tests/test_architecture.py``), a package is not one node: each file is.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The commands users run, and the most lines each may hold: option parsing, the torchrun
# switch and error lines; the work is in the modules below them.
COMMANDS = {
    "apps.nmt.evaluate": 200,
    "apps.nmt.translate": 300,
    "apps.amoebanet.evaluate": 250,
    "apps.amoebanet.classify": 250,
}

# Circles known and owned elsewhere, each to be removed here when its circle is gone (the test
# fails then, so that this list cannot outlive them). None is left: the harness's checkpoints and
# writes both import their failure message from write_failures below them.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``root / "apps"``."""
    found = {}
    for path in sorted((root / "apps").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def arrows(found: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the apps modules it imports}``."""
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in found else base
                           for alias in node.names]
            for target in targets:
                while target and target not in found:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_among_the_apps_modules() -> None:
    found = set(circles(arrows(modules())))
    new = found - KNOWN_CIRCLES
    assert not new, f"import circles in apps/: {[sorted(c) for c in new]}"
    gone = KNOWN_CIRCLES - found
    assert not gone, f"no longer a circle, remove it from KNOWN_CIRCLES: {[sorted(c) for c in gone]}"


def test_the_commands_are_thin_tops() -> None:
    found = modules()
    graph = arrows(found)
    entry = {name for name, path in found.items() if '__name__ == "__main__"' in path.read_text()}
    tops = {*COMMANDS, "apps.nmt.train", "apps.amoebanet.train"}
    assert tops <= entry
    importers = {name: sorted(source for source, targets in graph.items() if name in targets)
                 for name in sorted(tops)}
    assert not any(importers.values()), (
        f"a command is imported as a library (move what is shared below it): {importers}")
    for name, most in COMMANDS.items():
        lines = len(found[name].read_text().splitlines())
        assert lines <= most, f"{found[name]} has {lines} lines (at most {most}): move work below"


def test_the_reading_of_imports(tmp_path: Path) -> None:
    # every kind of import, a name inside a module, a submodule by from-import, relative ones
    root = tmp_path / "apps"
    (root / "x").mkdir(parents=True)
    for name in ("__init__.py", "x/__init__.py"):
        (root / name).write_text("")
    (root / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from apps.x.b import B\n")
    (root / "x" / "b.py").write_text("def f():\n    from . import c\n")
    (root / "x" / "c.py").write_text("import apps.a\nfrom apps.x import b\nimport torch\n")
    (root / "x" / "d.py").write_text("from ..a import A\nfrom apps import x\n")
    graph = arrows(modules(tmp_path))
    assert graph == {"apps": set(), "apps.a": {"apps.x.b"}, "apps.x": set(),
                     "apps.x.b": {"apps.x.c"}, "apps.x.c": {"apps.a", "apps.x.b"},
                     "apps.x.d": {"apps.a", "apps.x"}}
    assert circles(graph) == [frozenset({"apps.a", "apps.x.b", "apps.x.c"})]
