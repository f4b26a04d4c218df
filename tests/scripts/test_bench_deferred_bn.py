"""scripts/bench_deferred_bn.py runs end to end on the tiny AmoebaNet config (its timings are
not checked) and publishes every round of both models, the medians, the ratio and the count of
rounds within 5%, with provenance."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


def test_bench_deferred_bn_publishes_paired_rounds(tmp_path: Path) -> None:
    published = tmp_path / "deferred_bn.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_deferred_bn.py"), "--config=tiny_test",
         "--rounds", "3", "--steps", "1", "--out", str(published)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(published.read_text())
    assert_provenance(report)
    rounds = report["rounds"]
    assert len(rounds) == 3 and all(r["plain"] > 0 and r["deferred"] > 0 for r in rounds)
    ratios = [r["deferred"] / r["plain"] for r in rounds]
    assert report["median_ratio_deferred_over_plain"] == pytest.approx(statistics.median(ratios))
    assert report["rounds_within_5_percent"] == sum(r <= 1.05 for r in ratios)
    assert report["median_s"]["plain"] == statistics.median(r["plain"] for r in rounds)
    assert "deferred / plain" in result.stdout
