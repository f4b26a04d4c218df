"""scripts/selective_remat_apps.py in quick mode (the apps' tiny configs, 2 gloo ranks): every
configuration is predicted and measured, the selective choice fits its budget as planned, the
exhaustive search agrees with the planner, and the result carries provenance and every round
(its timings are not checked: the cores are shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


def test_selective_remat_apps_quick(tmp_path: Path) -> None:
    out = tmp_path / "selective.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "selective_remat_apps.py"), "--quick",
         "--chunks", "2", "4", "--timing-chunks", "2", "--pairs", "2", "--steps", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert_provenance(report)
    assert [a["app"] for a in report["apps"]] == ["nmt", "amoebanet"]
    for app in report["apps"]:
        rows = {(r["M"], r["mode"]): r for r in app["memory"]}
        assert set(rows) == {(m, mode) for m in (2, 4) for mode in ("never", "always",
                                                                    "selective")}
        for m in (2, 4):
            never, always, chosen = (rows[m, mode] for mode in ("never", "always", "selective"))
            assert chosen["checkpoint"].startswith("keep:")
            assert max(always["predicted_rank_peak_mb"]) <= chosen["budget_mb"]
            assert max(chosen["predicted_rank_peak_mb"]) <= chosen["budget_mb"]
            assert max(never["predicted_rank_peak_mb"]) > chosen["budget_mb"]
            # measured: recomputing everything holds less than keeping everything
            assert max(always["measured_rank_peak_mb"]) < max(never["measured_rank_peak_mb"])
            for row in (never, always, chosen):
                assert len(row["measured_rank_peak_mb"]) == 2
                assert row["error"] == max(row["predicted_rank_peak_mb"]) / max(
                    row["measured_rank_peak_mb"]) - 1
                # tiny models: the plan leaves out the loss's and messages' temporaries
                assert abs(row["error"]) < 0.35, row
        timing = app["timing"]
        assert len(timing["seconds"]["always"]) == len(timing["seconds"]["selective"]) == 2
        assert 0 <= timing["selective_won"] <= 2
        assert timing["predicted_margin"] > 0
        assert set(timing["rank_busy_s_per_step"]["selective"][0]) == {"F", "B"}
        # the seconds each M's plans were chosen with, per layer (the loss on the last)
        for m in (2, 4):
            profile = app["profiles"][str(m)]
            assert len(profile["forward"]) == sum(rows[m, "never"]["balance"])
            assert all(seconds > 0 for seconds in profile["backward"])
        assert [e["M"] for e in app["exhaustive"]] == [2, 4]
        for search in app["exhaustive"]:
            assert search["chosen_over_best"] <= 0.03, search
