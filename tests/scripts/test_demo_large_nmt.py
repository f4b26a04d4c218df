"""scripts/demo_large_nmt.py at test size: train, checkpoint and evaluate on 2 pipeline ranks,
each process's memory measured, and the whole model measured in one process (~20 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import demo_large_nmt

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_tiny_demo_measures_every_process(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    assert demo_large_nmt.main(["--tiny", "--data-dir", str(corpus), "--budget-mb", "256",
                                "--run-dir", str(tmp_path / "run"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["train"]["steps"] == 2 and result["train"]["dev_loss"] > 0
    assert set(result["dev_bleu"]) == {"high", "medium", "low"}
    assert sum(result["stage_parameters"]) == result["parameters"]
    assert min(result["stage_parameters"]) > 0
    whole = result["whole_model"]
    assert whole["training_state_mb"] == pytest.approx(result["parameters"] * 16 / 2**20, abs=0.1)
    # The tiny model's footprint is within the measurement's noise, but each figure is above
    # its process's baseline: a high-water mark with python + torch (> 100 MB) subtracted.
    assert 0 < whole["measured_train_step_above_baseline_mb"] < 100
    assert 0 <= whole["measured_load_above_baseline_mb"] < 100
    assert result["rank0_evaluating_whole_model_estimate_mb"] == pytest.approx(
        result["ranks"][0]["at_evaluation_above_baseline_mb"]
        + whole["measured_load_above_baseline_mb"], abs=0.11)
    assert [rank["rank"] for rank in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        assert rank["baseline_mb"] > 100  # python + torch
        assert rank["peak_above_baseline_mb"] == max(rank["training_above_baseline_mb"],
                                                     rank["evaluation_above_baseline_mb"])
    assert result["every_rank_fits"]  # a 0.1M-parameter model in 256 MB
