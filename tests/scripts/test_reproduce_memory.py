"""scripts/reproduce_memory.py end to end on tiny ladders: the search respects the budget and
brackets each cell between adjacent fine-ladder sizes, the allocator settings reach every trial
process; the fine ladder, the ratio intervals and the check against gp.plan as functions;
scripts/reproduction.py's meta sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from scripts.reproduction import TINY_FAMILIES, layer_sizes
from tests.scripts.published import assert_provenance

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
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "memory.json").read_text())
    assert_provenance(report)
    family = report["families"]["amoebanet"]
    tiny_ladder = TINY_FAMILIES["amoebanet"].ladder
    cells = {c["column"]: c for c in family["cells"]}
    assert list(cells) == ["naive-1", "pipeline-1", "pipeline-2"]
    trials = family["trials"]
    for trial in trials:
        if trial["fits"]:  # every process of a fitting trial stayed under the budget
            assert len(trial["ranks"]) == int(trial["column"].split("-")[1])
            assert all(0 < r["resident_peak_above_baseline_mb"] <= budget
                       for r in trial["ranks"])
            for r in trial["ranks"]:
                # Tensor-exact beside resident: the tensors include the parameter memory.
                assert r["parameter_memory_mb"] <= r["live_tensor_peak_mb"]
                assert r["residual_mb"] == pytest.approx(
                    r["resident_peak_above_baseline_mb"] - r["parameter_memory_mb"])
                # The allocator settings reached the trial's process and took effect.
                assert r["allocator"]["environment"] == report["allocator"]["settings"]
                assert r["allocator"]["freed_block_unmapped"] is True
    assert report["allocator"]["settings"]["MALLOC_MMAP_THRESHOLD_"] == str(128 << 10)
    for column, cell in cells.items():
        runs = {t["index"]: t["fits"] for t in trials
                if t["column"] == column and t["ladder"] == "coarse"}
        # Memory grows along the ladder: nothing above a size that does not fit fits.
        fitting = [i for i, fits in runs.items() if fits]
        failing = [i for i, fits in runs.items() if not fits]
        assert not failing or not fitting or max(fitting) < min(failing)
        assert cell["fits"] and runs[cell["index"]]
        assert cell["next_size_over_budget"]
        assert cell["parameters"] > 0 and cell["parameter_memory_mb"] > 0
        # The bracket: adjacent entries of the fine ladder, the first fits, the second not,
        # each as a trial of this column says (the coarse search's or the fine one's).
        fits, over = cell["bracket"]["fits"], cell["bracket"]["does_not_fit"]
        ladder = cell["fine_ladder"]
        if over is None:  # the ladder's top fits: nothing above it to bracket with
            assert cell["index"] == len(tiny_ladder) - 1 and ladder == []
            assert fits["size"] == cell["size"] == tiny_ladder[-1]
            continue
        assert ladder[0] == tiny_ladder[cell["index"]]
        assert ladder[-1] == tiny_ladder[cell["index"] + 1]
        assert ladder.index(over["size"]) == ladder.index(fits["size"]) + 1
        assert fits["size"] == cell["size"]
        outcome = {json.dumps(t["size"]): t["fits"] for t in trials if t["column"] == column}
        assert outcome[json.dumps(fits["size"])] is True
        assert outcome[json.dumps(over["size"])] is False
        assert fits["parameters"] < over["parameters"]
        # gp.plan's prediction beside the measured peaks, on the trial's balance.
        check = cell["plan_check"]
        assert check["predicted_balance"] == check["measured_balance"]
        assert check["predicted_peak_mb"] > 0 and check["measured_live_tensor_peak_mb"] > 0
    # Every ratio between two columns is an interval around the point ratio.
    intervals = family["ratio_intervals"]
    assert set(intervals) == {"pipeline-1 / naive-1", "pipeline-2 / naive-1",
                              "pipeline-2 / pipeline-1"}
    for name, (low, high) in intervals.items():
        assert high is None or low <= high, (name, low, high)  # high None: the top fit
    low, high = intervals["pipeline-1 / naive-1"]
    assert low <= cells["pipeline-1"]["ratio_to_naive"]
    assert high is None or cells["pipeline-1"]["ratio_to_naive"] <= high
    # Re-materialization alone already fits a larger model than the plain module.
    assert cells["pipeline-1"]["ratio_to_naive"] > 1
    assert cells["pipeline-2"]["parameters"] >= cells["pipeline-1"]["parameters"]
    assert (tmp_path / "memory.png").stat().st_size > 0


# --- the brackets and the intervals (pure functions) ------------------------------------------


def test_fine_ladder_steps_the_dimension_the_coarse_step_grew() -> None:
    from scripts.reproduce_memory import fine_ladder
    from scripts.reproduction import FAMILIES

    amoeba, nmt = FAMILIES["amoebanet"], FAMILIES["transformer"]
    assert fine_ladder(amoeba, {"L": 6, "D": 128}, {"L": 6, "D": 192}) == [
        {"L": 6, "D": 128}, {"L": 6, "D": 144}, {"L": 6, "D": 160}, {"L": 6, "D": 176},
        {"L": 6, "D": 192}]
    assert fine_ladder(amoeba, {"L": 12, "D": 256}, {"L": 18, "D": 256}) == [
        {"L": n, "D": 256} for n in range(12, 19)]
    assert fine_ladder(nmt, {"L": 12}, {"L": 16}) == [{"L": n} for n in range(12, 17)]
    assert fine_ladder(amoeba, {"L": 6, "D": 8}, {"L": 6, "D": 12}) == [  # finer than a step
        {"L": 6, "D": 8}, {"L": 6, "D": 12}]
    with pytest.raises(ValueError, match="exactly one dimension"):
        fine_ladder(amoeba, {"L": 6, "D": 128}, {"L": 9, "D": 256})


def test_ratio_interval_bounds_the_ratio_of_the_largest_fitting_sizes() -> None:
    from scripts.reproduce_memory import ratio_interval, ratio_intervals

    # numerator in [10, 12), denominator in [4, 5): the ratio is in [10/5, 12/4].
    assert ratio_interval((10, 12), (4, 5)) == (2.0, 3.0)
    assert ratio_interval((10, None), (4, 5)) == (2.0, None)  # the numerator's top fit
    assert ratio_interval((10, 12), (4, None)) == (0.0, 3.0)
    with pytest.raises(ValueError, match="positive"):
        ratio_interval((0, 12), (4, 5))
    # The reviewer's reading of the coarse AmoebaNet cells: naive-1 (6,128) fits, (6,160) not;
    # pipeline-1 (6,192) fits, (6,256) not: re-materialization buys between 1.44x and 3.99x.
    cells = [
        {"column": "naive-1", "fits": True, "bracket": {
            "fits": {"parameters": 10.5e6}, "does_not_fit": {"parameters": 16.4e6}}},
        {"column": "pipeline-1", "fits": True, "bracket": {
            "fits": {"parameters": 23.7e6}, "does_not_fit": {"parameters": 42.0e6}}},
        {"column": "pipeline-8", "fits": True, "bracket": {
            "fits": {"parameters": 155.8e6}, "does_not_fit": None}},
        {"column": "pipeline-16", "fits": False, "bracket": {
            "fits": None, "does_not_fit": {"parameters": 1e6}}},
    ]
    intervals = ratio_intervals(cells)
    assert list(intervals) == ["pipeline-1 / naive-1", "pipeline-8 / naive-1",
                               "pipeline-8 / pipeline-1"]
    assert intervals["pipeline-1 / naive-1"] == (pytest.approx(23.7 / 16.4),
                                                 pytest.approx(42.0 / 10.5))
    assert intervals["pipeline-8 / pipeline-1"] == (155.8e6 / 42.0e6, None)


# --- gp.plan against a measured cell ----------------------------------------------------------


def test_plan_predicts_params_and_activations_on_the_trials_balance() -> None:
    from scripts.reproduce_memory import compare_with_plan, predicted_rank_bytes

    layers = {"activation_bytes": [100.0, 200.0, 300.0, 400.0],
              "input_bytes": [10.0, 20.0, 30.0, 40.0],
              "param_bytes": [40.0, 40.0, 40.0, 40.0]}
    # The plain module, whole batch: every parameter and every activation at once.
    balance, peaks = predicted_rank_bytes(**layers, balance_costs=[1.0] * 4, stages=1, chunks=1,
                                          checkpoint="never", batch_size=8)
    assert balance == [4] and peaks == [160.0 + 1000.0]
    # Two ranks: the balance follows the costs given (the trial's), not the plan's own.
    balance, peaks = predicted_rank_bytes(**layers, balance_costs=[1.0, 1.0, 1.0, 9.0], stages=2,
                                          chunks=4, checkpoint="always", batch_size=8)
    assert balance == [3, 1] and len(peaks) == 2
    # Re-materialized in 4 micro-batches, rank 1 holds its parameters, its inputs and one
    # micro-batch's activations: less than the plain module's share.
    assert 40.0 + 400.0 / 4 <= peaks[1] < 40.0 + 400.0
    ranks = [{"live_tensor_peak_mb": 1.0, "resident_peak_above_baseline_mb": 2.0},
             {"live_tensor_peak_mb": 0.5, "resident_peak_above_baseline_mb": 4.0}]
    check = compare_with_plan([1.5 * 2**20, 0.5 * 2**20], ranks, budget_mb=3.0)
    assert check["predicted_peak_mb"] == 1.5 and check["measured_live_tensor_peak_mb"] == 1.0
    assert check["error_vs_live_tensor"] == 0.5
    assert check["error_vs_resident"] == 1.5 / 4.0 - 1
    assert check["predicted_fits_budget"]


# --- the allocator ----------------------------------------------------------------------------


def _allocator_state(rank: int, world_size: int) -> dict:
    from scripts.reproduce_memory import allocator_state

    return allocator_state()


@pytest.mark.distributed
def test_allocator_settings_reach_a_spawned_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_core.launch import spawn
    from scripts.reproduce_memory import _environment, allocator_settings

    settings = allocator_settings(128 << 10)
    for name in settings:
        monkeypatch.delenv(name, raising=False)
    with _environment(settings):
        fixed = spawn(_allocator_state, 1, None, process_group=False, timeout_s=600)[0]
    assert all(name not in os.environ for name in settings)  # the parent's is restored
    default = spawn(_allocator_state, 1, None, process_group=False, timeout_s=600)[0]
    assert fixed["environment"] == settings
    # The probe tells the two apart: under glibc's default a freed 1 MB block raises the
    # mmap threshold and the next one comes from the heap.
    assert fixed["freed_block_unmapped"] is True
    assert default["freed_block_unmapped"] is False
    assert default["environment"] == dict.fromkeys(settings)
