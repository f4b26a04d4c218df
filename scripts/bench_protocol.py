"""Issue 26's benchmark protocol: ours against torch.distributed.pipelining over independent runs.

One claim of "faster" needs more than one run: each run here is a separate launch of
``scripts/bench_pipeline.py`` (two fresh gloo processes, every schedule of ours and of torch
round-robin within it) for each model family, ``--runs`` times, run-major (run 1 of every
family, then run 2, ...) so that slow drifts of the machine touch all families alike. A run
whose JSON exists is not repeated (the protocol resumes where it stopped).

Per family it reports, over the runs: our fastest schedule and torch's fastest (by each run's
median step), the ratio torch best / ours best per run with its median and spread, and the
paired per-round win count (in each round of each run, the two fastest schedules' samples
side by side); and our split-backward schedules against our 1F1B (median ratio over the runs).
Goal (issue 26; K=2, M=8, median of 3 runs): ours >= 1.05x torch's best on every family.

Writes every run's JSON to ``--out-dir`` (``<family>_run<r>.json``) and the summary, with
``scripts.harness.provenance``, to ``--out-dir``/summary.json.

    python scripts/bench_protocol.py [--families mlp encoder nmt_app amoebanet_app --runs 3
                                      --microbatches 8 --steps 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.bench_pipeline import FAMILIES
from scripts.harness import provenance, write_json

ROOT = Path(__file__).resolve().parent.parent
GOAL = 1.05  # torch's best step / ours best step, median over runs, every family
OURS, TORCH = "gpipe_core", "torch.pipelining"  # bench_pipeline's "impl" of a row
SPLIT = ("zb_h1", "zb_h2", "interleaved_zb", "zb_v", "dualpipe_v")


def run_path(out_dir: Path, family: str, run: int) -> Path:
    return out_dir / f"{family}_run{run}.json"


def launch(family: str, run: int, args: argparse.Namespace) -> None:
    """One independent run of bench_pipeline for ``family`` (skipped if its JSON exists)."""
    path = run_path(args.out_dir, family, run)
    if path.exists():
        print(f"[{family} run {run}] {path} exists: skipped", file=sys.stderr, flush=True)
        return
    command = [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--family", family,
               "--microbatches", str(args.microbatches), "--steps", str(args.steps),
               "--json", str(path), "--out", str(Path(args.work_dir) / f"{family}_run{run}"),
               *args.bench_args]
    print(f"[{family} run {run}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=args.timeout)


def fastest(rows: Sequence[dict[str, Any]], impl: str, among: Sequence[str] | None = None
            ) -> dict[str, Any]:
    candidates = [r for r in rows if r["impl"] == impl and r.get("seconds")
                  and (among is None or r["schedule"] in among)]
    if not candidates:
        raise ValueError(f"no {impl} rows" + (f" among {list(among)}" if among else ""))
    return min(candidates, key=lambda r: r["seconds"])


def summarize_family(runs: Sequence[dict[str, Any]], m: int) -> dict[str, Any]:
    """Over the runs of one family: ours best against torch best, split against 1F1B."""
    per_run = []
    wins = rounds = 0
    split_over_1f1b: dict[str, list[float]] = {}
    for report in runs:
        rows = [r for r in report["rows"] if r["M"] == m]
        ours, theirs = fastest(rows, OURS), fastest(rows, TORCH)
        per_run.append({"ours": ours["schedule"], "ours_s": ours["seconds"],
                        "torch": theirs["schedule"], "torch_s": theirs["seconds"],
                        "torch_over_ours": theirs["seconds"] / ours["seconds"]})
        for a, b in zip(ours["samples"], theirs["samples"], strict=True):
            wins += a < b
            rounds += 1
        plain_1f1b = next(r for r in rows if r["impl"] == OURS and r["schedule"] == "1f1b")
        for r in rows:
            if r["impl"] == OURS and r["schedule"] in SPLIT and r.get("seconds"):
                split_over_1f1b.setdefault(r["schedule"], []).append(
                    r["seconds"] / plain_1f1b["seconds"])
    ratios = [r["torch_over_ours"] for r in per_run]
    median = statistics.median(ratios)
    return {
        "runs": per_run,
        "torch_over_ours_median": median,
        "torch_over_ours_range": [min(ratios), max(ratios)],
        "paired_rounds_ours_faster": wins,
        "paired_rounds": rounds,
        "goal_met": median >= GOAL,
        "split_over_our_1f1b_median": {k: statistics.median(v)
                                       for k, v in split_over_1f1b.items()},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="timed rounds per run")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "reproduction" / "protocol")
    parser.add_argument("--work-dir", default="out/bench_protocol", help="PNGs of each run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                        help="passed to bench_pipeline.py (e.g. --tiny --warmup 1)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1")
    load_before = os.getloadavg()
    for run in range(1, args.runs + 1):
        for family in args.families:
            launch(family, run, args)
    summary: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                          for k, v in vars(args).items()},
                               "goal": f"torch best / ours best >= {GOAL}, median of the runs",
                               "families": {}}
    for family in args.families:
        runs = [json.loads(run_path(args.out_dir, family, r).read_text())
                for r in range(1, args.runs + 1)]
        result = summarize_family(runs, args.microbatches)
        summary["families"][family] = result
        each = ", ".join(f"{r['torch_over_ours']:.3f}" for r in result["runs"])
        print(f"{family}: torch best / ours best = {result['torch_over_ours_median']:.3f} "
              f"(runs {each}; "
              f"ours faster in {result['paired_rounds_ours_faster']} of "
              f"{result['paired_rounds']} paired rounds); goal met: {result['goal_met']}")
        for r in result["runs"]:
            print(f"    ours {r['ours']} {r['ours_s']:.4f} s, torch {r['torch']} "
                  f"{r['torch_s']:.4f} s")
        print("    split / our 1f1b: " + ", ".join(
            f"{k} {v:.3f}" for k, v in result["split_over_our_1f1b_median"].items()))
    summary["provenance"] = provenance(load_before)
    write_json(args.out_dir / "summary.json", summary)
    return summary


if __name__ == "__main__":
    main()
