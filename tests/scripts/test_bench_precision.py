"""scripts/bench_precision.py runs end to end with one paired round per row (its timings are
not checked) and publishes every row's samples, ratio and win count with provenance."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_precision_publishes_paired_rounds(tmp_path: Path) -> None:
    published = tmp_path / "precision.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_precision.py"), "--rounds", "2",
         "--app-rounds", "1", "--apps", "nmt_app", "--json", str(published)],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(published.read_text())
    assert_provenance(report)
    assert [row.get("app") for row in report["rows"]] == [None, None, "nmt_app"]
    for row in report["rows"]:
        fp32, bf16 = row["samples"]["fp32"], row["samples"]["bf16"]
        assert len(fp32) == len(bf16) == row["rounds"]
        assert row["fp32_seconds"] == statistics.median(fp32)
        assert row["speedup"] == pytest.approx(row["fp32_seconds"] / row["bf16_seconds"])
        assert row["bf16_wins"] == sum(b < f for f, b in zip(fp32, bf16, strict=True))
    assert report["rows"][0]["gflops"]["bf16"] > 0
    assert "bf16 faster in" in result.stdout


def write_run(path: Path, precision: str, steps: int = 400, lr: float = 3e-3) -> Path:
    path.mkdir()
    (path / "config.yaml").write_text(f"precision: {precision}\nlr: {lr}\nout_dir: {path}\n")
    (path / "summary.json").write_text(json.dumps(
        {"steps": steps, "dev_loss": 4.0, "dev": {"high": {"bleu": 5.0}}, "ignored": 1}))
    return path


def test_quality_pairs_only_runs_that_differ_in_precision_alone(tmp_path: Path) -> None:
    from scripts.bench_precision import quality

    fp32, bf16 = write_run(tmp_path / "a", "fp32"), write_run(tmp_path / "b", "bf16")
    report = quality(fp32, bf16)
    assert report["summaries"]["bf16"] == {"steps": 400, "dev_loss": 4.0,
                                           "dev": {"high": {"bleu": 5.0}}}
    with pytest.raises(SystemExit, match="not bf16"):
        quality(fp32, fp32)
    with pytest.raises(SystemExit, match=r"\['lr'\]"):
        quality(fp32, write_run(tmp_path / "c", "bf16", lr=1e-3))
    with pytest.raises(SystemExit, match="steps 400 and 300"):
        quality(fp32, write_run(tmp_path / "d", "bf16", steps=300))
