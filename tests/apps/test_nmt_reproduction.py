"""The NMT reproduction scripts end to end on the synthetic corpus, and their loss-curve rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from data.gettext_m2en.prepare import prepare
from scripts import reproduce_depth_width, reproduce_stability
from scripts.nmt_runs import divergence_step, loss_spikes
from tests.apps.test_nmt_data import build_locale_tree


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("catalogs")
    build_locale_tree(root)
    out = tmp_path_factory.mktemp("corpus")
    prepare(out, packages=None, locale_roots=[root], vocab_size=400, dev_fraction=0.1,
            test_fraction=0.1, block_size=64, verbose=False)
    return out


def tiny_settings(corpus: Path) -> list[str]:
    return [f"data_dir={corpus}", "packages=none", "vocab_size=400", "eval_max_sentences=4",
            "beam_size=1", "max_decode_len=8", "log_every=2"]


def test_loss_spikes_against_the_running_median() -> None:
    flat = [5.0] * 30
    assert loss_spikes(flat) == []
    spiky = [*flat, 7.6, 5.0, 5.0, math.nan, 5.0]
    assert loss_spikes(spiky) == [31, 34]  # 7.6 > 1.5 * 5; NaN always counts
    early = [5.0, 9.0, 5.0]  # too little history to call a spike
    assert loss_spikes(early) == []


def test_divergence_is_nonfinite_or_above_the_start_after_warmup() -> None:
    assert divergence_step([8.0, 9.0, 6.0, 5.0], after=2) is None  # above start only in warm-up
    assert divergence_step([8.0, 6.0, 5.0, 8.5], after=2) == 4
    assert divergence_step([8.0, 6.0, math.inf], after=10) == 3
    assert divergence_step([], after=0) is None


@pytest.mark.slow
@pytest.mark.distributed
def test_stability_script_runs_the_four_variants(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = reproduce_stability.main([
        "--config", "tiny", "--lrs", "1e-3", "--sweep-steps", "3", "--steps", "4",
        "--runs-dir", str(tmp_path / "runs"), "--out", str(out),
        # a bound the tiny model's logits cross at once, so the clip visibly engages
        "--set", *tiny_settings(corpus), "logits_abs_max=0.5",
    ])
    written = json.loads((out / "stability.json").read_text())
    assert written["ablation_lr"] == result["ablation_lr"] == 1e-3
    assert [run["name"] for run in written["sweep"]["runs"]] == ["sweep_neither_lr0.001"]
    runs = {run["name"]: run for run in written["runs"]}
    assert set(runs) == {f"{v}_lr0.001" for v in reproduce_stability.VARIANTS}
    for variant, flags in reproduce_stability.VARIANTS.items():
        run = runs[f"{variant}_lr0.001"]
        assert run["settings"] == {"lr": 1e-3, **flags}
        assert run["steps"] == 4 and run["returncode"] == 0 and run["stopped_by"] == "max_steps"
        assert math.isfinite(run["dev_loss"]) and set(run["dev_bleu"]) == {"high", "medium", "low"}
        assert all(a > 0 for a in run["max_activation_per_stage"])
        if flags["clip_logits"]:
            assert run["clip_engaged_steps"] == 4 and run["mean_clipped_fraction"] > 0
        else:
            assert run["clip_engaged_steps"] == 0 and run["mean_clipped_fraction"] == 0
    assert (out / "stability.png").stat().st_size > 0
    assert (out / "stability_sweep.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_depth_width_script_scores_paired_differences(corpus: Path, tmp_path: Path) -> None:
    # the same config in all three roles: same seed, same batches, so the models are identical
    # and every paired difference must be exactly zero, interval included
    out = tmp_path / "out"
    reproduce_depth_width.main([
        "--deep", "tiny", "--wide", "tiny", "--small", "tiny", "--steps", "3", "--bootstrap", "50",
        "--runs-dir", str(tmp_path / "runs"), "--out", str(out), "--threads", "1",
        "--set", *tiny_settings(corpus),
    ])
    result = json.loads((out / "depth_width.json").read_text())
    assert set(result["runs"]) == {"deep", "wide", "small"}
    assert {run["steps"] for run in result["runs"].values()} == {3}
    assert len({run["tokens"] for run in result["runs"].values()}) == 1  # equal token budget
    for split in ("test", "held_out"):
        scores = result[split]
        assert set(scores["languages"]) == {"de", "fr", "ru", "pt_BR"}
        for row in [*scores["languages"].values(), *scores["buckets"].values()]:
            for name in ("deep_minus_wide", "deep_minus_small"):
                assert row[f"{name}_bleu"] == {"mean": 0.0, "ci95": [0.0, 0.0]}
                assert row[f"{name}_loss"] == {"mean": 0.0, "ci95": [0.0, 0.0]}
            low, high = row["deep_bleu"]["ci95"]
            assert 0 <= low <= high <= 100
            assert "copy_bleu" in row and "copy_chrf" in row
    held, test = result["held_out"]["languages"], result["test"]["languages"]
    assert all(held[x]["sentences"] > test[x]["sentences"] for x in test)
    assert (out / "depth_width.png").stat().st_size > 0
