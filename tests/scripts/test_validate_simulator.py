"""scripts/validate_simulator.py: the report's arithmetic on hand-made runs, and both launches
end to end on tiny models (their numbers are not checked: tiny layers measure Python overhead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.validate_simulator import CONFIGS, compare, kendall_tau

ROOT = Path(__file__).resolve().parents[2]


def test_kendall_tau_counts_concordant_and_discordant_pairs() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def stage(forward: float, backward: float) -> dict[str, object]:
    return {"forward": forward, "backward": backward, "forward_no_grad": forward,
            "recompute": forward, "backward_input": None, "backward_weight": None,
            "samples": {}}


def hand_made() -> tuple[dict[str, object], dict[str, object]]:
    """Two stages of forward 1 s and backward 2 s, no transfer: fill-drain at M micro-batches
    of 1/M the work each takes (M + 1) * 3 / M seconds."""
    profile = {"transfer_points": {"1000": 0.0, "2000": 0.0}, "boundary_bytes": 1000,
               "profiles": [{"schedule": "gpipe", "checkpoint": "never", "M": m,
                             "stages": [stage(1 / m, 2 / m), stage(1 / m, 2 / m)]}
                            for m in (1, 2, 4)]}
    measured = {"rows": [{"schedule": "gpipe", "checkpoint": "never", "M": m, "seconds": s,
                          "samples": [s]} for m, s in ((1, 6.0), (2, 4.5 * 1.1), (4, 3.75 * 0.9))]}
    return profile, measured


def test_compare_reports_signed_errors_normalised_ratios_and_the_goals() -> None:
    profile, measured = hand_made()
    report = compare(profile, measured)
    rows = {r["M"]: r for r in report["rows"]}
    assert rows[1]["replay_predicted_s"] == pytest.approx(6.0)
    assert rows[1]["replay_error"] == pytest.approx(0)
    assert rows[2]["replay_error"] == pytest.approx(1 / 1.1 - 1)  # measured 10% slower
    assert rows[4]["replay_error"] == pytest.approx(1 / 0.9 - 1)
    assert rows[2]["normalised_measured"] == pytest.approx(6.0 / 4.95)
    assert rows[2]["replay_normalised_predicted"] == pytest.approx(6.0 / 4.5)
    assert rows[2]["replay_normalised_error"] == pytest.approx(0.1)
    summary = report["summary"]["replay"]
    assert summary["per_M"]["2"] == {"median_error": pytest.approx(1 / 1.1 - 1),
                                     "too_fast": 1, "too_slow": 0}
    assert summary["configurations"] == 3 and summary["kendall_tau"] == 1.0
    assert summary["worst_abs_error"] == pytest.approx(1 / 0.9 - 1)
    assert summary["goals_met"] is False  # the worst error is 11%, over the 10% goal
    assert set(report["summary"]) == {"replay"}  # no pipeline costs in this profile
    assert report["measurement_floor"] is None  # one sample per configuration


def test_the_measurement_floor_compares_odd_and_even_rounds() -> None:
    profile, measured = hand_made()
    for row, samples in zip(measured["rows"], ([6.0, 6.6, 6.0, 6.6], [5.0, 5.0, 5.0, 5.0],
                                               [3.0, 3.3, 3.0, 3.3]), strict=True):
        row["samples"] = samples
    floor = compare(profile, measured)["measurement_floor"]
    assert floor["median_abs_error"] == pytest.approx(1 - 1 / 1.1)
    assert floor["worst_abs_error"] == pytest.approx(1 - 1 / 1.1)
    # odd rounds 6.0, 5.0, 3.0 against even 6.6, 5.0, 3.3: the same order
    assert floor["kendall_tau"] == 1.0


def test_compare_predicts_from_pipeline_costs_and_across_configurations() -> None:
    profile, measured = hand_made()
    for entry in profile["profiles"]:  # the pipeline ran each action 10% dearer
        m = entry["M"]
        entry["pipeline_stages"] = [stage(1.1 / m, 2.2 / m)] * 2
    profile["profiles"].append({"schedule": "1f1b", "checkpoint": "never", "M": 2,
                                "stages": [stage(0.5, 1.0)] * 2,
                                "pipeline_stages": [stage(0.55, 1.1)] * 2})
    measured["rows"].append({"schedule": "1f1b", "checkpoint": "never", "M": 2,
                             "seconds": 4.95, "samples": [4.95]})
    report = compare(profile, measured)
    rows = {(r["schedule"], r["M"]): r for r in report["rows"]}
    # fill-drain at M=2 measured 4.95 s = 1.1 x 4.5: the pipeline's costs predict it exactly
    assert rows[("gpipe", 2)]["pipeline_error"] == pytest.approx(0)
    # and 1F1B at M=2 from fill-drain's pipeline costs (same actions, another order): 4.95 s
    assert rows[("1f1b", 2)]["cross_source"] == "gpipe never"
    assert rows[("1f1b", 2)]["cross_predicted_s"] == pytest.approx(4.95)
    assert set(report["summary"]) == {"replay", "pipeline", "cross"}
    assert report["summary"]["cross"]["configurations"] == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_the_three_launches_write_their_json_and_the_report(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "validate_simulator.py"), "--tiny",
         "--families", "encoder", "--microbatches", "1", "2", "--rounds", "1", "--warmup", "0",
         "--pingpong-repeats", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    profile = json.loads((tmp_path / "encoder_profile.json").read_text())
    measured = json.loads((tmp_path / "encoder_measured.json").read_text())
    report = json.loads((tmp_path / "encoder_validation.json").read_text())
    for run in (profile, measured):
        assert {"commit", "torch", "utc", "load_average_before", "load_average_after"} <= set(
            run["provenance"])
    assert measured["balance"] == profile["balance"] == report["balance"]
    keys = {(r["schedule"], r["checkpoint"], r["M"]) for r in report["rows"]}
    assert keys == {(s, c, m) for m in (1, 2) for s, c in CONFIGS}
    for row in report["rows"]:
        assert len(row["measured_samples"]) == 1
        # launch 1's replay and running pipelines both predict; launch 2's own actions split
        # the error between the costs and the schedule model
        for route in ("replay", "pipeline", "in_situ"):
            assert row["measured_s"] > 0 and row[f"{route}_predicted_s"] > 0
        assert len(row["in_pipeline_over_replay"]) == 2
        assert all(w >= 0 for w in row["wait_per_step"])
    summary = report["summary"]
    assert set(summary) == {route + suffix for route in ("replay", "pipeline", "in_situ", "cross")
                            for suffix in ("", "_rounds")} | {"another_launch"}
    remeasured = json.loads((tmp_path / "encoder_remeasured.json").read_text())
    again = {(r["schedule"], r["checkpoint"], r["M"]): r["seconds"] for r in remeasured["rows"]}
    for row in report["rows"]:  # launch 3's median as the prediction of launch 2's
        assert row["another_launch_error"] == pytest.approx(
            again[(row["schedule"], row["checkpoint"], row["M"])] / row["measured_s"] - 1)
    for row in report["rows"]:  # one timed round: its own costs are the medians
        for route in ("replay", "pipeline", "in_situ"):
            assert row[f"{route}_rounds_predicted_s"] == pytest.approx(
                row[f"{route}_predicted_s"], rel=1e-12)
    assert set(summary["replay"]["per_M"]) == {"1", "2"}
    assert -1 <= summary["pipeline"]["kendall_tau"] <= 1
    assert "encoder: predicted (profile launch) against measured" in result.stdout
