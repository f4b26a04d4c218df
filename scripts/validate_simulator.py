"""``gp.simulate`` validated out of sample: costs profiled in one launch predict the step times
measured in another.

Each family runs in two separate launches of two gloo processes (one core and one thread each,
as ``scripts/bench_pipeline.py`` runs them), so a prediction never sees the rounds it predicts:

1. **Profile** (``<out>/<family>_profile.json``). The K=2 balance: the optimal cut of every
   layer's forward + backward, from a per-layer ``gp.profile_stages`` (one stage per layer,
   M=1) on rank 0, broadcast. The transfer: a gloo ping-pong for several payload sizes, fitted
   as latency + bytes / bandwidth. Then for each configuration (schedule, re-materialization,
   M), both ranks at once each replay their own row of the schedule
   (``gp.profile_stages(..., ranks=[rank])``): the costs of every action as the pipeline runs
   them, with the other core busy as it is in the pipeline, minus the waiting. And the second
   route to costs: every configuration run in ``gp.DistributedGPipe`` round-robin (as in 2.),
   its actions' costs taken from the timelines (``pipe.profile()``: input arrival to end).
2. **Measure** (``<out>/<family>_measured.json``), a new launch: ``gp.DistributedGPipe`` with
   the profile's balance for every configuration, round-robin (one step of each per round, so
   that changes in the machine's load touch all alike); a step lasts as long as its slowest
   rank; the per-round samples are kept.
3. **Measure again** (``<out>/<family>_remeasured.json``), launch 3, the same as launch 2: its
   medians as a prediction of launch 2's (``another_launch``) are the floor of any prediction
   made in one launch for another on this host (a profile is a launch too).
4. **Report** (``<out>/<family>_validation.json``): per configuration and route (``replay``,
   ``pipeline``: launch 1's costs; ``cross``: fill-drain from 1F1B's launch-1 pipeline costs at
   the same M and the reverse; ``in_situ``: launch 2's own actions, not a prediction but the
   split of the error between costs and schedule model), ``gp.simulate`` on those costs
   (with the fitted transfer of the boundary's payload) against the measured median, each
   route twice: simulating the median costs, and (``<route>_rounds``) simulating every timed
   round with its own costs and taking the median step (``per_round=True``: a step is a
   maximum over paths, so the step of median costs is too fast wherever costs vary):
   the signed error of the step time; per schedule and re-materialization, the throughput at
   each M normalised to M=1 (Table 2's quantity), predicted against measured, and its signed
   error; per M, the median error and how many are of each sign; Kendall's tau between the
   predicted and measured step times over the configurations. The goals (issue 22): median
   |error| <= 5%, worst <= 10%, errors not all of one sign at any M, tau >= 0.9.

    python scripts/validate_simulator.py [--families transformer encoder amoebanet]
        [--phase all|profile|measure|report] [--rounds 9] [--out docs/reproduction/simulator]
    python scripts/validate_simulator.py --tiny --out /tmp/validation   # the tests

``encoder`` is held out: a stack of ``nn.TransformerEncoderLayer`` (d=192, 4 heads, FFN 768,
8 layers, a linear head; batch 32 x 48 tokens) that no part of the simulator or the profiler
was tuned on; ``transformer`` and ``amoebanet`` are Table 2's families
(``scripts/reproduction.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

import gpipe_core as gp
from gpipe_core.launch import spawn
from gpipe_core.partition import optimal_balance
from scripts.harness import provenance, setup_process, timed_step, write_json
from scripts.reproduce_throughput import fit_transfer, ping_pong
from scripts.reproduction import (
    ENCODER,
    THROUGHPUT_FAMILIES,
    TINY_ENCODER,
    TINY_THROUGHPUT_FAMILIES,
    Family,
    Size,
    layer_sizes,
)

K = 2
CONFIGS = [("gpipe", "except_last"), ("gpipe", "never"), ("1f1b", "never"), ("zb_h1", "never")]
MICROBATCHES = (1, 2, 4, 8)
GOALS = {"median_abs_error": 0.05, "worst_abs_error": 0.10, "kendall_tau": 0.9}


def families(tiny: bool) -> dict[str, tuple[Family, Size]]:
    if tiny:
        return {**TINY_THROUGHPUT_FAMILIES, "encoder": (TINY_ENCODER, {"L": 3})}
    return {**THROUGHPUT_FAMILIES, "encoder": (ENCODER, {"L": 8})}


# --- the two launches -----------------------------------------------------------------------


def _configs(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    return [(s, c, m) for m in args.microbatches for s, c in CONFIGS]


def profile_worker(rank: int, world_size: int, args: argparse.Namespace) -> str | None:
    """Launch 1: the balance, the transfer fit, and every configuration's replayed costs."""
    family, size = families(args.tiny)[args.family]
    inputs, targets = family.batch(family.batch_size)
    model = gp.materialize(family.build(size), seed=0)
    n = len(model)
    whole: list[float] = [0.0] * n
    if rank == 0:
        layers = gp.profile_stages(model, [1] * n, inputs, targets, loss_fn=family.loss_fn,
                                   rounds=args.rounds, warmup=1)
        whole = [f + b for f, b in zip(layers.forward, layers.backward, strict=True)]
    shared = [whole]
    dist.broadcast_object_list(shared, src=0)
    balance = list(optimal_balance(shared[0], K))
    sizes = layer_sizes(family.build(size), inputs)
    payloads = sorted({1024, 64 * 1024, 1 << 20} | {int(b) for b in sizes.outputs})
    transfer_points = ping_pong(rank, payloads, repeats=args.pingpong_repeats)
    boundary_bytes = sizes.outputs[balance[0] - 1]
    profiles = []
    for schedule, checkpoint, m in _configs(args):
        dist.barrier()  # both ranks replay at once, as both compute at once in the pipeline
        mine = gp.profile_stages(model, balance, inputs, targets, loss_fn=family.loss_fn,
                                 schedule=schedule, chunks=m, checkpoint=checkpoint,
                                 rounds=args.rounds, warmup=1, ranks=[rank])
        gathered: list[Any] = [None] * K
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            profiles.append({"schedule": schedule, "checkpoint": checkpoint, "M": m,
                             "stages": [_stage_costs(gathered[s], s) for s in range(K)]})
    # The second route: the costs of the actions as a running pipeline ran them
    # (``DistributedGPipe.profile()``), every configuration round-robin, in this launch.
    pipes, _ = _round_robin(args, balance)
    ran = {key: pipe.profile() for key, pipe in pipes.items()}
    if rank != 0:
        return None
    for entry in profiles:
        measured = ran[(entry["schedule"], entry["checkpoint"], entry["M"])]
        entry["pipeline_stages"] = [_stage_costs(measured, s) for s in range(K)]
    return json.dumps({"balance": balance, "layers": n,
                       "parameters": sum(p.numel() for p in model.parameters()),
                       "size": size, "batch_size": family.batch_size,
                       "boundary_bytes": boundary_bytes,
                       "transfer_points": {str(k): v for k, v in transfer_points.items()},
                       "per_layer_forward_backward": shared[0], "profiles": profiles})


def _stage_costs(profile: gp.StageProfile, s: int) -> dict[str, Any]:
    """Stage ``s``'s costs from the profile its own rank made (the other stage's are NaN)."""
    def at(values: list[float] | None) -> float | None:
        return None if values is None else values[s]

    return {"forward": at(profile.forward), "backward": at(profile.backward),
            "forward_no_grad": at(profile.forward_no_grad), "recompute": at(profile.recompute),
            "backward_input": at(profile.backward_input),
            "backward_weight": at(profile.backward_weight),
            "samples": profile.samples[s]}


def _round_robin(args: argparse.Namespace, balance: list[int]
                 ) -> tuple[dict[tuple[str, str, int], gp.DistributedGPipe],
                            dict[tuple[str, str, int], list[float]]]:
    """Every configuration's ``DistributedGPipe`` with ``balance``, one step of each per round
    (so that changes in the machine's load touch all alike); timelines hold the timed rounds."""
    family, size = families(args.tiny)[args.family]
    inputs, targets = family.batch(family.batch_size)
    pipes = {}
    for schedule, checkpoint, m in _configs(args):
        pipes[(schedule, checkpoint, m)] = gp.DistributedGPipe(
            family.build(size), balance, chunks=m, schedule=schedule, checkpoint=checkpoint,
            loss_fn=family.loss_fn, seed=0, record=True)
    samples: dict[tuple[str, str, int], list[float]] = {key: [] for key in pipes}
    for round_ in range(args.warmup + args.rounds):
        for key, pipe in pipes.items():
            def step(pipe: gp.DistributedGPipe = pipe) -> None:
                pipe.zero_grad(set_to_none=True)
                pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None)

            if round_ == args.warmup:
                pipe.timeline.clear()  # the timed rounds' actions only
            seconds = timed_step(step)
            if round_ >= args.warmup:
                samples[key].append(seconds)
    return pipes, samples


def measure_worker(rank: int, world_size: int, args: argparse.Namespace,
                   balance: list[int]) -> str | None:
    """Launch 2: every configuration's step time, round-robin, with the profile's balance."""
    pipes, samples = _round_robin(args, balance)
    in_situ = {key: pipe.profile() for key, pipe in pipes.items()}
    waited = {key: sum((e.ready if e.ready is not None else e.start) - e.start
                       for e in pipe.timeline) / args.rounds for key, pipe in pipes.items()}
    gathered: list[Any] = [None] * K
    dist.all_gather_object(gathered, waited)
    if rank != 0:
        return None
    return json.dumps({"rows": [{"schedule": s, "checkpoint": c, "M": m,
                                 "seconds": statistics.median(v), "samples": v,
                                 "in_pipeline_stages": [_stage_costs(in_situ[(s, c, m)], r)
                                                        for r in range(K)],
                                 "wait_per_step": [w[(s, c, m)] for w in gathered]}
                                for (s, c, m), v in samples.items()]})


# --- the report -----------------------------------------------------------------------------


def predict(profile: dict[str, Any], entry: dict[str, Any], *, per_round: bool = False) -> float:
    """``gp.simulate``'s step time for one configuration from its stage costs: of the median
    costs, or (``per_round``) the median over the rounds of each round's own costs."""
    stages = entry["stages"]
    latency, per_byte = fit_transfer({int(k): v for k, v in profile["transfer_points"].items()})
    m = entry["M"]
    link = latency + per_byte * profile["boundary_bytes"] / m
    split = all(st["backward_input"] is not None for st in stages)
    costs = gp.StageProfile(
        schedule=entry["schedule"], num_microbatches=m, checkpoint=entry["checkpoint"],
        forward=[st["forward"] for st in stages], backward=[st["backward"] for st in stages],
        forward_no_grad=[st["forward_no_grad"] for st in stages],
        recompute=[st["recompute"] for st in stages],
        backward_input=[st["backward_input"] for st in stages] if split else None,
        backward_weight=[st["backward_weight"] for st in stages] if split else None,
        transfer=[link], samples=[st.get("samples") or {} for st in stages])
    schedule = gp.get_schedule(entry["schedule"], K, m)
    return gp.simulate(schedule, costs, per_round=per_round).step_time


def kendall_tau(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Kendall's tau-a: (concordant - discordant) pairs over all pairs (ties count neither)."""
    pairs = list(itertools.combinations(range(len(xs)), 2))
    if not pairs:
        return float("nan")
    score = 0
    for i, j in pairs:
        product = (xs[i] - xs[j]) * (ys[i] - ys[j])
        score += (product > 0) - (product < 0)
    return score / len(pairs)


# A configuration predicted from another one's in-pipeline costs at the same M: fill-drain and
# 1F1B without re-materialization run the same actions in another order.
CROSS = {("gpipe", "never"): ("1f1b", "never"), ("1f1b", "never"): ("gpipe", "never")}
ROUTES = ("replay", "pipeline", "in_situ")
# Each route twice: the step of the median costs, and (``_rounds``) the median of the steps of
# each timed round's own costs (``gp.simulate(..., per_round=True)``).
KINDS = {"": False, "_rounds": True}


def compare(profile: dict[str, Any], measured: dict[str, Any],
            remeasured: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted against measured per configuration, per M, normalised to M=1, and the goals,
    for each route to the costs: ``replay`` (launch 1's ``gp.profile_stages``), ``pipeline``
    (launch 1's running pipelines, ``DistributedGPipe.profile()``), ``in_situ`` (launch 2's
    own actions: not a prediction, the split of the error between costs and schedule model);
    and ``cross``: a configuration from another configuration's launch-1 pipeline costs.
    With ``remeasured`` (launch 3, the measurement repeated), ``another_launch``: launch 3's
    median step as the prediction of launch 2's, the floor of any prediction from a launch."""
    again = {} if remeasured is None else {
        (r["schedule"], r["checkpoint"], r["M"]): r["seconds"] for r in remeasured["rows"]}
    by_key = {(r["schedule"], r["checkpoint"], r["M"]): r for r in measured["rows"]}
    entries = {(e["schedule"], e["checkpoint"], e["M"]): e for e in profile["profiles"]}
    rows = []
    for key, entry in entries.items():
        if key not in by_key:
            continue
        actual = by_key[key]["seconds"]
        row: dict[str, Any] = {"schedule": key[0], "checkpoint": key[1], "M": key[2],
                               "measured_s": actual, "measured_samples": by_key[key]["samples"]}
        sources = {"replay": entry["stages"], "pipeline": entry.get("pipeline_stages"),
                   "in_situ": by_key[key].get("in_pipeline_stages")}
        source = CROSS.get(key[:2])
        if source is not None and (*source, key[2]) in entries:
            sources["cross"] = entries[(*source, key[2])].get("pipeline_stages")
            row["cross_source"] = f"{source[0]} {source[1]}"
        for route, stages in sources.items():
            if stages is None:
                continue
            for suffix, per_round in KINDS.items():
                if per_round and not all(st.get("samples") for st in stages):
                    continue  # costs without their rounds
                predicted = predict(profile, {**entry, "stages": stages}, per_round=per_round)
                row[f"{route}{suffix}_predicted_s"] = predicted
                row[f"{route}{suffix}_error"] = predicted / actual - 1
        if key in again:
            row["another_launch_predicted_s"] = again[key]
            row["another_launch_error"] = again[key] / actual - 1
        if sources["in_situ"] is not None:
            row["in_pipeline_over_replay"] = [
                {kind: ran[kind] / mine[kind] for kind in ("forward", "backward")
                 if ran[kind] and mine[kind]}
                for ran, mine in zip(sources["in_situ"], entry["stages"], strict=True)]
            row["wait_per_step"] = by_key[key].get("wait_per_step")
        rows.append(row)
    # Table 2's quantity: throughput at M over throughput at M=1, same schedule and mode.
    for row in rows:
        base = next((r for r in rows if (r["schedule"], r["checkpoint"], r["M"]) ==
                     (row["schedule"], row["checkpoint"], 1)), None)
        row["normalised_measured"] = None if base is None else (
            base["measured_s"] / row["measured_s"])
        for route in [r + suffix for r in ROUTES for suffix in KINDS] + ["another_launch"]:
            if base is None or f"{route}_predicted_s" not in row:
                continue
            predicted = base[f"{route}_predicted_s"] / row[f"{route}_predicted_s"]
            row[f"{route}_normalised_predicted"] = predicted
            row[f"{route}_normalised_error"] = predicted / row["normalised_measured"] - 1
    summaries = {route + suffix: _summary(rows, route + suffix) for route in (*ROUTES, "cross")
                 for suffix in KINDS if any(f"{route}{suffix}_error" in r for r in rows)}
    if any("another_launch_error" in r for r in rows):
        summaries["another_launch"] = _summary(rows, "another_launch")
    return {"rows": rows, "summary": summaries, "goals": GOALS,
            "measurement_floor": measurement_floor(rows)}


def measurement_floor(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How well the measurement predicts itself: the median of the odd rounds against the
    median of the even rounds, per configuration (|error| and Kendall's tau over the
    configurations). No predictor can be expected to rank or hit the measured medians more
    closely than the measurement's own halves agree."""
    halves = [(statistics.median(r["measured_samples"][0::2]),
               statistics.median(r["measured_samples"][1::2]))
              for r in rows if len(r["measured_samples"]) >= 2]
    if len(halves) < 2:
        return None
    errors = [abs(a / b - 1) for a, b in halves]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "kendall_tau": kendall_tau([a for a, _ in halves], [b for _, b in halves])}


def _summary(rows: list[dict[str, Any]], route: str) -> dict[str, Any]:
    """One route's errors against the goals: median and worst |error|, the sign per M,
    Kendall's tau, and the normalised ratio's error."""
    have = [r for r in rows if f"{route}_error" in r]
    errors = [r[f"{route}_error"] for r in have]
    per_m = {}
    for m in sorted({r["M"] for r in have}):
        at_m = [r[f"{route}_error"] for r in have if r["M"] == m]
        per_m[str(m)] = {"median_error": statistics.median(at_m),
                         "too_fast": sum(e < 0 for e in at_m),
                         "too_slow": sum(e > 0 for e in at_m)}
    tau = kendall_tau([r[f"{route}_predicted_s"] for r in have],
                      [r["measured_s"] for r in have])
    normalised = [abs(r[f"{route}_normalised_error"]) for r in have
                  if r.get(f"{route}_normalised_error") is not None and r["M"] > 1]
    summary = {
        "configurations": len(have),
        "median_abs_error": statistics.median(abs(e) for e in errors),
        "worst_abs_error": max(abs(e) for e in errors),
        "kendall_tau": tau,
        "per_M": per_m,
        "one_sign_at_some_M": any(v["too_fast"] == 0 or v["too_slow"] == 0
                                  for v in per_m.values() if v["too_fast"] + v["too_slow"] > 1),
        "normalised_median_abs_error": statistics.median(normalised) if normalised else None,
        "normalised_worst_abs_error": max(normalised) if normalised else None,
    }
    summary["goals_met"] = bool(
        summary["median_abs_error"] <= GOALS["median_abs_error"]
        and summary["worst_abs_error"] <= GOALS["worst_abs_error"]
        and tau >= GOALS["kendall_tau"] and not summary["one_sign_at_some_M"])
    return summary


def print_report(name: str, report: dict[str, Any]) -> None:
    print(f"{name}: predicted (profile launch) against measured (measure launch)")
    routes = [r for r in ("replay", "pipeline", "pipeline_rounds", "cross", "another_launch")
              if r in report["summary"]]
    print(f"{'M':>3} {'schedule':<8}{'ckpt':<12}{'measured':>9}"
          + "".join(f"{route:>16}{'err':>7}" for route in routes))
    for r in report["rows"]:
        cells = "".join(f"{r[f'{route}_predicted_s']:>16.4f}{r[f'{route}_error']:>+7.1%}"
                        if f"{route}_error" in r else " " * 23 for route in routes)
        print(f"{r['M']:>3} {r['schedule']:<8}{r['checkpoint']:<12}{r['measured_s']:>9.4f}"
              + cells)
    floor = report.get("measurement_floor")
    if floor is not None:
        print(f"  the measurement's odd rounds against its even rounds: median |error| "
              f"{floor['median_abs_error']:.1%}, worst {floor['worst_abs_error']:.1%}, "
              f"Kendall tau {floor['kendall_tau']:.2f}")
    for route, s in report["summary"].items():
        print(f"  {route:15s}: median |error| {s['median_abs_error']:.1%}, worst "
              f"{s['worst_abs_error']:.1%}, Kendall tau {s['kendall_tau']:.2f}, one sign at "
              f"some M: {s['one_sign_at_some_M']}; goals met: {s['goals_met']}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["transformer", "encoder", "amoebanet"])
    parser.add_argument("--phase", choices=["all", "profile", "measure", "remeasure", "report"],
                        default="all",
                        help="remeasure: launch 3, the measurement again (the floor of any "
                             "prediction from another launch; all runs it too)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES))
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (profile, measure)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds when measuring")
    parser.add_argument("--pingpong-repeats", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="tiny models for the tests")
    parser.add_argument("--out", type=Path, default=Path("docs/reproduction/simulator"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"--rounds {args.rounds} must be at least 1 and --warmup {args.warmup} "
                     "at least 0")
    known = families(args.tiny)
    unknown = sorted(set(args.families) - set(known))
    if unknown:
        parser.error(f"--families {' '.join(unknown)}: not one of {', '.join(known)}")
    results: dict[str, Any] = {}
    for name in args.families:
        args.family = name
        paths = {kind: args.out / f"{name}_{kind}.json"
                 for kind in ("profile", "measured", "remeasured", "validation")}
        if args.phase in ("all", "profile"):
            load = os.getloadavg()
            started = time.monotonic()
            run = json.loads(spawn(profile_worker, K, None, args, setup=setup_process,
                                   pg_timeout_s=300, timeout_s=None)[0])
            write_json(paths["profile"], {"family": name, "config": _config(args),
                                          "provenance": provenance(load),
                                          "seconds": time.monotonic() - started, **run})
        for phase, kind in (("measure", "measured"), ("remeasure", "remeasured")):
            if args.phase not in ("all", phase):
                continue
            profile = json.loads(paths["profile"].read_text())
            load = os.getloadavg()
            started = time.monotonic()
            run = json.loads(spawn(measure_worker, K, None, args, profile["balance"],
                                   setup=setup_process, pg_timeout_s=300, timeout_s=None)[0])
            write_json(paths[kind], {"family": name, "config": _config(args),
                                     "balance": profile["balance"],
                                     "provenance": provenance(load),
                                     "seconds": time.monotonic() - started, **run})
        profile = json.loads(paths["profile"].read_text())
        measured = json.loads(paths["measured"].read_text())
        remeasured = (json.loads(paths["remeasured"].read_text())
                      if paths["remeasured"].exists() else None)
        if remeasured is not None and remeasured["provenance"]["utc"] < measured["provenance"]["utc"]:
            remeasured = None  # from an earlier run: not launch 3 of this one
        report = compare(profile, measured, remeasured)
        report.update(family=name, balance=profile["balance"],
                      profile_provenance=profile["provenance"],
                      measured_provenance=measured["provenance"],
                      remeasured_provenance=None if remeasured is None
                      else remeasured["provenance"],
                      command="python scripts/validate_simulator.py " + " ".join(
                          argv if argv is not None else sys.argv[1:]))
        write_json(paths["validation"], report)
        print_report(name, report)
        results[name] = report
    del args.family
    return results


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k != "family"}


if __name__ == "__main__":
    main()
