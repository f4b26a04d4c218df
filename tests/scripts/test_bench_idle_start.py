"""scripts/bench_idle_start.py end to end on one small round (its ratios are not checked)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from scripts.bench_idle_start import CONDITIONS, main
from tests.scripts.published import assert_provenance


def test_every_condition_is_timed_and_written_with_provenance(tmp_path: Path) -> None:
    out = tmp_path / "idle_start.json"
    # --core -1: the test process keeps its cores (pinning would outlive the test)
    report = main(["--rounds", "2", "--warmup", "1", "--layers", "1", "--core", "-1",
                   "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert_provenance(report)
    assert [r["condition"] for r in report["rows"]] == list(CONDITIONS)
    base = report["rows"][0]
    for row in report["rows"]:  # each row's medians, and its ratios to the first row's
        for kind in ("forward", "backward"):
            assert row[f"{kind}_s"] == statistics.median(
                report["samples"][row["condition"]][kind]) > 0
            assert row[f"{kind}_over_back_to_back"] == pytest.approx(
                row[f"{kind}_s"] / base[f"{kind}_s"], rel=1e-12)
    assert all(len(s["forward"]) == 2 for s in report["samples"].values())
