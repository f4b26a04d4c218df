"""scripts/reproduce_memory.py end to end on tiny ladders: the search respects the budget and
reports the largest size that fits; scripts/reproduction.py's meta sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from scripts.reproduction import layer_sizes

ROOT = Path(__file__).resolve().parents[2]


def test_layer_sizes_counts_saved_activations_not_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sizes = layer_sizes(model, torch.zeros(3, 4))
    # Linear saves its input (3x4 floats) for the weight's gradient, not its (transposed)
    # weight; ReLU saves its output (3x8); nothing was allocated (the model is on meta).
    assert sizes.saved == [48.0, 96.0, 96.0]
    assert sizes.inputs == [48.0, 96.0, 96.0]
    assert sizes.outputs == [96.0, 96.0, 24.0]
    assert sizes.params == [(32 + 8) * 4.0, 0.0, (16 + 2) * 4.0]


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_search_respects_the_budget_and_finds_the_largest(tmp_path: Path) -> None:
    budget = 12.0
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reproduce_memory.py"), "--tiny",
         "--budget-mb", str(budget), "--families", "amoebanet", "--stages", "2",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "memory.json").read_text())
    family = report["families"]["amoebanet"]
    cells = {c["column"]: c for c in family["cells"]}
    assert list(cells) == ["naive-1", "pipeline-1", "pipeline-2"]
    trials = family["trials"]
    for trial in trials:
        if trial["fits"]:  # every process of a fitting trial stayed under the budget
            assert len(trial["ranks"]) == int(trial["column"].split("-")[1])
            assert all(0 < r["above_baseline_mb"] <= budget for r in trial["ranks"])
    for column, cell in cells.items():
        runs = {t["index"]: t["fits"] for t in trials if t["column"] == column}
        # Memory grows along the ladder: nothing above a size that does not fit fits.
        fitting = [i for i, fits in runs.items() if fits]
        failing = [i for i, fits in runs.items() if not fits]
        assert not failing or not fitting or max(fitting) < min(failing)
        assert cell["fits"] and runs[cell["index"]]
        assert cell["next_size_over_budget"]
        assert cell["parameters"] > 0 and cell["parameter_memory_mb"] > 0
    # Re-materialization alone already fits a larger model than the plain module.
    assert cells["pipeline-1"]["ratio_to_naive"] > 1
    assert cells["pipeline-2"]["parameters"] >= cells["pipeline-1"]["parameters"]
    assert (tmp_path / "memory.png").stat().st_size > 0
