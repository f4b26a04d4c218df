"""The NMT reproduction scripts end to end on the synthetic corpus, and their loss-curve rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from apps.nmt.config import replace
from scripts import reproduce_depth_width, reproduce_stability
from scripts.nmt_runs import Run, divergence_step, loss_spikes, to_json, train, write_result


def tiny_settings(corpus: Path) -> list[str]:
    return [f"data_dir={corpus}", "packages=none", "vocab_size=400", "eval_max_sentences=4",
            "beam_size=1", "max_decode_len=8", "log_every=2"]


def test_result_json_keeps_lists_of_numbers_on_one_line(tmp_path: Path) -> None:
    result = {"name": "r", "dev_curve": [{"step": 3, "dev_loss": {"de": 2.5}}],
              "test": {"de": {"bleu_stats": [[1, 2, 3], [4, 5, 6]], "loss": [0.5, 1e-7]}},
              "diverged": None, "empty": {}, "nothing": []}
    write_result(tmp_path / "r.json", result)
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == result and text.endswith("}\n")
    assert '"bleu_stats": [[1, 2, 3], [4, 5, 6]]' in text and '"loss": [0.5, 1e-07]' in text
    assert to_json([{"a": 1}]) == '[\n {\n  "a": 1\n }\n]'


def test_seconds_per_step_counts_a_resumed_run_whole(tmp_path: Path) -> None:
    # A run resumed at step 600 of 1,000: this part's wall time (4 minutes) covers 400 steps,
    # the trainer's clock (train_minutes, carried across the resume) all 1,000.
    records = [{"step": i} for i in range(1, 1001)]
    resumed = Run("r", tmp_path, {}, 0, 4.0, records, {"train_minutes": 15.0, "steps": 1000},
                  resumed=True)
    assert resumed.seconds_per_step == pytest.approx(0.9)
    # without the trainer's summary (a run that stopped early): the wall time over the steps
    assert Run("r", tmp_path, {}, 1, 4.0, records[:400]).seconds_per_step == pytest.approx(0.6)
    assert Run("r", tmp_path, {}, 1, 0.1).seconds_per_step is None


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


# --- issue 21, part 1: stability as learning-rate sensitivity -----------------------------------


def test_describe_losses_by_the_written_rules() -> None:
    describe = reproduce_stability.describe_losses
    converged = [8.0, 7.0, *[5.0] * 48, *[4.0] * 50]  # 100 steps, warm-up 2
    row = describe(converged, warmup=2, max_steps=100, stopped_by_guard=False)
    assert row["diverged"] is False and row["final_loss"] == 4.0 and row["initial_loss"] == 8.0
    above = [8.0, 7.0, 6.0, 8.5, 5.0]  # above the initial loss after the warm-up: diverged
    row = describe(above, warmup=2, max_steps=5, stopped_by_guard=False)
    assert row["diverged_at"] == 4 and row["final_loss"] == 8.0  # counted at the initial loss
    guarded = [8.0, 9.0]  # stopped by the trainer's loss guard inside the warm-up
    row = describe(guarded, warmup=10, max_steps=100, stopped_by_guard=True)
    assert row["diverged_at"] == 2 and row["final_loss"] == 8.0
    cut = [8.0, 7.0, 6.0]  # cut short without diverging (e.g. killed): no final loss
    assert describe(cut, warmup=1, max_steps=100, stopped_by_guard=False)["final_loss"] is None


def test_lr_sensitivity_is_the_mean_excess_over_the_best_rate() -> None:
    finals = {1e-3: 5.0, 1e-2: 4.0, 1e-1: 9.5}
    initials = {1e-3: 8.0, 1e-2: 8.0, 1e-1: 8.0}  # the diverged-high rate counts at 8.0
    assert reproduce_stability.lr_sensitivity(finals, initials) == pytest.approx((1 + 0 + 4) / 3)
    assert reproduce_stability.lr_sensitivity({1e-3: 4.0}, {1e-3: 8.0}) == 0.0
    with pytest.raises(ValueError, match="same, non-empty set of rates"):
        reproduce_stability.lr_sensitivity({1e-3: 4.0}, {1e-2: 8.0})


def test_rates_for_seeds_and_confirmation_follow_the_rules() -> None:
    def row(lr: float, final: float, diverged: bool = False) -> dict[str, object]:
        return {"lr": lr, "final_loss": final, "diverged": diverged}

    rows = [row(1e-3, 5.00), row(1e-3, 5.05),  # span 0.05: the same
            row(1e-2, 4.0), row(1e-2, 4.3),  # span 0.3
            row(1e-1, 4.2), row(1e-1, 8.0, True),  # one diverged: differ, span 3.8
            row(3e-1, 8.0, True), row(3e-1, 8.0, True)]  # both diverged, same: no
    assert reproduce_stability.differing_rates(rows) == [1e-2, 1e-1]
    assert reproduce_stability.differing_rates(rows, limit=1) == [1e-1]
    lrs = [1e-3, 1e-2, 1e-1, 3e-1]
    assert reproduce_stability.boundary_rates(rows, lrs) == [1e-2, 1e-1]
    calm = rows[:4]
    assert reproduce_stability.boundary_rates(calm, lrs) == [1e-2]  # no divergence: widest
    assert reproduce_stability.boundary_rates([row(1e-3, 8.0, True)], lrs) == [1e-3]


@pytest.mark.slow
def test_stability_quick_sweep_writes_one_result_per_run_and_resumes(corpus: Path,
                                                                      tmp_path: Path) -> None:
    out, runs = tmp_path / "stability", tmp_path / "runs"
    args = ["--quick", "--phase", "main", "--out", str(out), "--runs-dir", str(runs),
            "--set", f"data_dir={corpus}", "packages=none", "vocab_size=400"]
    summary = reproduce_stability.main(args)
    names = {f"{n}_{a}_lr{lr:g}_s0" for n in ("pre", "post")
             for a in reproduce_stability.QUICK_ARMS for lr in reproduce_stability.QUICK_LRS}
    assert set(summary["ran_now"]["main"]) == names
    for name in names:
        result = json.loads((out / f"{name}.json").read_text())
        assert {"commit", "torch", "utc", "loadavg", "seed"} <= set(result)
        assert result["seed"] == 0 and len(result["loadavg"]) == 3
        assert result["steps"] == 6 and result["initial_loss"] > 0
        assert result["diverged"] or result["final_loss"] is not None
        trajectory = result["trajectory"]
        for key in ("loss", "max_attention_logit", "max_abs_logit", "mean_log_z"):
            assert all(v is not None and math.isfinite(v) for _, v in trajectory[key]), key
        per_layer = result["attention_logit_per_layer"]
        assert len(per_layer["attn_logit_enc"]["max_over_run"]) == 2  # tiny: 2 + 2 layers
        assert not list(runs.glob(f"{name}/step-*"))  # checkpoints dropped, logs kept
        assert (runs / name / "log.jsonl").exists()
    for norm in ("pre", "post"):
        for arm in reproduce_stability.QUICK_ARMS:
            row = summary["norms"][norm]["arms"][arm]
            assert row["lr_sensitivity"] is not None and row["lr_sensitivity"] >= 0
    assert summary["unigram_entropy"] > 0
    assert (out / "_summary.json").exists() and (out / "_final_loss.png").stat().st_size > 0
    assert (out / "_trajectories_pre.png").stat().st_size > 0
    # a second call finds every result and trains nothing; a lost result is redone alone
    (out / f"post_neither_lr{reproduce_stability.QUICK_LRS[0]:g}_s0.json").unlink()
    again = reproduce_stability.main(args)
    assert again["ran_now"]["main"] == [f"post_neither_lr{reproduce_stability.QUICK_LRS[0]:g}_s0"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_run_resumes_from_its_checkpoint_to_the_same_losses(corpus: Path,
                                                                      tmp_path: Path) -> None:
    """A sweep killed mid-run continues it (scripts.nmt_runs.train(resume=True)): the run
    stopped at step 4 of 6 (its checkpoint at 4) ends with the losses of one that never
    stopped; with nothing to resume, resume=True starts fresh."""
    settings = {**reproduce_stability.QUICK, "data_dir": corpus, "packages": "none",
                "vocab_size": 400, "log_every": 1, "ckpt_every": 2, "wandb_mode": "disabled"}
    whole = train("whole", tmp_path / "whole", {**settings, "max_steps": 6}, nproc=1,
                  timeout_s=300, resume=True)
    assert whole.returncode == 0 and not whole.resumed
    stopped = train("cut", tmp_path / "cut", {**settings, "max_steps": 4}, nproc=1,
                    timeout_s=300)
    assert stopped.returncode == 0 and len(stopped.records) == 4
    resumed = train("cut", tmp_path / "cut", {**settings, "max_steps": 6}, nproc=1,
                    timeout_s=300, resume=True)
    assert resumed.returncode == 0 and resumed.resumed
    assert "resumed from" in (tmp_path / "cut.out").read_text()
    assert [r["step"] for r in resumed.records] == list(range(1, 7))
    assert resumed.series("loss") == whole.series("loss")


@pytest.mark.slow
@pytest.mark.distributed
def test_stability_confirmation_runs_through_distributed_gpipe(corpus: Path,
                                                               tmp_path: Path) -> None:
    out, runs = tmp_path / "stability", tmp_path / "runs"
    common = ["--quick", "--norms", "pre", "--out", str(out), "--runs-dir", str(runs),
              "--set", f"data_dir={corpus}", "packages=none", "vocab_size=400"]
    # main-phase results made by hand: no divergence, arms 0.5 nats apart at 1e-3 only, so the
    # rule picks that single rate (one 2-process run keeps the test short)
    rows = []
    for arm, final in (("neither", 5.0), ("clip10", 5.5)):
        for lr in reproduce_stability.QUICK_LRS:
            rows.append({"name": f"pre_{arm}_lr{lr:g}_s0", "group": "main", "norm": "pre",
                         "arm": arm, "lr": lr, "seed": 0, "diverged": False, "diverged_at": None,
                         "initial_loss": 6.0, "final_loss": final if lr == 1e-3 else 5.0,
                         "trajectory": {k: [] for k in reproduce_stability.TRAJECTORY_KEYS}})
    for row in rows[:-1]:
        write_result(out / f"{row['name']}.json", row)
    # with a run of the grid missing, the rules have nothing to read: nothing is confirmed
    partial = reproduce_stability.main([*common, "--phase", "confirm"])
    assert partial["ran_now"]["confirm"] == []
    write_result(out / f"{rows[-1]['name']}.json", rows[-1])
    summary = reproduce_stability.main([*common, "--phase", "confirm"])
    expected = ["L128_pre_neither_lr0.001_s0"]
    assert summary["ran_now"]["confirm"] == expected
    for name in expected:
        result = json.loads((out / f"{name}.json").read_text())
        assert result["group"] == "confirm" and result["settings"]["num_stages"] == 2
        assert result["returncode"] in (0, 1) and result["steps"] >= 1
        assert "Error" not in (runs / f"{name}.out").read_text() or result["diverged"]
    assert {r["name"] for r in summary["confirm"]} == set(expected)


# --- issue 21, part 2: depth against width ------------------------------------------------------


def fake_test(losses: list[float], tokens: list[float], bleu_hits: int = 1) -> dict[str, object]:
    """A run's per-language test record with given sentence losses and BLEU statistics."""
    n = len(losses)
    # BLEU sufficient statistics per sentence: [hyp_len, ref_len, 4 x matches, 4 x totals]
    bleu = [[4, 4, bleu_hits, 0, 0, 0, 4, 3, 2, 1]] * n
    chrf = [[1.0] * 18] * n
    return {"loss": losses, "tokens": tokens, "bleu_stats": bleu, "chrf_stats": chrf,
            "copy_bleu_stats": bleu, "copy_chrf_stats": chrf}


BUCKETS = {"hi1": "high", "hi2": "high", "lo1": "low", "lo2": "low"}


def test_d_statistic_is_zero_for_identical_models() -> None:
    test = {lang: fake_test([3.0 + i, 5.0, 2.5], [3.0, 4.0, 2.0]) for i, lang in
            enumerate(BUCKETS)}
    runs = {"deep": {0: test, 1: test}, "wide": {0: test, 1: test}}
    for metric in ("loss", "bleu", "chrf"):
        d = reproduce_depth_width.d_statistic(runs, BUCKETS, metric, n_boot=30)
        assert d["point"] == 0.0 and d["ci95"] == [0.0, 0.0] and d["seeds"] == [0, 1]


def test_d_statistic_recovers_a_low_resource_gain_built_in() -> None:
    # every sentence of a low language costs the deep model 0.5 nats/token less than the wide
    # one, high languages cost the same: D = (-0.5) - 0 whatever the resample
    tokens = [2.0, 3.0, 5.0, 4.0]
    base = [2.0 * t for t in tokens]
    wide = {lang: fake_test(base, tokens) for lang in BUCKETS}
    deep = {lang: fake_test([b - 0.5 * t for b, t in zip(base, tokens, strict=True)]
                            if bucket == "low" else base, tokens)
            for lang, bucket in BUCKETS.items()}
    runs = {"deep": {0: deep, 1: deep}, "wide": {0: wide, 1: wide}}
    d = reproduce_depth_width.d_statistic(runs, BUCKETS, "loss", n_boot=50)
    assert d["point"] == pytest.approx(-0.5) and d["ci95"] == pytest.approx([-0.5, -0.5])
    # a seed the wide model lacks is left out (pairs only); one seed shifted widens the interval
    deep_noisy = {lang: fake_test([b + (1.0 * t if bucket == "low" else 0.0) for b, t in
                                   zip(base, tokens, strict=True)], tokens)
                  for lang, bucket in BUCKETS.items()}
    runs = {"deep": {0: deep, 1: deep_noisy, 2: deep}, "wide": {0: wide, 1: wide}}
    d = reproduce_depth_width.d_statistic(runs, BUCKETS, "loss", n_boot=200)
    assert d["seeds"] == [0, 1] and d["point"] == pytest.approx((-0.5 + 1.0) / 2)
    # the bootstrap over 2 seeds cannot reach beyond them; the t interval (df 1) does
    assert d["ci95_bootstrap"] == pytest.approx([-0.5, 1.0])
    half = 12.706 * (1.5 / 2**0.5) / 2**0.5  # t_{0.975,1} * sd(-0.5, 1.0) / sqrt(2)
    assert d["ci95"] == pytest.approx([0.25 - half, 0.25 + half], abs=1e-6)


def test_bucket_d_by_hand() -> None:
    values = {"deep": {"hi1": 4.0, "hi2": 5.0, "lo1": 6.0, "lo2": 7.0},
              "wide": {"hi1": 4.5, "hi2": 5.5, "lo1": 5.0, "lo2": 7.0}}
    # (deep - wide): high -0.5, -0.5 -> -0.5; low +1.0, 0.0 -> +0.5; D = 0.5 - (-0.5)
    assert reproduce_depth_width.bucket_d(values, BUCKETS) == pytest.approx(1.0)


def test_depth_width_configs_have_equal_parameters_and_the_same_init() -> None:
    from apps.nmt.config import load_nmt_config

    configs = {arch: load_nmt_config([f"--config={name}"])
               for arch, name in reproduce_depth_width.ARCHS.items()}
    counts = reproduce_depth_width.check_equal_parameters(configs, 0.01)
    assert abs(counts["deep"] - counts["wide"]) <= 0.01 * max(counts.values())
    deep, wide = configs["deep"], configs["wide"]
    assert (deep.num_layers, deep.ffn_dim, deep.num_heads) == (12, 256, 2)
    assert (wide.num_layers, wide.ffn_dim, wide.num_heads) == (6, 512, 4)
    assert deep.scaled_init is wide.scaled_init is False  # the depth scaling is off for both
    same = ("d_model", "head_dim", "vocab_size", "data_dir", "languages", "max_tokens", "lr",
            "warmup_steps", "max_steps", "ckpt_every", "dropout", "label_smoothing")
    assert all(getattr(deep, k) == getattr(wide, k) for k in same)
    with pytest.raises(SystemExit, match="differ by"):
        reproduce_depth_width.check_equal_parameters(
            {"deep": deep, "wide": replace(wide, ffn_dim=1024)}, 0.01)


@pytest.mark.slow
def test_depth_width_quick_sweep_scores_runs_at_matched_tokens(corpus: Path,
                                                               tmp_path: Path) -> None:
    out, runs = tmp_path / "depth_width", tmp_path / "runs"
    args = ["--quick", "--bootstrap", "20", "--out", str(out), "--runs-dir", str(runs),
            "--set", f"data_dir={corpus}", "packages=none", "vocab_size=400"]
    summary = reproduce_depth_width.main(args)
    assert summary["ran_now"] == ["deep_s0", "wide_s0", "deep_s1", "wide_s1"]
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("[dw]*.json")}
    assert set(results) == set(summary["ran_now"])
    for name, result in results.items():
        assert {"commit", "torch", "utc", "loadavg", "seed"} <= set(result)
        assert result["seed"] == int(name[-1]) and result["steps"] == 6
        # every checkpoint scored, not only the newest two the trainer keeps by default
        assert [c["step"] for c in result["dev_curve"]] == [2, 4, 6]
        assert result["best_step"] in (2, 4, 6)
        assert set(result["test"]) == {"de", "fr", "ru", "pt_BR"}
        assert sum(result["pairs_seen"].values()) > 0 and all(
            e > 0 for e in result["epochs"].values())
        assert not list((runs / name).glob("step-*"))
    for seed in (0, 1):  # identical batches per seed: the same tokens at every checkpoint
        deep, wide = results[f"deep_s{seed}"], results[f"wide_s{seed}"]
        assert [c["tokens"] for c in deep["dev_curve"]] == [c["tokens"] for c in wide["dev_curve"]]
        assert deep["pairs_seen"] == wide["pairs_seen"]
        assert deep["T"] != wide["T"]
    for metric in ("loss", "bleu", "chrf"):
        d = summary["D"][metric]
        assert d["seeds"] == [0, 1] and d["ci95"][0] <= d["point"] <= d["ci95"][1]
    # the curves compared at matched tokens: every checkpoint of every seed, D = low - high
    matched = summary["dev_loss_matched_tokens"]
    assert [(row["seed"], row["step"]) for row in matched] == [
        (seed, step) for seed in (0, 1) for step in (2, 4, 6)]
    for row in matched:
        run = {arch: next(c for c in results[f"{arch}_s{row['seed']}"]["dev_curve"]
                          if c["step"] == row["step"]) for arch in ("deep", "wide")}
        assert row["tokens"] == run["deep"]["tokens"] == run["wide"]["tokens"]
        values = {arch: c["dev_loss"] for arch, c in run.items()}
        assert row["D"] == pytest.approx(reproduce_depth_width.bucket_d(values,
                                                                        summary["buckets"]),
                                         abs=2e-4)
        assert row["D"] == pytest.approx(row["deep_minus_wide"]["low"]
                                         - row["deep_minus_wide"]["high"], abs=1e-4)
    assert (out / "_summary.json").exists() and (out / "_dev_loss.png").stat().st_size > 0
    assert (out / "_dev_loss_languages.png").stat().st_size > 0
    again = reproduce_depth_width.main(args)
    assert again["ran_now"] == [] and again["D"]["loss"]["point"] == summary["D"]["loss"]["point"]


@pytest.mark.slow
def test_depth_width_complement_trains_on_the_related_languages(corpus: Path,
                                                                tmp_path: Path) -> None:
    out, related = tmp_path / "depth_width_related", tmp_path / "related"
    args = ["--quick", "--corpus", "related", "--english-from", str(corpus), "--seeds", "0",
            "--bootstrap", "20", "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
            "--set", f"data_dir={related}"]
    summary = reproduce_depth_width.main(args)
    assert summary["ran_now"] == ["deep_s0", "wide_s0"]
    design = reproduce_depth_width.QUICK_DESIGN
    assert summary["train_pairs"] == design.train_pairs()
    parents = {family.parent for family in design.families}
    assert summary["buckets"] == {lang: "high" if lang in parents else "low"
                                  for lang in design.train_pairs()}
    result = json.loads((out / "deep_s0.json").read_text())
    assert result["settings"]["data_dir"] == str(related)
    assert set(result["test"]) == set(design.train_pairs())
    assert summary["D"]["loss"]["seeds"] == [0]
