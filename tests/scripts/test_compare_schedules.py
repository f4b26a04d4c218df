"""scripts/compare_schedules.py: every schedule in the simulator, with a picture each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.compare_schedules import compare

ROOT = Path(__file__).resolve().parents[2]


def test_zero_bubble_and_virtual_schedules_beat_1f1b_in_unit_time() -> None:
    rows = {r["schedule"]: r for r in compare(2, 8, 1.0, 2.0, 1.0, 0.0)}
    assert rows["1f1b"]["step_time"] == 27.0  # 3(M + K - 1)
    assert rows["zb_h1"]["step_time"] == 25.0  # a third of 1F1B's bubble of 3
    for name in ("interleaved_zb", "zb_v", "dualpipe_v"):
        assert rows[name]["step_time"] == 24.5, name  # a half-stage unit of bubble
    assert rows["zb_v"]["peak_microbatches_per_rank"] == [2.0, 2.0]  # 1F1B's first stage
    assert rows["gpipe"]["vs_gpipe_ideal"] == pytest.approx(1.0)
    skipped = {r["schedule"] for r in compare(2, 3, 1.0, 2.0, 1.0, 0.0) if "skipped" in r}
    assert skipped == {"dualpipe_v"}  # needs M >= 2R


def test_script_writes_json_and_pictures(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "scripts/compare_schedules.py", "--ranks", "2",
                             "--microbatches", "4", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "schedules_r2_m4.json").read_text())
    assert len(report["rows"]) == 8
    assert (tmp_path / "r2_m4_zb_v.png").stat().st_size > 1000
    assert "interleaved_zb" in result.stdout
