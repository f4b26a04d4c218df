"""scripts/bench_overhead.py runs end to end on tiny models with its quick settings (its timings
are not checked) and publishes its rows with provenance and every step's samples."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


def test_bench_overhead_publishes_samples(tmp_path: Path) -> None:
    published = tmp_path / "bench_overhead.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--quick", "--tiny",
         "--repeats", "2", "--out", str(tmp_path / "rows.json"), "--json", str(published)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(published.read_text())
    assert_provenance(report)
    assert json.loads((tmp_path / "rows.json").read_text()) == report["rows"]
    variants = {(r["model"], r["variant"], r["partitions"], r["chunks"], r["checkpoint"])
                for r in report["rows"]}
    assert ("transformer", "plain", 0, 1, "-") in variants
    assert ("conv", "gpipe", 2, 8, "always") in variants
    for row in report["rows"]:
        assert len(row["samples"]) == 2
        assert row["seconds"] == pytest.approx(statistics.median(row["samples"]))
    assert "runtime overhead at K=1" in result.stdout
