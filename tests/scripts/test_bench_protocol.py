"""scripts/bench_protocol.py: the summary over independent runs, and resuming from their JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_protocol import main, summarize_family

OURS, TORCH = "gpipe_core", "torch.pipelining"


def row(impl: str, schedule: str, samples: list[float], m: int = 8) -> dict[str, object]:
    return {"impl": impl, "schedule": schedule, "M": m, "samples": samples,
            "seconds": sorted(samples)[len(samples) // 2]}


def run(ours_1f1b: list[float], ours_zb: list[float], torch_1f1b: list[float],
        torch_dual: list[float]) -> dict[str, object]:
    return {"rows": [row("plain", "whole", [9.0, 9.0, 9.0]),
                     row(OURS, "1f1b", ours_1f1b), row(OURS, "zb_h1", ours_zb),
                     row(TORCH, "1f1b", torch_1f1b), row(TORCH, "dualpipe_v", torch_dual),
                     row(OURS, "1f1b", [0.1, 0.1, 0.1], m=4)]}  # another M: ignored


def test_summary_compares_each_runs_fastest_and_counts_paired_rounds() -> None:
    runs = [
        # run 1: ours best 1f1b 1.0, torch best dualpipe_v 1.1 -> 1.10; rounds 3 of 3
        run([1.0, 1.0, 1.0], [1.2, 1.2, 1.2], [1.3, 1.3, 1.3], [1.1, 1.1, 1.1]),
        # run 2: ours best zb_h1 0.9, torch best 1f1b 0.9 (round 2 lost, round 3 tied) -> 1.00
        run([1.0, 1.0, 1.0], [0.8, 0.9, 0.9], [0.95, 0.85, 0.9], [1.0, 1.0, 1.0]),
        # run 3: ours 1.0, torch 1.2 -> 1.20
        run([1.0, 1.0, 1.0], [1.1, 1.1, 1.1], [1.2, 1.2, 1.2], [1.3, 1.3, 1.3]),
    ]
    result = summarize_family(runs, 8)
    assert [r["ours"] for r in result["runs"]] == ["1f1b", "zb_h1", "1f1b"]
    assert [r["torch"] for r in result["runs"]] == ["dualpipe_v", "1f1b", "1f1b"]
    assert [r["torch_over_ours"] for r in result["runs"]] == pytest.approx([1.1, 1.0, 1.2])
    assert result["torch_over_ours_median"] == pytest.approx(1.1)
    assert result["torch_over_ours_range"] == pytest.approx([1.0, 1.2])
    assert (result["paired_rounds_ours_faster"], result["paired_rounds"]) == (3 + 1 + 3, 9)
    assert result["goal_met"] is True
    assert result["split_over_our_1f1b_median"] == {"zb_h1": pytest.approx(1.1)}
    # one run below 1.05 of three does not fail the goal; a median below does
    assert summarize_family(runs[1:2] * 2 + runs[:1], 8)["goal_met"] is False


def test_main_resumes_from_the_runs_json_and_writes_the_summary(tmp_path: Path) -> None:
    for r, data in enumerate([run([1.0] * 3, [1.1] * 3, [1.2] * 3, [1.3] * 3),
                              run([1.0] * 3, [1.1] * 3, [1.0] * 3, [1.3] * 3)], start=1):
        (tmp_path / f"encoder_run{r}.json").write_text(json.dumps(data))
    summary = main(["--families", "encoder", "--runs", "2", "--out-dir", str(tmp_path)])
    family = summary["families"]["encoder"]
    assert family["torch_over_ours_median"] == pytest.approx(1.1)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["families"]["encoder"]["paired_rounds"] == 6
    assert {"commit", "torch", "utc"} <= set(written["provenance"])
