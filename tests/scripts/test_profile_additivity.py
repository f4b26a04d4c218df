"""scripts/profile_additivity.py end to end on a tiny model: every stage of both layouts gets
its whole replay and its layers' sums, the ratios and the summary follow from them (the
seconds themselves are not checked: timing on a shared machine)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


def test_profile_additivity_compares_every_stage_with_its_layers(tmp_path: Path) -> None:
    out = tmp_path / "profile_additivity.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "profile_additivity.py"), "--quick",
         "--families", "mlp", "--repeats", "2", "--rounds", "1", "--scratch", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert_provenance(report)
    family = report["families"]["mlp"]
    rows = family["stages"]
    assert [(r["layout"], r["stage"]) for r in rows] == [
        ("1f1b", 0), ("1f1b", 1), *(("interleaved_1f1b", s) for s in range(4))]
    for r in rows:
        assert r["layers"] == r["balance"][r["stage"]] and len(r["samples"]["whole"]) == 2
        for field in ("whole", "layers_packed", "layers_unpacked",
                      "layers_unpacked_and_messages"):
            assert r[field] == statistics.median(r["samples"][field]) > 0
            if field != "whole":
                assert r[f"{field}_over_whole"] == pytest.approx(r[field] / r["whole"])
        # the message compute is added, never taken away: the same profile's sum beneath it
        assert all(with_messages >= alone for with_messages, alone in zip(
            r["samples"]["layers_unpacked_and_messages"], r["samples"]["layers_unpacked"],
            strict=True))
    summary = family["summary"]
    assert summary["stages"] == 6
    assert 0 <= summary["stages_nearer_unpacked_and_messages"] <= 6
    assert summary["mean_abs_error_packed"] == pytest.approx(
        statistics.mean(abs(r["layers_packed_over_whole"] - 1) for r in rows))
