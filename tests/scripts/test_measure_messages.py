"""scripts/measure_messages.py in quick mode: two real gloo ranks exchange messages through the
runtime's Channel, each end's CPU time is measured, and the constants are the stated fits of the
rows; apps.planning.CPU_CORE holds the published ones. Timings themselves are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apps.planning import CPU_CORE
from scripts.measure_messages import fit_line
from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


def test_fit_line_is_least_squares() -> None:
    assert fit_line([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == pytest.approx((1.0, 2.0))
    # the residuals of a noisy set sum to zero and are uncorrelated with x
    points = [(1.0, 2.0), (2.0, 2.5), (4.0, 5.5), (8.0, 8.0)]
    a, b = fit_line(points)
    residuals = [y - a - b * x for x, y in points]
    assert sum(residuals) == pytest.approx(0.0, abs=1e-12)
    assert sum(r * x for r, (x, _) in zip(residuals, points, strict=True)) == pytest.approx(
        0.0, abs=1e-12)


@pytest.mark.distributed
def test_measure_messages_quick(tmp_path: Path) -> None:
    out = tmp_path / "cpu_messages.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "measure_messages.py"),
                             "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert_provenance(report)
    rows = report["rows"]
    assert [r["bytes"] for r in rows] == [32 * 1024, 4096 * 1024]
    for row in rows:
        assert row["send_cpu_s"] > 0 and row["receive_cpu_s"] > 0
        assert row["end_cpu_s"] == pytest.approx((row["send_cpu_s"] + row["receive_cpu_s"]) / 2)
        for rank in row["samples"]:  # 2 rounds, each rank sending and receiving once per round
            assert len(rank["send_cpu_s"]) == len(rank["receive_cpu_s"]) == 2
            assert len(rank["stream_wall_s"]) == 4
    overhead, per_byte = fit_line([(r["bytes"], r["end_cpu_s"]) for r in rows])
    constants = report["constants"]
    assert constants["message_overhead"] == pytest.approx(max(overhead, 0.0))
    assert constants["message_bandwidth"] == pytest.approx(1 / per_byte)


def test_the_apps_cpu_core_charges_the_published_messages() -> None:
    published = json.loads((ROOT / "docs" / "reproduction" / "cpu_messages.json").read_text())
    assert published.get("draft") is not True
    for name, value in published["constants"].items():
        assert getattr(CPU_CORE, name) == pytest.approx(value, rel=0.01), name
    assert published["provenance"]["cpu_model"] in CPU_CORE.source
