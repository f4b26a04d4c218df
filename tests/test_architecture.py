"""The map of the library in docs/ARCHITECTURE.md is the code's: its table of levels and arrows
is compared with the imports of ``gpipe_core``, read with ``ast`` (nothing is imported).

What counts as an arrow ``A -> B`` (module A imports module B of the library):

- every import of B in A, wherever it stands: at the top of the file, inside a function (a
  *lazy* import defers a cost, not a dependency: A still needs B to run), or under
  ``if TYPE_CHECKING:`` (a *type-only* import: A's signatures still name B's types, so a reader
  of A must know B). The table marks the last two kinds, ``(lazy)`` and ``(types)``, so the
  page says how each arrow is made; an import of B of more than one kind counts as the
  strongest (top > lazy > types);
- a package (``gpipe_core/sequentializer/``) is one module: its files' imports of one another
  are its own, its imports of other modules are its arrows;
- the face, ``gpipe_core/__init__.py``, hands the public names on: it stands above every
  module and has no row; a module that imports the face (``import gpipe_core``) is an error.

A module's level is 1 if it imports no module of the library, else one more than the highest
level it imports; ``apart`` is a module with no arrow in or out (a tool around the library).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpipe_core

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpipe_core"
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
FACE = "__init__"
KINDS = ("top", "lazy", "types")  # strongest first
TABLE_HEADER = "| level | module | imports | concept |"


@dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    kind: str  # one of KINDS


def _module_name(path: Path) -> str:
    """``gpipe_core.x`` for ``gpipe_core/x.py``, ``gpipe_core.pkg`` for its ``__init__.py``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _node(dotted: str) -> str | None:
    """The row a dotted module name belongs to: the first name under ``gpipe_core`` (a package
    is one row), ``__init__`` for the face, ``None`` outside the library."""
    parts = dotted.split(".")
    if parts[0] != "gpipe_core":
        return None
    return parts[1] if len(parts) > 1 else FACE


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> list[tuple[str, str]]:
    """``(dotted module, kind)`` for every import in the file, relative ones resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str]] = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level == 0:
            base = node.module or ""
        else:
            parts = package.split(".")
            if node.level > 1:
                parts = parts[: -(node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        # ``from . import wire`` imports the submodule ``wire``; ``from .x import y`` imports x
        # (y is a name in it, or a submodule of x: either way an arrow to x's row, or finer).
        return [f"{base}.{alias.name}" for alias in node.names] if node.module is None else [base]

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                child_kind = "lazy" if kind == "top" else kind
            if isinstance(child, ast.Import):
                found.extend((alias.name, kind) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.extend((target, kind) for target in resolve(child))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), "types")
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), kind)
                continue
            visit(child, child_kind)

    visit(ast.parse(path.read_text(), filename=str(path)), "top")
    return found


def code_arrows() -> set[Arrow]:
    """Every arrow between two rows of the library, each at its strongest kind."""
    strongest: dict[tuple[str, str], str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _node(_module_name(path))
        assert source is not None
        for dotted, kind in _imports(path):
            target = _node(dotted)
            if target is None or target == source:
                continue
            key = (source, target)
            if key not in strongest or KINDS.index(kind) < KINDS.index(strongest[key]):
                strongest[key] = kind
    return {Arrow(source, target, kind) for (source, target), kind in strongest.items()}


def code_modules() -> set[str]:
    return {_node(_module_name(path)) or "" for path in PACKAGE.rglob("*.py")} - {FACE}


def levels(modules: set[str], arrows: set[Arrow]) -> dict[str, int | str]:
    """Each module's level (see the module docstring); fails naming a cycle if there is one."""
    imports: dict[str, set[str]] = {m: set() for m in modules}
    for arrow in arrows:
        imports[arrow.source].add(arrow.target)
    level: dict[str, int] = {}
    path: list[str] = []

    def of(module: str) -> int:
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail(f"import cycle in gpipe_core: {' -> '.join(cycle)}")
        if module not in level:
            path.append(module)
            level[module] = 1 + max((of(t) for t in imports[module]), default=0)
            path.pop()
        return level[module]

    imported = {arrow.target for arrow in arrows}
    return {m: ("apart" if not imports[m] and m not in imported else of(m)) for m in modules}


@dataclass(frozen=True)
class Row:
    level: int | str
    module: str
    imports: frozenset[tuple[str, str]]  # (target, kind)


def _format_imports(imports: frozenset[tuple[str, str]]) -> str:
    if not imports:
        return "-"
    return ", ".join(f"`{t}`" + ("" if k == "top" else f" ({k})") for t, k in sorted(imports))


def expected_rows() -> list[Row]:
    arrows = {a for a in code_arrows() if a.source != FACE}
    modules = code_modules()
    level = levels(modules, arrows)
    rows = [Row(level[m], m, frozenset((a.target, a.kind) for a in arrows if a.source == m))
            for m in modules]
    return sorted(rows, key=lambda r: (r.level == "apart", -r.level if isinstance(r.level, int)
                                       else 0, r.module))


def page_rows() -> list[Row]:
    lines = PAGE.read_text().splitlines()
    assert TABLE_HEADER in lines, f"docs/ARCHITECTURE.md has no table {TABLE_HEADER!r}"
    rows = []
    for line in lines[lines.index(TABLE_HEADER) + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"a row of the level table needs 4 cells: {line!r}"
        level_cell, module_cell, imports_cell, _concept = cells
        module = re.fullmatch(r"`([\w.]+)`", module_cell)
        assert module, f"the module cell names one module in backticks: {line!r}"
        imports = set()
        if imports_cell != "-":
            for item in imports_cell.split(","):
                found = re.fullmatch(r"`(\w+)`(?: \((lazy|types)\))?", item.strip())
                assert found, f"an import is `name`, `name` (lazy) or `name` (types): {item!r}"
                imports.add((found[1], found[2] or "top"))
        rows.append(Row(level_cell if level_cell == "apart" else int(level_cell),
                        module[1], frozenset(imports)))
    return rows


def test_the_architecture_page_is_the_code() -> None:
    expected, shown = expected_rows(), page_rows()
    if set(shown) != set(expected):
        table = "\n".join(f"| {r.level} | `{r.module}` | {_format_imports(r.imports)} | ... |"
                          for r in expected)
        by_module = {r.module: r for r in shown}
        wrong = [r.module for r in expected if by_module.get(r.module) != r]
        extra = sorted(set(by_module) - {r.module for r in expected})
        pytest.fail(f"docs/ARCHITECTURE.md's level table differs from the imports of gpipe_core "
                    f"in {wrong} (rows of no module: {extra}); the code's rows, to keep the "
                    f"concepts beside:\n{TABLE_HEADER}\n{table}")
    assert len(shown) == len(expected), "a module has two rows in docs/ARCHITECTURE.md"


def test_arrows_point_down_and_no_module_imports_the_face() -> None:
    arrows = code_arrows()
    into_face = sorted(a.source for a in arrows if a.target == FACE and a.source != FACE)
    assert not into_face, (f"{into_face} import the package face (gpipe_core/__init__.py), which "
                           "imports everything: import the module that defines the name")
    levels(code_modules(), {a for a in arrows if a.source != FACE})  # fails on a cycle


def test_the_reading_of_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The three kinds, a package and relative imports of every depth, on a made-up library.
    package = tmp_path / "gpipe_core"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .b import f\n")
    (package / "a.py").write_text("")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nimport torch\nfrom . import a\n"
        "if TYPE_CHECKING:\n    from .c import C\n"
        "def g():\n    from .sub.inner import h\n    from .a import x\n")
    (package / "c.py").write_text("import gpipe_core.a\n")
    (package / "sub" / "__init__.py").write_text("from .inner import h\nfrom ..a import y\n")
    (package / "sub" / "inner.py").write_text("from . import other\nfrom ..c import z\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert code_arrows() == {
        Arrow(FACE, "b", "top"), Arrow("b", "a", "top"), Arrow("b", "c", "types"),
        Arrow("b", "sub", "lazy"), Arrow("c", "a", "top"), Arrow("sub", "a", "top"),
        Arrow("sub", "c", "top")}
    assert levels(code_modules(), {a for a in code_arrows() if a.source != FACE}) == {
        "a": 1, "c": 2, "sub": 3, "b": 4}



def test_no_public_name_shadows_another_modules_submodule() -> None:
    # ``gp.NAME`` for a submodule's NAME hides the submodule from ``import gpipe_core.NAME as m``
    # (the package's attribute wins). Where NAME is the submodule's own entry point (gp.simulate
    # from gpipe_core/simulator.py) the two at least mean the same thing; a name from another
    # module misleads: gp.gpipe, the schedule builder, hid gpipe_core.gpipe, GPipe's module
    # (now gpipe_core.pipe, the builder gp.fill_drain).
    for info in pkgutil.iter_modules(gpipe_core.__path__):
        module = importlib.import_module(f"gpipe_core.{info.name}")
        public = getattr(gpipe_core, info.name)
        assert public is module or getattr(public, "__module__", None) == module.__name__, (
            f"gp.{info.name} is {public!r} from {getattr(public, '__module__', '?')}, and hides "
            f"the submodule gpipe_core.{info.name}: rename one of them")
