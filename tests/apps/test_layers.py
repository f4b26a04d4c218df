"""The arrows between data/ and apps/: data/ is the layer below the apps, never above them.

data/ holds the preparers and the on-disk formats they write (``data/image_shards.py``,
``data/gettext_m2en/corpus_format.py``); it imports nothing from apps/, scripts/ or gpipe_core/.
apps/ reads the data through those format modules only; its training entry points also call a
preparer, to build a missing dataset. So a script that only writes shards loads neither the
apps, nor timm, nor gpipe_core.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORMAT_MODULES = {"data.image_shards", "data.gettext_m2en.corpus_format"}
# what a training entry point uses to build a missing dataset before it trains
PREPARERS = {"data.fashion_mnist.prepare", "data.gettext_m2en.prepare",
             "data.gettext_m2en.errors", "data.gettext_m2en.fetch"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (at the top or inside a function), by absolute name."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            package = REPO / node.module.replace(".", "/")
            if package.is_dir():  # `from data.gettext_m2en import prepare` imports a module
                modules.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                modules.add(node.module)
    return modules


def sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", sources("data"), ids=lambda p: str(p.relative_to(REPO)))
def test_data_imports_nothing_of_the_apps_scripts_or_library(path: Path) -> None:
    upward = sorted(m for m in imported_modules(path)
                    if m.split(".")[0] in ("apps", "scripts", "gpipe_core", "tests"))
    assert not upward, f"{path.relative_to(REPO)} imports {upward}; data/ is below them"


@pytest.mark.parametrize("path", sources("apps"), ids=lambda p: str(p.relative_to(REPO)))
def test_apps_read_data_through_the_format_modules(path: Path) -> None:
    allowed = FORMAT_MODULES | (PREPARERS if path.name == "train.py" else set())
    other = sorted(m for m in imported_modules(path)
                   if m.split(".")[0] == "data" and m not in allowed)
    assert not other, (f"{path.relative_to(REPO)} imports {other}; the apps may import "
                       f"{sorted(FORMAT_MODULES)} (and train.py the preparers)")


def test_writing_shards_loads_no_app_timm_or_library(tmp_path: Path) -> None:
    script = """
import sys
import numpy as np
import data.fashion_mnist.prepare, data.gettext_m2en.prepare, data.imagenet.prepare
heavy = ("apps", "scripts", "gpipe_core", "timm", "torch", "webdataset")
print("import:", sorted(m for m in sys.modules if m.split(".")[0] in heavy))
from data.image_shards import Sample, encode_png, write_split
pixels = np.zeros((4, 4), dtype=np.uint8)
write_split([Sample("a", encode_png(pixels), "png", 0)], sys.argv[1], "train", num_classes=1)
print("write:", sorted({m.split(".")[0] for m in sys.modules} & {"apps", "gpipe_core", "timm"}))
"""
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["import: []", "write: []"]
    assert (tmp_path / "train-000000.tar").is_file()
