"""Stability as learning-rate sensitivity (issue 21, part 1): the paper's two fixes, a tighter
clip, and two comparators from the literature, on pre- and post-norm Transformers, over a
learning-rate grid.

    python scripts/reproduce_stability.py [--phase all|main|seeds|comparators|confirm|report]
        [--jobs 2] [--out docs/reproduction/stability] [--runs-dir runs/stability] [--quick]

THE DESIGN, fixed before any run (changing it means a new experiment, not a re-reading):

Model and training (``BASE`` below; ``apps/nmt/configs/cpu_stability.yaml``): T(12, 256, 2) at
d=64 (2 heads of 32 channels): 12 encoder + 12 decoder layers, on the 14-language mix of
``cpu_default.yaml`` (4k shared vocabulary, ``.cache/gettext_m2en_mix``), 1,024 padded tokens
per step, Adam (beta2 0.98, eps 1e-9, no weight decay), linear warm-up over 150 steps then
inverse square root, **label smoothing 0, no gradient clip, dropout 0**, 1,000 steps, one
process (``num_stages=1``); the run is stopped early if the loss passes 1.5 x ln(V) (the
trainer's ``max_loss_factor``): a diverged run.

Grid (main phase, seed 0): arms x norms x learning rates = 5 x 2 x 6 = 60 runs.

- arms: ``neither`` (no fix), ``scaled_init`` (feed-forward init std x (2L)^-1/2),
  ``clip20`` (logits clamped to [-20, 20]), ``clip10`` (to [-10, 10]), ``both`` (scaled init
  and clip 20: the paper's pair);
- norms: ``pre`` (x + f(LN(x))), ``post`` (LN(x + f(x)), the original Transformer);
- learning rates: 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1.

Rules (applied to each run's per-step ``log.jsonl``):

- initial loss: the first step's loss. Divergence: the first step whose loss is NaN/inf, or
  above the initial loss after the warm-up (``scripts.nmt_runs.divergence_step``), or the step
  at which the trainer stopped the run on its loss guard.
- final loss: the mean training loss (cross entropy; minus the z-loss term where a z-loss is
  on) of the last 50 steps; for a diverged run, the initial loss. Each step's batch is drawn
  fresh from the stream before it is trained on; 1,000 steps are under one epoch of the high
  bucket.
- learning-rate sensitivity (Wortsman et al. 2023) of an arm and norm: the mean over the six
  rates of ``min(final, initial) - best``, ``best`` the arm's lowest ``min(final, initial)``
  over the rates (0 = the final loss does not depend on the rate; larger = more sensitive).
  Reported only where all six rates have a result.
- left the unigram plateau: final loss below the unigram entropy of the training targets
  (computed from the corpus) minus 0.1 nats.

Seeds phase (once a norm's main grid is complete; the rules read the whole grid, never part
of it): for each norm, the rates at which the arms differ (seed 0): some arm diverged
and another did not, or the arms' final losses span more than 0.1 nats. At most the two
such rates with the largest span per norm (ties: the larger rate); there every arm runs with
seeds 1 and 2 (up to 2 x 2 x 5 x 2 = 40 runs). Reported: mean and spread of the final loss
over the three seeds.

Comparators phase (run after the main phase; the issue calls them optional): ``z_loss``
(``neither`` + z-loss 1e-4, PaLM's weight) and ``qk_norm`` (``neither`` + qk-layernorm), at
every rate and norm, seed 0 (24 runs), reported as two more arms.

Confirmation phase (also once the main grid is complete): the 128-layer T(64, 256, 2) (64 + 64 layers, otherwise ``BASE``) through
``DistributedGPipe`` on 2 stages (2 processes, 2 micro-batches). Boundary rates per norm:
``lr_div``, the smallest rate at which some main-phase arm diverged, and the rate below it;
if no arm diverged for that norm, the single rate of largest span. Arms ``neither`` and
``both`` at those rates (at most 2 x 2 x 2 = 8 runs, 1,000 steps each).

Every run writes ``<out>/<name>.json`` (settings, commit, torch version, UTC time, load
average, seed, losses, divergence, per-step trajectories of loss, largest attention logit,
largest |logit|, mean log Z and clipped fraction, thinned to every ``TRAJECTORY_EVERY`` steps),
and a run whose JSON exists is skipped: the sweep continues where it stopped. The report phase
(also run at the end of every other phase) reads whatever results exist and writes
``<out>/_summary.json``, ``<out>/_final_loss.png`` (final loss against rate, arms overlaid,
pre and post side by side) and ``<out>/_trajectories_<norm>.png``.

``--quick`` (the test suite): the tiny config on the given corpus, arms ``neither`` and
``clip10`` (confirmation: ``neither``), both norms, two rates, 6 steps with a 2-step warm-up, comparators and
confirmation at the same size; one-process runs train inside this interpreter
(``scripts.nmt_runs.train_in_process``: no torchrun start-up), seconds per run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scripts.harness import (
    add_draft_argument,
    pyplot,
    refuse_dirty_tree,
    save_figure,
    set_draft,
)
from scripts.nmt_runs import (
    comparable,
    divergence_step,
    drop_checkpoints,
    machine_records,
    parse_settings,
    provenance,
    read_results,
    run_pending,
    stopped_as_diverged,
    t_interval,
    train,
    train_in_process,
    write_result,
)

ARMS: dict[str, dict[str, Any]] = {
    "neither": {"scaled_init": False, "clip_logits": False},
    "scaled_init": {"scaled_init": True, "clip_logits": False},
    "clip20": {"scaled_init": False, "clip_logits": True, "logits_abs_max": 20.0},
    "clip10": {"scaled_init": False, "clip_logits": True, "logits_abs_max": 10.0},
    "both": {"scaled_init": True, "clip_logits": True, "logits_abs_max": 20.0},
}
COMPARATORS: dict[str, dict[str, Any]] = {
    "z_loss": {**ARMS["neither"], "z_loss": 1e-4},
    "qk_norm": {**ARMS["neither"], "qk_norm": True},
}
NORMS = ("pre", "post")
LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
EXTRA_SEEDS = (1, 2)
CONFIRM_ARMS = ("neither", "both")
FINAL_WINDOW = 50  # steps averaged into the final loss
SPAN_NATS = 0.1  # arms "differ" at a rate when their final losses span more than this
MAX_SEED_RATES = 2  # rates per norm that get the extra seeds
PLATEAU_MARGIN = 0.1  # nats below the unigram entropy that count as off the plateau
TRAJECTORY_EVERY = 10  # steps between the points of a stored trajectory
TRAJECTORY_KEYS = ("loss", "max_attention_logit", "max_abs_logit", "mean_log_z",
                   "clipped_fraction")

BASE: dict[str, Any] = {"config": "cpu_stability"}
CONFIRM: dict[str, Any] = {"num_layers": 64, "num_stages": 2, "chunks": 2}
QUICK_ARMS = ("neither", "clip10")
QUICK_CONFIRM_ARMS = ("neither",)
QUICK_LRS = (1e-3, 3e-1)
QUICK: dict[str, Any] = {
    "config": "tiny", "max_steps": 6, "warmup_steps": 2, "num_stages": 1, "chunks": 1,
    "label_smoothing": 0.0, "clip_norm": 0.0, "dropout": 0.0, "eval_max_sentences": 2,
    "beam_size": 1, "max_decode_len": 4, "log_every": 2, "eval_every": 0, "ckpt_every": 0,
    "max_loss_factor": 1.5, "scaled_init": False, "hold_memory": False, "record_attention": True,
}
QUICK_CONFIRM: dict[str, Any] = {"num_stages": 2, "chunks": 2}


# ---------------------------------------------------------------------------------------------
# Names of runs


def run_name(norm: str, arm: str, lr: float, seed: int, *, confirm: bool = False) -> str:
    return f"{'L128_' if confirm else ''}{norm}_{arm}_lr{lr:g}_s{seed}"


def settings_of(base: Mapping[str, Any], norm: str, arm: str, lr: float, seed: int,
                *, confirm: Mapping[str, Any] | None = None) -> dict[str, Any]:
    flags = {**ARMS, **COMPARATORS}[arm]
    return {**base, **(confirm or {}), **flags, "norm": norm, "lr": lr, "seed": seed,
            "wandb_mode": "disabled"}


# ---------------------------------------------------------------------------------------------
# What a run did (pure functions of its records; tested on hand-made records)


def cross_entropy_series(records: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per-step training cross entropy: the logged loss minus the z-loss term, if any."""
    return [float(r["loss"]) - float(r.get("z_loss_term") or 0.0) for r in records]


def describe_losses(losses: Sequence[float], *, warmup: int, max_steps: int,
                    stopped_by_guard: bool) -> dict[str, Any]:
    """Initial loss, divergence step and final loss of one run by the rules of the docstring."""
    if not losses:
        return {"initial_loss": None, "diverged": None, "diverged_at": None, "final_loss": None,
                "steps": 0}
    initial = losses[0]
    diverged_at = divergence_step(losses, after=warmup)
    if diverged_at is None and stopped_by_guard:
        diverged_at = len(losses)
    diverged = diverged_at is not None
    finite_tail = [x for x in losses[-FINAL_WINDOW:] if math.isfinite(x)]
    complete = len(losses) >= max_steps
    if diverged:
        final = initial
    elif complete and finite_tail:
        final = sum(finite_tail) / len(finite_tail)
    else:
        final = None  # cut short without diverging: no final loss (the run must be redone)
    return {"initial_loss": initial, "diverged": diverged, "diverged_at": diverged_at,
            "final_loss": final, "steps": len(losses)}


def lr_sensitivity(finals: Mapping[float, float], initials: Mapping[float, float]) -> float:
    """Wortsman et al.'s learning-rate sensitivity: the mean over rates of
    ``min(final, initial) - best``, ``best`` the smallest ``min(final, initial)``."""
    if not finals or set(finals) != set(initials):
        raise ValueError(f"finals at rates {sorted(finals)} and initials at {sorted(initials)} "
                         "must cover the same, non-empty set of rates")
    capped = {lr: min(finals[lr], initials[lr]) for lr in finals}
    best = min(capped.values())
    return sum(v - best for v in capped.values()) / len(capped)


def differing_rates(rows: Sequence[Mapping[str, Any]], *, limit: int = MAX_SEED_RATES) -> list[float]:
    """The rates at which the arms of one norm differ (seed 0): some diverged and some not, or
    final losses spanning more than ``SPAN_NATS``; the ``limit`` of largest span (ties: the
    larger rate). ``rows``: results with ``lr``, ``diverged``, ``final_loss``."""
    by_lr: dict[float, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row["final_loss"] is not None:
            by_lr.setdefault(row["lr"], []).append(row)
    spans = {}
    for lr, group in by_lr.items():
        if len(group) < 2:
            continue
        finals = [r["final_loss"] for r in group]
        span = max(finals) - min(finals)
        split = len({bool(r["diverged"]) for r in group}) == 2
        if split or span > SPAN_NATS:
            spans[lr] = span
    return sorted(sorted(spans, key=lambda lr: (spans[lr], lr), reverse=True)[:limit])


def boundary_rates(rows: Sequence[Mapping[str, Any]], lrs: Sequence[float]) -> list[float]:
    """The confirmation's rates for one norm: the smallest rate at which some arm diverged and
    the grid rate below it; with no divergence, the single rate of largest span."""
    lrs = sorted(lrs)
    diverged = sorted({r["lr"] for r in rows if r["diverged"]})
    if diverged:
        first = diverged[0]
        index = lrs.index(first)
        return lrs[max(0, index - 1):index + 1]
    return differing_rates(rows, limit=1)


def thin(records: Sequence[Mapping[str, Any]], key: str, every: int) -> list[Any]:
    """``[step, value]`` every ``every`` steps, and the last step (None where not logged)."""
    points = []
    for index, record in enumerate(records):
        if (index + 1) % every == 0 or index == 0 or index == len(records) - 1:
            points.append([record["step"], record.get(key)])
    return points


# ---------------------------------------------------------------------------------------------
# One run


def run_one(name: str, settings: Mapping[str, Any], *, arm: str, out: Path, runs_dir: Path,
            nproc: int, group: str, timeout_s: float, keep_runs: bool,
            in_process: bool = False) -> dict[str, Any]:
    """Train one configuration and write its result JSON."""
    from apps.nmt.config import load_nmt_config

    config = load_nmt_config([f"--{k}={v}" for k, v in settings.items() if k != "wandb_mode"])
    started = provenance(int(settings["seed"]))
    if in_process and nproc == 1:
        run = train_in_process(name, runs_dir / name, settings)
    else:
        run = train(name, runs_dir / name, settings, nproc=nproc, timeout_s=timeout_s,
                    resume=True)
    losses = cross_entropy_series(run.records)
    described = describe_losses(losses, warmup=config.warmup_steps, max_steps=config.max_steps,
                                stopped_by_guard=stopped_as_diverged(run))
    layers = {}
    for key in ("attn_logit_enc", "attn_logit_dec_self", "attn_logit_dec_cross"):
        columns = [r.get(key) for r in run.records if r.get(key)]
        if columns:  # per layer: the largest over the run, and at the last step
            layers[key] = {
                "max_over_run": [max((c[i] for c in columns if c[i] is not None), default=None)
                                 for i in range(len(columns[0]))],
                "last": columns[-1],
            }
    result = {
        "name": name,
        "experiment": "stability",
        "group": group,
        **started,
        "settings": {k: v for k, v in settings.items() if k != "wandb_mode"},
        "norm": config.norm,
        "arm": arm,
        "lr": config.lr,
        "layers": 2 * config.num_layers,
        "warmup_steps": config.warmup_steps,
        "max_steps": config.max_steps,
        "returncode": run.returncode,
        "wall_minutes": round(run.wall_minutes, 3),
        "resumed": run.resumed,  # continued from a checkpoint: the wall time is the last part's
        "seconds_per_step": (round(run.seconds_per_step, 4)
                             if run.seconds_per_step is not None else None),
        **described,
        "trajectory": {key: thin(run.records, key, TRAJECTORY_EVERY) for key in TRAJECTORY_KEYS},
        "attention_logit_per_layer": layers,
        "clip_engaged_steps": sum(bool(r.get("clip_engaged")) for r in run.records),
        "finished_utc": provenance(int(settings["seed"]))["utc"],
    }
    write_result(out / f"{name}.json", result)
    if not keep_runs:
        drop_checkpoints(runs_dir / name)
    return result


# ---------------------------------------------------------------------------------------------
# The report: statistics and plots from whatever results exist


def unigram_entropy(data_dir: str | Path, languages: Sequence[str] | None) -> float | None:
    """Entropy (nats) of the training targets' token distribution, EOS included: the loss of a
    model that ignores the source and the prefix. None if the corpus is not there."""
    import numpy as np

    from apps.nmt.data import CorpusError, _read_split, language_counts, load_manifest

    try:
        manifest = load_manifest(data_dir)
    except CorpusError:
        return None
    langs = list(languages) if languages else sorted(
        lang for lang, n in language_counts(data_dir, "train").items() if n > 0)
    counts = np.zeros(int(manifest["vocab_size"]), dtype=np.int64)
    for lang_data in _read_split(Path(data_dir), "train", langs).values():
        counts += np.bincount(np.asarray(lang_data.tgt, dtype=np.int64),
                              minlength=len(counts))[: len(counts)]
        counts[int(manifest["eos_id"])] += len(lang_data)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def summarise(results: Sequence[Mapping[str, Any]], lrs: Sequence[float],
              unigram: float | None) -> dict[str, Any]:
    """Per norm and arm: final loss per rate (per seed), sensitivity, divergences; the rates
    the rules pick for the seeds and the confirmation."""
    main = [r for r in results if r["group"] in ("main", "comparators", "seeds")]
    summary: dict[str, Any] = {"unigram_entropy": unigram, "lrs": list(lrs), "norms": {}}
    for norm in NORMS:
        rows = [r for r in main if r["norm"] == norm]
        seed0 = [r for r in rows if r["seed"] == 0 and r["group"] == "main"]
        arms: dict[str, Any] = {}
        for arm in [*ARMS, *COMPARATORS]:
            mine = [r for r in rows if r["arm"] == arm]
            if not mine:
                continue
            first = {r["lr"]: r for r in mine if r["seed"] == 0}
            complete = [lr for lr in lrs if lr in first and first[lr]["final_loss"] is not None]
            entry: dict[str, Any] = {
                "final_loss_seed0": {f"{lr:g}": first[lr]["final_loss"] for lr in complete},
                "diverged": {f"{r['lr']:g}_s{r['seed']}": r["diverged_at"] for r in mine
                             if r["diverged"]},
                "runs": len(mine),
                "lr_sensitivity": (
                    lr_sensitivity({lr: first[lr]["final_loss"] for lr in complete},
                                   {lr: first[lr]["initial_loss"] for lr in complete})
                    if len(complete) == len(lrs) else None),
            }
            seeds: dict[str, list[float]] = {}
            for r in mine:
                if r["final_loss"] is not None:
                    seeds.setdefault(f"{r['lr']:g}", []).append(r["final_loss"])
            entry["final_loss_over_seeds"] = {
                lr: {"n": len(v), "mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                for lr, v in seeds.items() if len(v) > 1}
            if unigram is not None:
                entry["left_plateau"] = {f"{lr:g}": first[lr]["final_loss"] < unigram - PLATEAU_MARGIN
                                         for lr in complete}
            arms[arm] = entry
        summary["norms"][norm] = {
            "arms": arms,
            "seed_rates": differing_rates(seed0),
            "boundary_rates": boundary_rates(seed0, lrs) if seed0 else [],
        }
    summary["paired_differences"] = paired_differences(main)
    confirm = [r for r in results if r["group"] == "confirm"]
    summary["confirm"] = [{k: r[k] for k in ("name", "norm", "arm", "lr", "diverged",
                                             "diverged_at", "final_loss", "initial_loss",
                                             "seconds_per_step")} for r in confirm]
    return summary


def paired_differences(results: Sequence[Mapping[str, Any]],
                       records: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Each arm minus ``neither`` at the same norm, rate and seed, wherever more than one seed
    ran: the per-seed differences of runs on one machine, their mean and 95% t interval, and
    the pairs left out because the two runs' machines differ (or cannot be shown to be the
    same: ``scripts.nmt_runs.comparable``, with ``machines.json`` for older results)."""
    records = machine_records() if records is None else records
    runs = {(r["norm"], r["arm"], r["lr"], r["seed"]): r for r in results}
    multi = sorted({(n, lr) for (n, a, lr, s) in runs if s != 0})
    out: dict[str, Any] = {}
    for norm, lr in multi:
        for arm in sorted({a for (n, a, x, s) in runs if n == norm and x == lr and a != "neither"}):
            kept, left_out = {}, {}
            for seed in sorted({s for (n, a, x, s) in runs if (n, a, x) == (norm, arm, lr)}):
                fix, base = runs.get((norm, arm, lr, seed)), runs.get((norm, "neither", lr, seed))
                if base is None or fix is None or None in (fix["final_loss"], base["final_loss"]):
                    continue
                keys = (f"stability/{fix['name']}", f"stability/{base['name']}")
                diff = fix["final_loss"] - base["final_loss"]
                if comparable(fix, base, keys=keys, records=records):
                    kept[str(seed)] = diff
                else:
                    left_out[str(seed)] = {"difference": diff,
                                           "why": "the two runs ran on different machines"}
            out[f"{norm}/{arm}/{lr:g}"] = {
                "norm": norm, "arm": arm, "lr": lr, "minus": "neither",
                "per_seed_same_machine": kept, "left_out": left_out,
                **t_interval(list(kept.values()))}
    return out


def plot(results: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], out: Path) -> None:
    plt = pyplot()
    arms = [*ARMS, *COMPARATORS]
    colors = {arm: f"C{i}" for i, arm in enumerate(arms)}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharex=True, sharey=True)
    grid = sorted({r["lr"] for r in results}) or list(LRS)
    axes[0].set_xlim(grid[0] / 1.5, grid[-1] * 1.5)  # both panels on the grid, run or not
    for ax, norm in zip(axes, NORMS, strict=True):
        for arm in arms:
            rows = sorted((r for r in results if r["norm"] == norm and r["arm"] == arm
                           and r["group"] != "confirm" and r["final_loss"] is not None),
                          key=lambda r: r["lr"])
            if not rows:
                continue
            lrs = sorted({r["lr"] for r in rows})
            means = [sum(r["final_loss"] for r in rows if r["lr"] == lr)
                     / sum(1 for r in rows if r["lr"] == lr) for lr in lrs]
            ax.plot(lrs, means, "-o", color=colors[arm], label=arm, markersize=4)
            for r in rows:
                ax.plot([r["lr"]], [r["final_loss"]], "x" if r["diverged"] else ".",
                        color=colors[arm], markersize=8 if r["diverged"] else 3)
        if summary.get("unigram_entropy"):
            ax.axhline(summary["unigram_entropy"], color="gray", linestyle=":",
                       label="unigram entropy")
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_title(f"{norm}-norm: final loss (x = diverged, at its initial loss)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final training cross entropy (nats/token)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    save_figure(fig, out / "_final_loss.png", dpi=90)

    labels = {"loss": "loss", "max_attention_logit": "largest attention logit",
              "max_abs_logit": "largest |logit|", "mean_log_z": "mean log Z",
              "clipped_fraction": "fraction clipped"}
    for norm in NORMS:
        rows = [r for r in results if r["norm"] == norm and r["seed"] == 0
                and r["group"] in ("main", "comparators")]
        lrs = sorted({r["lr"] for r in rows})
        if not lrs:
            continue
        fig, axes = plt.subplots(len(labels), len(lrs), figsize=(3.2 * len(lrs), 11),
                                 squeeze=False)
        for col, lr in enumerate(lrs):
            for row_index, (key, label) in enumerate(labels.items()):
                ax = axes[row_index][col]
                for r in rows:
                    if r["lr"] != lr:
                        continue
                    points = [(s, v) for s, v in r["trajectory"][key] if v is not None]
                    if points:
                        ax.plot(*zip(*points, strict=True), color=colors[r["arm"]],
                                label=r["arm"], linewidth=1)
                if row_index == 0:
                    ax.set_title(f"lr {lr:g}", fontsize=9)
                if col == 0:
                    ax.set_ylabel(label, fontsize=8)
                ax.grid(alpha=0.3)
        if axes[0][0].get_legend_handles_labels()[0]:
            axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{norm}-norm trajectories, seed 0", fontsize=10)
        save_figure(fig, out / f"_trajectories_{norm}.png", dpi=80)


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", default="all",
                        choices=["all", "main", "seeds", "comparators", "confirm", "report"])
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs at a time (one-process runs; the confirmation runs one at a "
                             "time on 2 processes)")
    parser.add_argument("--out", type=Path, default=Path("docs/reproduction/stability"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/stability"))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="apps.nmt.train settings for every run (e.g. the data_dir of a "
                             "test corpus); they change the design, so they are recorded")
    parser.add_argument("--norms", nargs="+", default=list(NORMS), choices=list(NORMS),
                        help="restrict every phase to these norms (tests, partial reruns)")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny model, 2 arms x 2 norms x 2 rates, 6 steps (tests)")
    parser.add_argument("--keep-runs", action="store_true", help="keep checkpoints of runs")
    parser.add_argument("--timeout-minutes", type=float, default=120.0, help="per run")
    add_draft_argument(parser)
    args = parser.parse_args(argv)
    # a published result from a dirty tree is refused now, not after the run (issue 40)
    set_draft(args.draft)
    refuse_dirty_tree(args.out)
    started = time.monotonic()
    extra: dict[str, Any] = parse_settings(args.set)
    base = {**(QUICK if args.quick else BASE), **extra}
    confirm_over = QUICK_CONFIRM if args.quick else CONFIRM
    confirm_arms = QUICK_CONFIRM_ARMS if args.quick else CONFIRM_ARMS
    norms = [n for n in NORMS if n in args.norms]
    arms = list(QUICK_ARMS) if args.quick else list(ARMS)
    lrs = list(QUICK_LRS) if args.quick else list(LRS)
    timeout_s = 60 * args.timeout_minutes
    jobs = 1 if args.quick else args.jobs  # --quick trains in this process: one at a time
    out = args.out

    def work_for(group: str, specs: Mapping[str, tuple[dict[str, Any], str]], nproc: int) -> Any:
        def work(name: str) -> None:
            settings, arm = specs[name]
            run_one(name, settings, arm=arm, out=out, runs_dir=args.runs_dir, nproc=nproc,
                    group=group, timeout_s=timeout_s, keep_runs=args.keep_runs,
                    in_process=args.quick)
        return work

    def results() -> list[dict[str, Any]]:
        return read_results(out)

    if args.phase != "report":
        # the corpus once, here, before runs start in parallel (each would build it otherwise)
        from apps.nmt.config import load_nmt_config
        from apps.nmt.train import prepare_corpus

        prepare_corpus(load_nmt_config([f"--{k}={v}" for k, v in base.items()]))
    ran: dict[str, list[str]] = {}
    if args.phase in ("all", "main"):
        specs = {run_name(n, a, lr, 0): (settings_of(base, n, a, lr, 0), a)
                 for n in norms for a in arms for lr in lrs}
        ran["main"] = run_pending(list(specs), out, work_for("main", specs, 1), jobs=jobs)
    def main_grid(norm: str) -> list[dict[str, Any]] | None:
        """The main phase's results of ``norm`` if its grid is complete, else None: the
        rules that pick rates for the later phases read the whole grid, never a part of it."""
        rows = [r for r in results() if r["group"] == "main" and r["norm"] == norm]
        missing = len(arms) * len(lrs) - len({(r["arm"], r["lr"]) for r in rows})
        if missing:
            print(f"{norm}-norm: {missing} main-phase runs have no result yet; the seeds and "
                  "confirmation phases wait for the whole grid (run --phase main first)",
                  file=sys.stderr, flush=True)
            return None
        return rows

    if args.phase in ("all", "seeds"):
        specs = {}
        for norm in norms:
            seed0 = main_grid(norm)
            for lr in differing_rates(seed0) if seed0 is not None else []:
                for arm in arms:
                    for seed in EXTRA_SEEDS:
                        specs[run_name(norm, arm, lr, seed)] = (
                            settings_of(base, norm, arm, lr, seed), arm)
        ran["seeds"] = run_pending(list(specs), out, work_for("seeds", specs, 1), jobs=jobs)
    if args.phase in ("all", "comparators"):
        specs = {run_name(n, a, lr, 0): (settings_of(base, n, a, lr, 0), a)
                 for n in norms for a in COMPARATORS for lr in lrs}
        ran["comparators"] = run_pending(list(specs), out, work_for("comparators", specs, 1),
                                         jobs=jobs)
    if args.phase in ("all", "confirm"):
        specs = {}
        for norm in norms:
            seed0 = main_grid(norm)
            for lr in boundary_rates(seed0, lrs) if seed0 is not None else []:
                for arm in confirm_arms:
                    specs[run_name(norm, arm, lr, 0, confirm=True)] = (settings_of(
                        base, norm, arm, lr, 0, confirm=confirm_over), arm)
        ran["confirm"] = run_pending(list(specs), out, work_for("confirm", specs, 2), jobs=1)

    # --- report, from whatever results exist ---
    found = results()
    from apps.nmt.config import load_nmt_config

    config = load_nmt_config([f"--{k}={v}" for k, v in base.items()])
    unigram = unigram_entropy(config.data_dir, config.languages or None)
    if unigram is None and (out / "_summary.json").exists():
        # the corpus is not prepared in this checkout: the entropy the last report computed
        # from it (it depends on the corpus only, which corpus_seed fixes)
        unigram = json.loads((out / "_summary.json").read_text()).get("unigram_entropy")
    summary = summarise(found, lrs, unigram)
    summary.update({
        "design": {"base": base, "arms": {a: {**ARMS, **COMPARATORS}[a] for a in
                                          [*arms, *COMPARATORS]},
                   "norms": list(NORMS), "lrs": lrs, "extra_seeds": list(EXTRA_SEEDS),
                   "confirm": confirm_over, "confirm_arms": list(confirm_arms),
                   "final_window": FINAL_WINDOW, "span_nats": SPAN_NATS},
        "results": len(found),
        "ran_now": ran,
        "wall_minutes": round((time.monotonic() - started) / 60, 2),
        **provenance(0),
    })
    if found:
        write_result(out / "_summary.json", summary)
        plot(found, summary, out)
    else:
        print(f"no results in {out} yet: nothing to report", file=sys.stderr)
    for norm, entry in summary["norms"].items():
        for arm, row in entry["arms"].items():
            print(f"{norm:<5}{arm:<12} sensitivity {row['lr_sensitivity']}  diverged "
                  f"{row['diverged']}  final {row['final_loss_seed0']}")
    return summary


if __name__ == "__main__":
    main()
