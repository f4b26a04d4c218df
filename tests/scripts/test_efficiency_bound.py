"""scripts/efficiency_bound.py end to end on tiny models: the launches' rows become one row per
family whose medians, verdicts and counts follow from the launches (the numbers themselves are
not checked: timing on a shared machine)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_pipeline import VIRTUAL
from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_efficiency_bound_summarizes_its_launches(tmp_path: Path) -> None:
    out = tmp_path / "efficiency_bound.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "efficiency_bound.py"), "--quick",
         "--families", "mlp", "--launches", "2", "--steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert_provenance(report)
    (row,) = report["families"]
    launches = report["launch_rows"]["mlp"]
    assert row["family"] == "mlp" and row["M"] == 8 and len(launches) == 2
    for name, summary in row["schedules"].items():
        ran = [next(r for r in rows if (r["impl"], r["schedule"]) == ("gpipe_core", name))
               for rows in launches]
        assert summary["seconds"] == statistics.median(r["seconds"] for r in ran)
        assert summary["bound_efficiency_per_launch"] == [r["bound_efficiency"] for r in ran]
        assert 0 < summary["bound_efficiency"] <= 1
        for cause in ("compute_per_rank", "wait_per_rank", "outside_actions_per_rank",
                      "fill_per_rank", "between_actions_per_rank", "drain_per_rank"):
            assert summary[cause] == [statistics.median(r[cause][rank] for r in ran)
                                      for rank in range(2)]
    fastest = min(row["schedules"], key=lambda s: row["schedules"][s]["seconds"])
    assert row["fastest"] == fastest
    assert row["bound_goal_met"] == (row["schedules"][fastest]["bound_efficiency"] >= 0.95)
    for name, versus in row["torch"].items():
        assert versus["rounds"] == 4 and 0 <= versus["ours_won"] <= 4
        # torch's own account of the same rounds, as ours is summarized
        theirs = [next(r for r in rows if (r["impl"], r["schedule"]) == ("torch.pipelining", name))
                  for rows in launches]
        for cause in ("compute_per_rank", "wait_per_rank", "outside_actions_per_rank"):
            assert versus[f"torch_{cause}"] == [
                statistics.median(r[cause][rank] for r in theirs) for rank in range(2)]
        assert min(versus["torch_compute_per_rank"]) > 0
    assert set(row["torch"]) == {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zb_v",
                                 "dualpipe_v"}
    for key in ("plan", "plan_counted"):  # priced by measured seconds, by counted costs
        plan = row[key]
        assert plan["choice"] == min(plan["predicted_seconds"], key=plan["predicted_seconds"].get)
        assert set(plan["predicted_seconds"]) == set(row["schedules"])
        assert plan["choice_over_fastest"] == pytest.approx(
            row["schedules"][plan["choice"]]["seconds"] / row["schedules"][fastest]["seconds"] - 1)
    assert row["plan"]["predicted_seconds"] != row["plan_counted"]["predicted_seconds"]
    assert row["plan_goal_met"] == (row["plan"]["choice_over_fastest"] <= 0.03)
    # gp.tune timed gp.plan's shortlist apart from the launches: the plans predicted within 20%
    # of the fastest, at most 4, each at the balance it ran with; its choice is its fastest
    tuned = row["plan_tuned"]
    predicted = row["plan"]["predicted_seconds"]
    shortlisted = sorted((s for s in predicted if predicted[s] <= 1.2 * min(predicted.values())),
                         key=predicted.get)[:4]
    assert sorted(t["schedule"] for t in tuned["timed"]) == sorted(shortlisted)
    assert [t["seconds"] for t in tuned["timed"]] == sorted(t["seconds"] for t in tuned["timed"])
    for t in tuned["timed"]:
        assert len(t["samples"]) == 5 and t["seconds"] == statistics.median(t["samples"])
        assert t["balance"] == row["schedules"][t["schedule"]]["balance"]
        assert t["predicted_seconds"] == pytest.approx(predicted[t["schedule"]])
    assert tuned["choice"] == tuned["timed"][0]["schedule"]
    assert tuned["choice_over_fastest"] == pytest.approx(
        row["schedules"][tuned["choice"]]["seconds"] / row["schedules"][fastest]["seconds"] - 1)
    assert row["plan_tuned_goal_met"] == (tuned["choice_over_fastest"] <= 0.03)
    assert f"fastest {fastest}" in result.stdout and "gp.plan chose" in result.stdout
    assert "gp.tune timed" in result.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_each_schedule_runs_at_the_planners_own_balance(tmp_path: Path) -> None:
    """--balance planned: each of our schedules, and torch's of the same name, runs at the
    balance gp.plan chose for it from the per-layer seconds (which vary run to run, so only
    its shape is checked here), and gp.plan's prediction is of that balance."""
    out = tmp_path / "planned.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "efficiency_bound.py"), "--quick",
         "--families", "mlp", "--launches", "1", "--steps", "1", "--balance", "planned",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["balance"] == "planned"
    (row,) = report["families"]
    (rows,) = report["launch_rows"]["mlp"]
    for name, summary in row["schedules"].items():
        balance = summary["balance"]
        assert len(balance) == (4 if name in VIRTUAL else 2) and sum(balance) == 4
        assert min(balance) >= 1
        for r in rows:
            if r["schedule"] == name and r["impl"] == "torch.pipelining":
                assert r["balance"] == balance
    assert set(row["plan"]["predicted_seconds"]) == set(row["schedules"])


@pytest.mark.slow
@pytest.mark.distributed
def test_apart_runs_each_schedule_in_its_own_processes(tmp_path: Path) -> None:
    """--apart: each launch is one bench_pipeline run per schedule, the first rotating from
    launch to launch, with no plain module steps (so no speedup over it in any row); a run's rows
    of its own schedule are kept (ours and torch's of that name, not the torch 1F1B that zb_h1's
    run is compared with), and the family's row is summarized from them as from one run."""
    out = tmp_path / "apart.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "efficiency_bound.py"), "--quick",
         "--families", "mlp", "--launches", "2", "--steps", "1", "--apart",
         "--schedules", "gpipe", "zb_h1", "--tune-rounds", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["apart"] and report["config"]["schedules"] == ["gpipe", "zb_h1"]
    first, second = report["launch_rows"]["mlp"]
    assert [(r["impl"], r["schedule"]) for r in first] == [
        ("gpipe_core", "gpipe"), ("torch.pipelining", "gpipe"), ("gpipe_core", "zb_h1")]
    assert [(r["impl"], r["schedule"]) for r in second] == [
        ("gpipe_core", "zb_h1"), ("gpipe_core", "gpipe"), ("torch.pipelining", "gpipe")]
    assert not any("speedup" in r for r in first + second)
    (row,) = report["families"]
    assert set(row["schedules"]) == {"gpipe", "zb_h1"} and set(row["torch"]) == {"gpipe"}
    assert row["torch"]["gpipe"]["rounds"] == 2
    assert "plan_tuned" not in row
