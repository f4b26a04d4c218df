"""scripts/bench_pipeline.py runs end to end on a tiny model (its numbers are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_pipeline import VIRTUAL, round_order
from tests.scripts.published import assert_provenance

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_bench_pipeline_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--blocks", "4",
         "--width", "16", "--batch", "8", "--seq", "2", "--microbatches", "1", "2",
         "--steps", "2", "--warmup", "1", "--balance", "1", "3", "--out", str(out),
         "--json", str(tmp_path / "published.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "bench_pipeline.json").read_text())
    assert json.loads((tmp_path / "published.json").read_text()) == report
    assert_provenance(report)
    rows = {(r["impl"], r["schedule"], r["M"]): r for r in report["rows"]}
    for m in (1, 2):
        for key in (("plain", "whole"), ("plain", "chunked"), ("gpipe_core", "gpipe"),
                    ("gpipe_core", "1f1b"), ("gpipe_core", "1f1b_slack1"),
                    ("gpipe_core", "zb_h1"), ("gpipe_core", "zb_h2"),
                    ("gpipe_core", "interleaved_1f1b"), ("gpipe_core", "zb_v"),
                    ("torch.pipelining", "gpipe"), ("torch.pipelining", "interleaved_1f1b"),
                    ("torch.pipelining", "zb_v")):
            row = rows[(*key, m)]
            assert row["seconds"] > 0 and len(row["samples"]) == 2
            assert row["efficiency"] > 0 and row["speedup"] > 0
            assert row["parallel_efficiency"] == pytest.approx(
                rows[("plain", "chunked", m)]["seconds"] / 2 / row["seconds"])
            assert len(row["peak_rss_mb_per_rank"]) == 2
            assert len(row["peak_tensor_mb_per_rank"]) == 2
            if key[0] != "plain":  # --balance for two stages; virtual ones in equal counts
                assert row["balance"] == ([1] * 4 if key[1] in VIRTUAL else [1, 3])
            if key[0] != "plain":  # the bubble-free bound, from the same steps' accounts
                # the busiest rank's compute happened inside the step: never above its time
                assert all(0 < b <= t for b, t in zip(row["bound_samples"], row["samples"],
                                                      strict=True))
                assert 0 < row["bound_efficiency"] <= 1
                assert min(row["outside_actions_per_rank"]) >= 0
                # idle by cause: the fill, the gaps between actions and the drain are outside
                # the actions; rank 1 learns the step from rank 0's first activation, so it
                # waits before its first action for at least rank 0's first forward
                for rank in range(2):
                    assert row["fill_per_rank"][rank] >= 0
                    assert row["between_actions_per_rank"][rank] >= 0
                    assert row["drain_per_rank"][rank] >= -1e-9
                if key[0] == "gpipe_core":
                    assert row["fill_per_rank"][1] > row["fill_per_rank"][0]
                else:  # torch's rank 1 waits for it in its first wait for messages
                    assert row["wait_per_rank"][1] > 0
                # a step's bound is its busiest rank's compute: at least any rank's median
                assert row["bound_seconds"] >= max(row["compute_per_rank"]) * (1 - 1e-12)
            else:
                assert "bound_seconds" not in row
    assert ("torch.pipelining", "1f1b", 1) not in rows  # Schedule1F1B needs M >= K
    assert ("torch.pipelining", "1f1b", 2) in rows
    assert (out / "bench_pipeline.png").stat().st_size > 0
    assert "torch.pipelining time / gpipe_core time" in result.stdout
    assert "fastest gpipe_core" in result.stdout
    assert ("M=2: rounds in which gpipe_core was faster than torch.pipelining: gpipe "
            in result.stdout)


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_pipeline_runs_torchs_encoder_layer_in_both_frameworks(tmp_path: Path) -> None:
    # The held-out family of issue 26 at test size: nn.TransformerEncoderLayer stacks, every
    # schedule of both frameworks on them (a virtual schedule needs a layer per stage).
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--family", "encoder",
         "--tiny", "--microbatches", "4", "--steps", "1", "--warmup", "1",
         "--out", str(tmp_path / "bench"), "--json", str(tmp_path / "published.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "published.json").read_text())
    assert report["config"]["family"] == "encoder"
    done = {(r["impl"], r["schedule"]) for r in report["rows"]}
    assert {("gpipe_core", s) for s in ("gpipe", "1f1b", "zb_h1", "zb_v", "dualpipe_v")} <= done
    assert {("torch.pipelining", s) for s in ("gpipe", "1f1b", "zb_v", "dualpipe_v")} <= done
    assert "encoder L=3, batch 8" in result.stdout


def test_bench_pipeline_rejects_zero_rounds() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--warmup", "0"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 2
    assert "--warmup 0 and --steps 15 must be at least 1" in result.stderr


def test_a_balance_that_does_not_cover_the_model_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--blocks", "4",
         "--width", "16", "--batch", "8", "--balance", "2", "3", "--out", str(tmp_path),
         "--json", str(tmp_path / "published.json")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 2
    assert "--balance [2, 3] must be positive and sum to the model's 4 layers" in result.stderr
    result = subprocess.run(  # one schedule's balance: its own stage count (zb_v has 4)
        [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--blocks", "4",
         "--width", "16", "--batch", "8", "--balance-of", "zb_v=1,3", "--out", str(tmp_path),
         "--json", str(tmp_path / "published.json")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 2
    assert "--balance-of 'zb_v=1,3': give SCHEDULE=N,N,..." in result.stderr


@pytest.mark.distributed
def test_bench_pipeline_runs_the_chosen_schedules_and_their_counterparts(tmp_path: Path) -> None:
    """``--schedules``: only these of ours, each with its torch counterpart (1F1B with slack is
    compared with torch's 1F1B), so each rank's process holds fewer pipelines; here in an order
    drawn per round (``--order shuffled``), which both ranks must draw alike."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--blocks", "4",
         "--width", "16", "--batch", "8", "--seq", "2", "--microbatches", "2", "--steps", "2",
         "--warmup", "1", "--schedules", "gpipe", "1f1b_slack1", "--order", "shuffled",
         "--out", str(tmp_path / "b"),
         "--json", str(tmp_path / "published.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "published.json").read_text())
    done = {(r["impl"], r["schedule"]) for r in report["rows"]}
    assert done == {("plain", "whole"), ("plain", "chunked"), ("gpipe_core", "gpipe"),
                    ("gpipe_core", "1f1b_slack1"), ("torch.pipelining", "gpipe"),
                    ("torch.pipelining", "1f1b")}
    wins = next(line for line in result.stdout.splitlines()
                if "rounds in which gpipe_core was faster" in line)
    assert ": gpipe " in wins and ", 1f1b_slack1 " in wins


def test_a_shuffled_round_order_is_a_permutation_drawn_from_the_round() -> None:
    keys = [("plain", "whole"), ("gpipe_core", "gpipe"), ("torch.pipelining", "gpipe"),
            ("gpipe_core", "1f1b"), ("torch.pipelining", "1f1b"), ("gpipe_core", "zb_v")]
    assert all(round_order(keys, r, "fixed") == keys for r in range(5))
    orders = [round_order(keys, r, "shuffled") for r in range(12)]
    assert all(sorted(order) == sorted(keys) for order in orders)
    assert orders == [round_order(keys, r, "shuffled") for r in range(12)]  # every rank alike
    # no configuration runs after the same one in every round
    for key in keys:
        before = {order[order.index(key) - 1] if order.index(key) else None for order in orders}
        assert len(before) > 1, key


def test_torchs_account_counts_a_call_inside_another_once() -> None:
    from scripts.bench_pipeline import torch_action_time

    # a forward 1-3, a wait 4-6 with a compute call inside it (counted once, in the wait), a
    # backward 7-10; the step began at 0
    calls = [(True, 1.0, 3.0), (False, 4.0, 6.0), (True, 4.5, 5.0), (True, 7.0, 10.0)]
    assert torch_action_time(calls, 0.0) == (5.0, 2.0, 1.0, 2.0)
    assert torch_action_time([], 0.0) == (0.0, 0.0, 0.0, 0.0)
