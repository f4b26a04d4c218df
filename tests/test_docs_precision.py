"""docs/MIXED_PRECISION.md's example runs, and its table names test files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_docs import ROOT, load_page

PAGE = ROOT / "docs" / "MIXED_PRECISION.md"


def test_the_mixed_precision_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    page = load_page(PAGE, tmp_path, "mixed_precision_page")  # its asserts run here
    assert page.out.dtype.is_floating_point


def test_the_page_names_tests_that_exist() -> None:
    named = set(re.findall(r"`(tests/[\w/]+\.py)`", PAGE.read_text()))
    assert {"tests/test_precision.py", "tests/distributed/test_precision.py"} <= named
    for path in named:
        assert (ROOT / path).is_file(), path
