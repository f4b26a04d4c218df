"""scripts/measure_cpu_core.py in quick mode: every rate is measured and the constants follow
from them as documented; apps.planning.CPU_CORE holds the published constants (so the planner's
CPU prices cannot drift from their measurement). Timings themselves are not checked."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from apps.planning import CPU_CORE
from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


def test_measure_cpu_core_quick(tmp_path: Path) -> None:
    out = tmp_path / "cpu_core.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "measure_cpu_core.py"), "--quick",
         "--repeats", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert_provenance(report)
    assert report["threads"] == 1
    rows = report["elementwise"]
    assert {r["layer"] for r in rows} == {"relu", "batchnorm2d", "layernorm", "maxpool3x3",
                                          "avgpool3x3", "gelu", "add"}
    for row in rows:
        assert row["traffic_bytes"] > 0 and row["seconds"] > 0
        assert row["bytes_per_s"] == pytest.approx(row["traffic_bytes"] / row["seconds"])
    constants = report["constants"]
    assert constants["memory_bandwidth"] == statistics.median(r["bytes_per_s"] for r in rows)
    assert constants["peak_flops"] == 2 * statistics.median(
        report["matmul_flops_per_s"].values())
    assert constants["op_overhead"] == report["tiny_op_seconds"] > 0


def test_the_apps_cpu_core_is_the_published_measurement() -> None:
    published = json.loads((ROOT / "docs" / "reproduction" / "cpu_core.json").read_text())
    assert published.get("draft") is not True
    for name, value in published["constants"].items():
        assert getattr(CPU_CORE, name) == pytest.approx(value, rel=0.01), name
    assert published["provenance"]["cpu_model"] in CPU_CORE.source
