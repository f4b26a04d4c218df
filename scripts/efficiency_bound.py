"""Every schedule against the limit (issue 42.1): the step time held against its bubble-free
bound measured in the same run, ours against torch.distributed.pipelining, and gp.plan's choice
against the best measured.

For each family (MLP blocks, a Transformer-encoder stack, both apps' CPU default models,
AmoebaNet-D on 56x56 images) this launches ``scripts/bench_pipeline.py`` ``--launches`` times
at K=2 and M=4K=8: every one of our schedules and torch's, one step of each per round. From each
launch it takes, per schedule, the median step time and the median of step / bound, the bound of
a step being its busiest rank's own compute (``bench_pipeline.bound``: each action from its
input's arrival to its end); the family's numbers are the medians over the launches.

Goals (the issue's): the fastest schedule reaches >= 0.95 of its bound on every family; ours is
at least as fast as torch.distributed.pipelining on each schedule both have (the rounds ours won
are counted over every launch: each round is one step of both); ``gp.plan``'s choice (its
predicted fastest of the schedules measured, each with the benchmark's balance, priced as the
apps price a budget's plan: each layer's seconds timed in this process at M, one thread, with a
fused and a split backward, the transfers by the CPU-core device model) is within 3% of the
fastest measured; the choice from the counted costs alone is recorded beside it. Where a family misses 0.95, its row says where the fastest schedule's time went on
each rank: its compute, the wait inside actions for a neighbour's message, the time outside
actions (before the first: the fill; between them: the transport's posts and receives, Python;
after the last: the drain, until the slowest rank ends), and for the
zero-bubble schedules what the backward's split into I and W added to the compute of 1F1B.

``gp.tune``'s choice is recorded beside it (``plan_tuned``): after the launches, two fresh
ranks (pinned, freed memory held, as the benchmark's) build gp.plan's shortlist of the measured
schedules (each at the balance it ran with, predicted within 20% of the fastest, at most 4) and
time it in ``--tune-rounds`` rotating rounds; its fastest is held against the launches' fastest,
measured apart from it.

``--balance planned`` runs each schedule (ours and torch's of the same name) at the balance
``gp.plan`` chooses for it from the same per-layer seconds, instead of the layers in equal counts;
the plan goal then holds gp.plan's whole configuration (schedule and balance) against the
fastest measured.

``--apart`` runs each schedule in its own bench_pipeline.py run (two fresh ranks holding our
pipeline of that schedule and torch's counterpart, paired round by round, no plain module steps),
one run after another within a launch, the first schedule rotating from launch to launch: the
processes hold what a user's run holds, where the default's hold every schedule at once.

Writes ``docs/reproduction/efficiency_bound.json`` (``--json``) with provenance and every launch's
rows (their per-step samples), and prints one table.

    python scripts/efficiency_bound.py [--families mlp encoder nmt_app amoebanet_app amoebanet_56px]
                                       [--schedules gpipe 1f1b ...] [--apart]
                                       [--launches 3 --steps 10] [--balance planned] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

import gpipe_core as gp
from apps.planning import CPU_CORE
from gpipe_core.launch import spawn
from scripts.bench_pipeline import OURS, TORCH_COUNTERPART, parse_args, workload
from scripts.harness import provenance, setup_process, write_json

ROOT = Path(__file__).resolve().parents[1]

K = 2
M = 4 * K
FAMILIES = ("mlp", "encoder", "nmt_app", "amoebanet_app", "amoebanet_56px")
GOAL_BOUND = 0.95  # the fastest schedule's step against its bubble-free bound
GOAL_PLAN = 0.03  # gp.plan's choice, measured, above the fastest measured
SPLIT = ("zb_h1", "zb_h2")  # schedules whose backward runs as I then W, one stage per rank
# a step's time on each rank by cause (bench_pipeline.bound): compute; waits inside actions for
# a neighbour's message; outside the actions: before the first (the fill), the gaps between
# them, after the last (the drain)
CAUSES = ("compute_per_rank", "wait_per_rank", "outside_actions_per_rank", "fill_per_rank",
          "between_actions_per_rank", "drain_per_rank")
# the causes both libraries' steps are accounted by (bench_pipeline times torch's calls too)
SHARED_CAUSES = CAUSES[:3]


def bench_arguments(family: str, args: Namespace, balances: dict[str, list[int]]) -> list[str]:
    """bench_pipeline.py's arguments for ``family`` at M=8 (``balances``: per schedule, else
    equal counts), but for where it writes."""
    arguments = ["--family", family, "--microbatches", str(M), "--steps", str(args.steps),
                 "--warmup", "2", "--order", args.order]
    if args.quick:
        arguments += ["--tiny", "--blocks", "4", "--width", "16", "--batch", "16", "--seq", "2"]
    for schedule, balance in balances.items():
        arguments += ["--balance-of", f"{schedule}={','.join(map(str, balance))}"]
    return arguments


def launch(family: str, index: int, args: Namespace, scratch: Path,
           balances: dict[str, list[int]]) -> dict[str, Any]:
    """One launch of ``family`` at M=8, its report: one run of bench_pipeline.py over
    ``args.schedules``, or with ``args.apart`` one run per schedule, the launch's ``index``
    rotating which runs first, each run's rows of its own schedule kept."""
    if not args.apart:
        return bench(family, str(index), args, scratch, balances, args.schedules)
    shift = index % len(args.schedules)
    rows = []
    for schedule in [*args.schedules[shift:], *args.schedules[:shift]]:
        report = bench(family, f"{index}_{schedule}", args, scratch, balances, [schedule])
        rows += [r for r in report["rows"] if r["schedule"] == schedule]  # not zb_h1's torch 1F1B
    return {"rows": rows}


def bench(family: str, name: str, args: Namespace, scratch: Path,
          balances: dict[str, list[int]], schedules: list[str]) -> dict[str, Any]:
    """One run of bench_pipeline.py for ``family`` at M=8 over our ``schedules`` (and their
    torch counterparts); its report."""
    out = scratch / f"{family}_{name}"
    command = [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"),
               *bench_arguments(family, args, balances), "--schedules", *schedules,
               *(["--no-plain"] if args.apart else []),
               "--out", str(out), "--json", str(out / "report.json")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            timeout=args.launch_timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"bench_pipeline.py --family {family} failed (exit "
                         f"{result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads((out / "report.json").read_text())


PROFILED = ("gpipe", "zb_h1")  # a fused backward's B, and a split one's I and W, per layer


def layer_profiles(config: Namespace) -> list[gp.StageProfile]:
    """Each layer's seconds for the workload of bench_pipeline's ``config``, timed here at M
    with one thread as a rank has (``gp.profile_stages`` with one stage per layer, a fused and
    a split schedule: B, and I and W as they measure): what the apps plan with. ``main``
    holds freed memory first, as the ranks do (``gp.hold_freed_memory``). Messages pass
    unpacked (``pack_messages=False``): gp.plan prices the boundaries a plan cuts by
    ``CPU_CORE``, where a profile that packs would charge every layer's."""
    work = workload(config)
    model = work.build()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [gp.profile_stages(model, [1] * len(model), work.inputs, work.targets,
                                  loss_fn=work.loss_fn, chunks=M, schedule=schedule, rounds=3,
                                  pack_messages=False)
                for schedule in PROFILED]
    finally:
        torch.set_num_threads(threads)


def _plans(config: Namespace, schedules: dict[str, list[int] | None],
           profiles: list[gp.StageProfile] | None) -> dict[str, gp.Plan]:
    """gp.plan's plan of each schedule (at its given balance, or its own where None), priced
    by ``profiles`` (else by the counted costs on the CPU-core device model alone)."""
    work = workload(config)
    model = work.build()
    costs = gp.layer_costs(model, work.inputs)
    plans = {}
    for schedule, balance in schedules.items():
        try:
            plans[schedule] = gp.plan(
                costs, device=CPU_CORE, optimizer="adam", batch_size=len(work.targets),
                stages=[K], microbatches=[M], schedule=schedule, checkpoints=["never"],
                balance=balance, profiles=profiles)[0]
        except (ValueError, gp.NoPlanFits):
            continue  # a schedule the planner does not model at this layout
    return plans


def planned_balances(config: Namespace, profiles: list[gp.StageProfile], schedules: list[str]
                     ) -> dict[str, list[int]]:
    """gp.plan's own balance for each of our ``schedules`` (``--balance planned``)."""
    return {s: p.balance for s, p in _plans(config, dict.fromkeys(schedules), profiles).items()}


def planned(config: Namespace, balances: dict[str, list[int]],
            profiles: list[gp.StageProfile] | None) -> dict[str, float]:
    """gp.plan's predicted step time of each measured schedule at the balance it ran with
    (``balances``), priced by ``profiles`` as the apps price a budget's plan, or where None by
    the counted costs alone."""
    return {s: p.step_time for s, p in _plans(config, dict(balances), profiles).items()}


def tuned(config: Namespace, plans: list[gp.Plan], args: Namespace) -> list[dict[str, Any]]:
    """gp.tune's timing of the shortlist of ``plans`` (gp.plan's of the measured schedules, each
    at the balance it ran with), in two fresh ranks set up as the benchmark's; the timed plans,
    fastest first."""
    setup = functools.partial(setup_process, pin=True, hold_memory=True)
    result: list[dict[str, Any]] = spawn(_tune_ranks, K, None, config, plans, args.tune_rounds,
                                         setup=setup, pg_timeout_s=120,
                                         timeout_s=args.launch_timeout_s)[0]
    return result


def _tune_ranks(rank: int, world: int, config: Namespace, plans: list[gp.Plan],
                rounds: int) -> list[dict[str, Any]]:
    work = workload(config)
    return [{"schedule": t.plan.schedule, "balance": t.plan.balance,
             "predicted_seconds": t.plan.step_time, "seconds": t.seconds, "samples": t.samples}
            for t in gp.tune(plans, work.build, work.inputs, work.targets, loss_fn=work.loss_fn,
                             rounds=rounds, warmup=2)]


def summarize(family: str, reports: list[dict[str, Any]], predicted: dict[str, float],
              counted: dict[str, float] | None = None,
              timed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The family's row: per schedule the medians over launches; the goals' verdicts."""
    launches = [{(r["impl"], r["schedule"]): r for r in report["rows"] if r["M"] == M}
                for report in reports]
    ours = [s for s in OURS if all(("gpipe_core", s) in rows for rows in launches)]

    def median_of(key: tuple[str, str], field: str) -> float:
        return statistics.median(rows[key][field] for rows in launches)

    def summary(schedule: str) -> dict[str, Any]:
        ran = [rows[("gpipe_core", schedule)] for rows in launches]
        row: dict[str, Any] = {field: statistics.median(r[field] for r in ran)
                               for field in ("seconds", "bound_seconds", "bound_efficiency")}
        row["bound_efficiency_per_launch"] = [r["bound_efficiency"] for r in ran]
        row["balance"] = ran[0]["balance"]  # the same in every launch
        for field in CAUSES:
            row[field] = [statistics.median(r[field][rank] for r in ran) for rank in range(K)]
        return row

    schedules = {s: summary(s) for s in ours}
    fastest = min(schedules, key=lambda s: schedules[s]["seconds"])
    torch_rows = {}
    for s in ours:
        theirs = TORCH_COUNTERPART[s]
        if theirs != s or not all(("torch.pipelining", s) in rows for rows in launches):
            continue  # only the schedules both libraries have
        won = rounds = 0
        for rows in launches:
            a, b = rows[("gpipe_core", s)]["samples"], rows[("torch.pipelining", s)]["samples"]
            won += sum(x < y for x, y in zip(a, b, strict=True))
            rounds += len(a)
        torch_rows[s] = {"torch_seconds": median_of(("torch.pipelining", s), "seconds"),
                         "torch_over_ours": median_of(("torch.pipelining", s), "seconds")
                         / schedules[s]["seconds"], "ours_won": won, "rounds": rounds}
        theirs_ran = [rows[("torch.pipelining", s)] for rows in launches]
        if all(field in r for r in theirs_ran for field in SHARED_CAUSES):
            # torch's own account of the same rounds (bench_pipeline times its calls)
            for field in SHARED_CAUSES:
                torch_rows[s][f"torch_{field}"] = [
                    statistics.median(r[field][rank] for r in theirs_ran) for rank in range(K)]
    row: dict[str, Any] = {
        "family": family, "M": M, "K": K, "launches": len(reports),
        "schedules": schedules, "fastest": fastest,
        "fastest_bound_efficiency": schedules[fastest]["bound_efficiency"],
        "bound_goal_met": schedules[fastest]["bound_efficiency"] >= GOAL_BOUND,
        "best_bound_efficiency": max(v["bound_efficiency"] for v in schedules.values()),
        "torch": torch_rows,
        "torch_goal_met": all(r["torch_over_ours"] >= 1.0 for r in torch_rows.values()),
    }
    if "1f1b" in schedules:  # what splitting the backward into I and W added to the compute
        row["split_excess_per_rank"] = {
            s: [schedules[s]["compute_per_rank"][r] - schedules["1f1b"]["compute_per_rank"][r]
                for r in range(K)] for s in SPLIT if s in schedules}
    for key, prices in (("plan", predicted), ("plan_counted", counted or {})):
        ran = {s: p for s, p in prices.items() if s in schedules}
        if ran:
            choice = min(ran, key=ran.__getitem__)
            row[key] = {"predicted_seconds": ran, "choice": choice,
                        "choice_over_fastest": schedules[choice]["seconds"]
                        / schedules[fastest]["seconds"] - 1}
    if "plan" in row:
        row["plan_goal_met"] = row["plan"]["choice_over_fastest"] <= GOAL_PLAN
    if timed:
        choice = timed[0]["schedule"]
        row["plan_tuned"] = {"timed": timed, "choice": choice,
                             "choice_over_fastest": schedules[choice]["seconds"]
                             / schedules[fastest]["seconds"] - 1}
        row["plan_tuned_goal_met"] = row["plan_tuned"]["choice_over_fastest"] <= GOAL_PLAN
    return row


def _ms(per_rank: list[float]) -> str:
    """Seconds per rank as whole milliseconds, rank 0 first: "145/171"."""
    return "/".join(f"{x * 1e3:.0f}" for x in per_rank)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"K={K}, M={M}; medians over launches; bound = the busiest rank's own compute")
    for row in rows:
        s = row["schedules"]
        print(f"\n{row['family']} ({row['launches']} launches): fastest {row['fastest']} "
              f"{s[row['fastest']]['balance']} at "
              f"{s[row['fastest']]['seconds']:.4f} s, {row['fastest_bound_efficiency']:.3f} of its "
              f"bound (goal {GOAL_BOUND}: {'met' if row['bound_goal_met'] else 'missed'})")
        print(f"  {'schedule':<17}{'s/step':>9}{'bound s':>9}{'bound/step':>11}"
              f"{'compute/rank':>15}{'wait/rank':>13}{'outside/rank':>15}")
        for name, v in s.items():
            compute, wait, outside = (_ms(v[key]) for key in SHARED_CAUSES)
            print(f"  {name:<17}{v['seconds']:>9.4f}{v['bound_seconds']:>9.4f}"
                  f"{v['bound_efficiency']:>11.3f}{compute:>15}{wait:>13}{outside:>15}  (ms)")
        for name, t in row["torch"].items():
            print(f"  vs torch.pipelining {name}: torch/ours {t['torch_over_ours']:.3f}, ours "
                  f"faster in {t['ours_won']}/{t['rounds']} paired rounds")
            if "torch_compute_per_rank" in t:
                print("    torch's compute/wait/outside per rank: "
                      + ", ".join(_ms(t[f"torch_{key}"]) for key in SHARED_CAUSES)
                      + " ms; ours: " + ", ".join(_ms(s[name][key]) for key in SHARED_CAUSES)
                      + " ms")
        if not row["bound_goal_met"]:
            v = s[row["fastest"]]
            print(f"  where {row['fastest']}'s time went, per rank (ms): " + "; ".join(
                f"rank {r}: fill {v['fill_per_rank'][r] * 1e3:.1f}, waits inside actions "
                f"{v['wait_per_rank'][r] * 1e3:.1f}, between actions "
                f"{v['between_actions_per_rank'][r] * 1e3:.1f}, drain "
                f"{v['drain_per_rank'][r] * 1e3:.1f}" for r in range(K)))
        if row.get("split_excess_per_rank"):
            print("  I+W split's compute above 1F1B's B, per rank: " + ", ".join(
                f"{n} " + "/".join(f"{x * 1e3:+.1f}" for x in v) + " ms"
                for n, v in row["split_excess_per_rank"].items()))
        if "plan" in row:
            p = row["plan"]
            print(f"  gp.plan chose {p['choice']} {s[p['choice']]['balance']}: measured "
                  f"{p['choice_over_fastest']:+.1%} "
                  f"against the fastest (goal <= {GOAL_PLAN:.0%}: "
                  f"{'met' if row['plan_goal_met'] else 'missed'})")
        if "plan_tuned" in row:
            t = row["plan_tuned"]
            print(f"  gp.tune timed {', '.join(x['schedule'] for x in t['timed'])} and chose "
                  f"{t['choice']}: measured {t['choice_over_fastest']:+.1%} against the fastest "
                  f"(goal <= {GOAL_PLAN:.0%}: {'met' if row['plan_tuned_goal_met'] else 'missed'})")
        if "plan_counted" in row:
            c = row["plan_counted"]
            print(f"  (priced by counted costs alone it would choose {c['choice']}: "
                  f"{c['choice_over_fastest']:+.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds per launch")
    parser.add_argument("--quick", action="store_true", help="tiny models (the tests)")
    parser.add_argument("--launch-timeout-s", type=float, default=1800.0)
    parser.add_argument("--balance", choices=["equal", "planned"], default="equal",
                        help="equal: the layers in equal counts per stage; planned: each "
                             "schedule at gp.plan's own balance (from the same per-layer "
                             "seconds), torch's schedule of that name too")
    parser.add_argument("--order", choices=["fixed", "shuffled"], default="fixed",
                        help="bench_pipeline's order of the configurations in each round")
    parser.add_argument("--schedules", nargs="+", choices=OURS, default=list(OURS),
                        help="our schedules to measure, each with its torch counterpart")
    parser.add_argument("--apart", action="store_true",
                        help="one bench_pipeline.py run per schedule in each launch (processes "
                             "holding one pipeline of ours and torch's counterpart, as a "
                             "user's run holds one), instead of one run holding them all")
    parser.add_argument("--tune-rounds", type=int, default=5,
                        help="gp.tune's timed rounds of gp.plan's shortlist (0: no tuning)")
    parser.add_argument("--json", default="docs/reproduction/efficiency_bound.json")
    args = parser.parse_args()
    if args.launches < 1 or args.steps < 1 or args.tune_rounds < 0:
        parser.error(f"--launches {args.launches} and --steps {args.steps} must be at least 1, "
                     f"--tune-rounds {args.tune_rounds} at least 0")
    # the profiles as the ranks run (bench_pipeline's: freed memory kept mapped), as an app's
    # rank 0 measures them
    gp.hold_freed_memory()
    load_before = os.getloadavg()
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="efficiency_bound_") as scratch:
        for family in args.families:
            config = parse_args([*bench_arguments(family, args, {}), "--out", scratch,
                                 "--json", str(Path(scratch) / "unused.json")])
            profiles = layer_profiles(config)
            balances = planned_balances(config, profiles, args.schedules) if args.balance == "planned" else {}
            reports = [launch(family, i, args, Path(scratch), balances)
                       for i in range(args.launches)]
            raw[family] = [report["rows"] for report in reports]
            ran = {r["schedule"]: r["balance"] for r in reports[0]["rows"]
                   if r["impl"] == "gpipe_core" and r["M"] == M}
            plans = _plans(config, dict(ran), profiles)
            timed = tuned(config, list(plans.values()), args) if args.tune_rounds else None
            rows.append(summarize(family, reports, {s: p.step_time for s, p in plans.items()},
                                  planned(config, ran, None), timed))
    print_table(rows)
    write_json(args.json, {"provenance": provenance(load_before), "config": vars(args),
                           "goals": {"bound": GOAL_BOUND, "plan": GOAL_PLAN},
                           "families": rows, "launch_rows": raw})
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
