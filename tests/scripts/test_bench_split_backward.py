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
         "--op-rounds", "2", "--out", str(tmp_path / "out"), "--json", str(published)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(published.read_text())
    assert json.loads((tmp_path / "out" / f"{model}.json").read_text()) == report
    assert_provenance(report)
    assert report["config"]["rounds"] == 3
    assert [r["checkpoint"] for r in report["rows"]] == ["never", "always"]
    assert_rows(report["rows"], rounds=3)


def assert_rows(rows: list[dict], rounds: int) -> None:  # type: ignore[type-arg]
    for row in rows:
        for kind in ("B", "I", "W", "I_autograd", "W_autograd"):
            samples = row["samples"][kind]
            assert len(samples) == rounds and all(s > 0 for s in samples)
        for kind in ("B", "I", "W", "W_autograd"):
            assert row[kind] == pytest.approx(sorted(row["samples"][kind])[rounds // 2])
        assert 0 <= row["W_rounds_won_by_direct"] <= rounds
        ops = row["operators"]  # every kind's arithmetic, under the profiler
        for kind in ("B", "I", "W"):
            assert ops[kind]["wall_minus_aten_s"] == pytest.approx(
                row[kind] - ops[kind]["aten_s"], rel=1e-9)
            top = ops[kind]["top_aten_s"]
            # (a first stage's I has nothing to do: no operator)
            assert bool(top) == (ops[kind]["aten_s"] > 0)
            assert all(name.startswith("aten::") and s >= 0 for name, s in top.items())
        # a backward's costliest operators are products (linear) or convolutions
        assert ops["B"]["aten_s"] > 0 and any(
            name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::convolution_backward")
            for name in ops["B"]["top_aten_s"])


def test_bench_split_backward_on_the_apps_stages(tmp_path: Path) -> None:
    published = tmp_path / "split_backward.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_split_backward.py"), "--model",
         "amoebanet_app", "--rounds", "1", "--op-rounds", "1", "--out", str(tmp_path / "out"),
         "--json", str(published)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(published.read_text())
    assert_provenance(report)
    assert [r["stage"] for r in report["rows"]] == ["stage0", "stage1"]
    assert_rows(report["rows"], rounds=1)
