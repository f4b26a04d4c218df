"""scripts/bench_decoding.py runs end to end on a tiny model (its timings are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_bench_decoding_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "decoding.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_decoding.py"), "--num-layers", "1",
         "--d-model", "16", "--ffn-dim", "32", "--num-heads", "2", "--head-dim", "8",
         "--vocab", "40", "--sentences", "5", "--min-src", "2", "--max-src", "5",
         "--max-len", "4", "--beams", "2", "1", "--groups", "1", "3", "--rounds", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["beam"], r["config"]): r for r in report["rows"]}
    assert set(rows) == {(beam, config) for beam in (2, 1)
                         for config in ("single1", "single2", "G1", "G3")}
    for (_, config), row in rows.items():
        assert row["seconds"] > 0 and len(row["samples"]) == 1 and row["sentences_per_s"] > 0
        assert len(row["peak_tensor_bytes_per_rank"]) == 2
        if config.startswith("G"):
            assert row["exact_vs_one_process_same_groups"] is True
            held = row["param_bytes_per_rank"]
            assert all(h > 0 for h in held) and sum(held) == report["model_param_bytes"]
    assert_provenance(report)
    assert "sent/s" in result.stdout


def test_bench_decoding_rejects_zero_rounds() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_decoding.py"), "--rounds", "0"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 2
    assert "--rounds 0 must be at least 1" in result.stderr
