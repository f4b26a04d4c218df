"""The docs' code runs: docs/SCHEDULES.md's worked example, block by block, as one module."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES_PAGE = ROOT / "docs" / "SCHEDULES.md"


def blocks(page: Path, language: str) -> list[str]:
    """The page's fenced code blocks in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def load_page(page: Path, directory: Path, name: str) -> ModuleType:
    """The page's Python blocks written to ``directory/name.py`` and imported; ``directory``
    must be on ``sys.path`` for processes it spawns to import its functions too."""
    (directory / f"{name}.py").write_text("\n\n".join(blocks(page, "python")))
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)  # the page's own asserts run here
    return module


@pytest.fixture
def schedules_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.chdir(tmp_path)  # the example writes its timeline picture here
    monkeypatch.syspath_prepend(str(tmp_path))
    return load_page(SCHEDULES_PAGE, tmp_path, "schedules_page")


def test_schedules_page_writes_validates_draws_and_simulates(schedules_page: ModuleType,
                                                              tmp_path: Path) -> None:
    # The grid the page shows is the one draw() prints.
    shown = blocks(SCHEDULES_PAGE, "text")
    assert schedules_page.grid + "\n" in shown
    assert (tmp_path / "deferred_weights.png").stat().st_size > 1000
    # The function builds a valid schedule for any size, not only the page's.
    for stages, microbatches in ((1, 1), (2, 5), (4, 3)):
        schedules_page.validate(schedules_page.deferred_weights(stages, microbatches))


@pytest.mark.distributed
def test_schedules_page_runs_its_schedule_on_two_processes(schedules_page: ModuleType) -> None:
    schedules_page.check_against_the_plain_model()
