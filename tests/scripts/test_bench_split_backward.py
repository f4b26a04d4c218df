"""scripts/bench_split_backward.py runs end to end on a tiny stage (its timings are not checked)
and publishes its result with provenance and every round's samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_bench_split_backward_publishes_samples(tmp_path: Path, model: str) -> None:
    published = tmp_path / "split_backward.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_split_backward.py"), "--model", model,
         "--blocks", "2", "--width", "64", "--batch", "2", "--seq", "3", "--rounds", "3",
         "--out", str(tmp_path / "out"), "--json", str(published)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(published.read_text())
    assert json.loads((tmp_path / "out" / f"{model}.json").read_text()) == report
    assert_provenance(report)
    assert report["config"]["rounds"] == 3
    assert [r["checkpoint"] for r in report["rows"]] == ["never", "always"]
    for row in report["rows"]:
        for kind in ("B", "I", "W"):
            assert len(row["samples"][kind]) == 3 and all(s > 0 for s in row["samples"][kind])
            assert row[kind] == pytest.approx(sorted(row["samples"][kind])[1])
