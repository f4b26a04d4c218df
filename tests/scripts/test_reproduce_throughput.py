"""scripts/reproduce_throughput.py end to end on a tiny model (its numbers are not checked:
tiny layers measure Python overhead, not the pipeline); fit_transfer on exact points."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.reproduce_throughput import CONFIGS, LayerCosts, fit_transfer
from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


def test_fit_transfer_recovers_latency_and_bandwidth() -> None:
    latency, per_byte = fit_transfer({n: 1e-4 + n * 1e-9 for n in (1024, 65536, 1 << 20)})
    assert latency == pytest.approx(1e-4) and per_byte == pytest.approx(1e-9)


@pytest.mark.slow
@pytest.mark.distributed
def test_throughput_writes_measured_and_predicted_rows(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reproduce_throughput.py"), "--tiny",
         "--families", "amoebanet", "--microbatches", "1", "2", "--steps", "1", "--warmup", "1",
         "--profile-repeats", "1", "--pingpong-repeats", "2", "--efficiency",
         "--efficiency-batches", "4", "8", "--batch-size", "8", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert_provenance(report)
    family = report["families"]["amoebanet"]
    assert family["batch_size"] == 8
    efficiency = family["microbatch_efficiency"]
    assert set(efficiency["curves"]) == {"4", "8"}
    for curve in efficiency["curves"].values():
        assert curve["1"] == pytest.approx(1.0) and curve["2"] > 0
    rows = {(r["M"], r["schedule"], r["checkpoint"]): r for r in family["rows"]}
    assert set(rows) == {(m, s, c) for m in (1, 2) for s, c in CONFIGS}
    for row in rows.values():
        assert row["seconds"] > 0 and row["predicted_seconds"] > 0
        assert len(row["predicted_step_memory_mb_per_rank"]) == 2
        # The runtime's timeline splits each rank's step into its actions' compute and waits.
        assert row["in_situ_seconds"] > 0
        for compute, wait in zip(row["compute_per_step"], row["wait_per_step"], strict=True):
            assert compute > 0 and wait >= 0 and compute <= row["seconds"] * 1.5
    # Calibrated on fill-drain without re-materialization, predicted for the others.
    held_out = [r for r in rows.values() if (r["schedule"], r["checkpoint"]) != ("gpipe", "never")]
    assert all(r["calibrated_seconds"] > 0 for r in held_out)
    assert not any("calibrated_seconds" in r for r in rows.values() if r not in held_out)
    # The summary is the held-out rows' own errors, each |calibrated / measured - 1|.
    errors = [abs(r["calibrated_seconds"] / r["seconds"] - 1) for r in held_out]
    assert [abs(r["calibrated_error"]) for r in held_out] == pytest.approx(errors)
    assert family["calibrated_error_median"] == pytest.approx(statistics.median(errors))
    assert family["calibrated_error_max"] == pytest.approx(max(errors))
    assert sum(family["balance"]) == family["layers"]
    table = family["table2"]
    assert table["measured_K2"]["1"] == pytest.approx(1.0)
    # GPipe's ideal at K=2, normalised to M=1: 2M/(M+1); the ranks' busy share against M/(M+1).
    assert table["ideal_K2"]["2"] == pytest.approx(4 / 3)
    assert table["ideal_efficiency_K2"]["1"] == pytest.approx(0.5)
    assert all(0 < v <= 1.5 for v in table["bubble_only_efficiency_K2"].values())
    assert table["predicted"]["K=2,M=1"]["throughput"] == pytest.approx(1.0)
    for key in ("predicted", "predicted_calibrated"):
        assert table[key]["K=2,M=1"]["throughput"] == pytest.approx(1.0)
        for k in (2, 4, 8):
            for m in (1, 2):
                entry = table[key][f"K={k},M={m}"]
                assert len(entry["balance"]) == k and entry["seconds"] > 0
    for name in ("throughput.png", "simulator.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_fitted_overhead_makes_the_plan_model_match_the_profile() -> None:
    from scripts.plan_vs_measured import fitted_overhead

    # Whole batch: 1.0 s over two layers; at M=4 each micro-batch costs 0.3 s, so four cost
    # 1.2 s: 0.2 s more, spread over 2 actions x 4 micro-batches x 2 stages = 12.5 ms each.
    costs = {"1": {"forward": [0.2, 0.2], "backward": [0.3, 0.3]},
             "4": {"forward": [0.06, 0.06], "backward": [0.09, 0.09]}}
    assert fitted_overhead({"costs": costs}) == pytest.approx(0.2 / 16)


def test_the_smallest_efficient_batch_keeps_the_floor_at_the_largest_m() -> None:
    from scripts.reproduce_throughput import smallest_efficient_batch

    curves = {16: {1: 1.0, 8: 0.55}, 32: {1: 1.0, 8: 0.85}, 64: {1: 1.0, 8: 0.93},
              128: {1: 1.0, 8: 0.97}}
    assert smallest_efficient_batch(curves, 8) == 64
    assert smallest_efficient_batch(curves, 8, floor=0.99) is None


def test_choose_batch_drops_the_largest_m_where_no_batch_keeps_the_floor() -> None:
    from scripts.reproduce_throughput import choose_batch

    curves = {32: {1: 1.0, 4: 0.95, 8: 0.8, 32: 0.4}, 64: {1: 1.0, 4: 0.97, 8: 0.91, 32: 0.6}}
    assert choose_batch(curves, [1, 4, 8]) == (64, [1, 4, 8], True)
    assert choose_batch(curves, [1, 4, 8, 32]) == (64, [1, 4, 8], True)  # 32: none keeps 90%
    assert choose_batch(curves, [1, 4, 8, 32], floor=0.96) == (64, [1, 4], True)
    # No batch keeps 99% even at M=8: the largest batch, every M, and the floor not met.
    assert choose_batch(curves, [1, 8], floor=0.99) == (64, [1, 8], False)


def test_plan_choice_on_the_committed_results() -> None:
    from scripts.plan_vs_measured import compare

    report = json.loads((ROOT / "docs" / "reproduction" / "throughput.json").read_text())
    for result in report["families"].values():
        row = compare(result, 2**30, 0.0)
        choice = row["plan_choice"]
        assert choice["K"] in (1, 2) and choice["predicted_peak_mb"] <= 1024
        # docs/REPRODUCTION.md's claim: given the costs profiled at each M, gp.plan picks the
        # best measured configuration (0% over it; 5% allows a near tie), within the budget;
        # dividing whole-batch costs by M instead picks one that is measurably slower.
        profiled = compare(result, 512 * 2**20, 0.0, per_microbatch=True)
        assert profiled["choice_over_best"] <= 0.05, profiled
        assert profiled["plan_choice"]["predicted_peak_mb"] <= 512
        assert row["choice_over_best"] > profiled["choice_over_best"] + 0.5, (row, profiled)


def test_live_tensor_bytes_counts_what_is_alive_at_once() -> None:
    import torch

    from scripts.harness import LiveTensorBytes

    existing = torch.zeros(1000)  # 4,000 bytes made before: never counted
    with LiveTensorBytes([existing]) as tracker:
        a = existing + 1  # 4,000
        b = a * 2  # 8,000 alive
        del a  # 4,000
        c = torch.zeros(3000)  # 16,000 alive: the peak
        existing.add_(1)  # in place on a storage from before: nothing new
        del b, c
    assert tracker.peak == 16_000 and tracker.current == 0


def test_stage_memory_goes_to_the_simulators_memory_walk() -> None:
    from scripts.reproduce_throughput import MB, StageMemory, memory_sizes, predict
    from scripts.reproduction import LayerSizes

    first = StageMemory(saved=10 * MB, extra=12 * MB, received=0, sent=1 * MB, grads=5 * MB)
    last = StageMemory(saved=20 * MB, extra=25 * MB, received=1 * MB, sent=0, grads=3 * MB)
    # A stage keeps its received input beside its saved tensors; its input gradient, sent back,
    # is the input's size; the rest maps one to one.
    assert memory_sizes([first, last]) == {
        "activation_bytes": [10 * MB, 21 * MB], "input_bytes": [0, 1 * MB],
        "output_bytes": [1 * MB, 0], "gradient_bytes": [5 * MB, 3 * MB],
        "working_bytes": [12 * MB, 25 * MB]}
    # The walk by hand in tests/test_simulate_plan.py, through the script's prediction.
    costs = LayerCosts([1.0, 1.0], [1.0, 1.0], [2.0, 2.0])
    sizes = LayerSizes(saved=[0, 0], inputs=[0, 0], params=[0, 0], outputs=[1.0, 0])
    sim = predict(costs, sizes, [1, 1], "gpipe", "never", 2, (0.0, 0.0), [first, last])
    assert [peak / MB for peak in sim.peak_bytes] == [23, 47]


def test_app_efficiency_against_the_bubble() -> None:
    from scripts.app_efficiency import summarize

    def row(m: int, checkpoint: str, seconds: float, memory: list[float]) -> dict:
        return {"M": m, "schedule": "gpipe", "checkpoint": checkpoint, "seconds": seconds,
                "compute_per_step": [0.1, 0.1], "wait_per_step": [0.0, 0.0],
                "step_memory_mb_per_rank": memory}

    report = {"config": {"balance": "time"}, "families": {"nmt_app": {
        "balance": [7, 7], "plain_seconds": {"4": 1.0},
        "rows": [row(4, "never", 0.625, [100.0, 80.0]), row(4, "except_last", 0.75, [25.0, 40.0])]}}}
    (summary,) = summarize(report)
    assert summary["speedup"] == 1.6 and summary["efficiency"] == 0.8
    assert summary["bubble_ideal"] == 0.8  # M / (M + K - 1) = 4 / 5
    assert summary["remat_overhead"] == pytest.approx(0.2)
    assert summary["remat_memory_saved"] == [0.75, 0.5]
