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
   them, with the other core busy as it is in the pipeline, minus the waiting.
2. **Measure** (``<out>/<family>_measured.json``), a new launch: ``gp.DistributedGPipe`` with
   the profile's balance for every configuration, round-robin (one step of each per round, so
   that changes in the machine's load touch all alike); a step lasts as long as its slowest
   rank; the per-round samples are kept.
3. **Report** (``<out>/<family>_validation.json``): per configuration, ``gp.simulate`` on the
   profile (with the fitted transfer of the boundary's payload) against the measured median:
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
from gpipe_core.remat import checkpoint_stop
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
    if rank != 0:
        return None
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


def measure_worker(rank: int, world_size: int, args: argparse.Namespace,
                   balance: list[int]) -> str | None:
    """Launch 2: every configuration's step time, round-robin, with the profile's balance."""
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
    actions: dict[tuple[str, str, int], list[Any]] = {}
    for key, pipe in pipes.items():  # each rank's actions as they ran in the pipeline
        gathered: list[Any] = [None] * K
        dist.all_gather_object(gathered, in_pipeline_costs(pipe.timeline, key[1], key[2],
                                                            args.rounds))
        actions[key] = gathered
    if rank != 0:
        return None
    return json.dumps({"rows": [{"schedule": s, "checkpoint": c, "M": m,
                                 "seconds": statistics.median(v), "samples": v,
                                 "in_pipeline_action_seconds": actions[(s, c, m)]}
                                for (s, c, m), v in samples.items()]})


def in_pipeline_costs(events: list[Any], checkpoint: str, m: int, rounds: int
                      ) -> dict[str, float]:
    """Mean seconds per action kind of this rank's stage as the pipeline ran them: from an
    action's input arriving to its end (``TimelineEvent.ready`` to ``end``), the quantity a
    replay times (``_remat``: re-materialized micro-batches); and ``wait_per_step``, the
    seconds per step the rank spent waiting for a neighbour."""
    stop = checkpoint_stop(checkpoint, m)
    groups: dict[str, list[float]] = {}
    waited = 0.0
    for event in events:
        action = gp.Action.parse(event.action)
        key = action.kind + ("_remat" if action.mb < stop and action.kind != "W" else "")
        ready = event.ready if event.ready is not None else event.start
        groups.setdefault(key, []).append(event.end - ready)
        waited += ready - event.start
    costs = {key: statistics.fmean(values) for key, values in groups.items()}
    costs["wait_per_step"] = waited / rounds
    return costs


# --- the report -----------------------------------------------------------------------------


def predict(profile: dict[str, Any], entry: dict[str, Any]) -> float:
    """``gp.simulate``'s step time for one configuration from its replayed stage costs."""
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
        transfer=[link])
    schedule = gp.get_schedule(entry["schedule"], K, m)
    return gp.simulate(schedule, costs).step_time


def stage_from_actions(costs: dict[str, float]) -> dict[str, Any]:
    """A stage's costs for :func:`predict` from the actions it ran in the pipeline
    (:func:`in_pipeline_costs`), mapped as ``gp.profile_stages`` maps a replay's."""
    split = "I" in costs or "I_remat" in costs
    fused = "I" if split else "B"
    b, b_remat = costs.get(fused), costs.get(fused + "_remat")
    f, f_remat = costs.get("F"), costs.get("F_remat")
    forward = f if f is not None else f_remat
    backward = b if b is not None else b_remat
    recompute = (b_remat - b if b is not None and b_remat is not None
                 else 0.0 if b_remat is not None else forward)
    weight = costs.get("W") if split else None
    return {"forward": forward, "forward_no_grad": f_remat if f_remat is not None else forward,
            "backward": backward + (weight or 0.0), "recompute": max(recompute or 0.0, 0.0),
            "backward_input": backward if split else None, "backward_weight": weight}


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


def compare(profile: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Predicted against measured per configuration, per M, normalised to M=1, and the goals."""
    by_key = {(r["schedule"], r["checkpoint"], r["M"]): r for r in measured["rows"]}
    rows = []
    for entry in profile["profiles"]:
        key = (entry["schedule"], entry["checkpoint"], entry["M"])
        if key not in by_key:
            continue
        predicted, actual = predict(profile, entry), by_key[key]["seconds"]
        row = {"schedule": key[0], "checkpoint": key[1], "M": key[2], "measured_s": actual,
               "predicted_s": predicted, "error": predicted / actual - 1,
               "measured_samples": by_key[key]["samples"]}
        ran = by_key[key].get("in_pipeline_action_seconds")
        if ran:  # the error split: the actions' costs against the replay's, and the schedule
            stages = [stage_from_actions(costs) for costs in ran]
            in_situ = predict(profile, {**entry, "stages": stages})
            row.update(in_situ_predicted_s=in_situ, in_situ_error=in_situ / actual - 1,
                       in_pipeline_over_replay=[
                           {kind: st[kind] / mine[kind] for kind in ("forward", "backward")
                            if st[kind] and mine[kind]}
                           for st, mine in zip(stages, entry["stages"], strict=True)],
                       wait_per_step=[costs["wait_per_step"] for costs in ran])
        rows.append(row)
    for row in rows:  # throughput at M over throughput at M=1, same schedule and mode
        base = next((r for r in rows if (r["schedule"], r["checkpoint"], r["M"]) ==
                     (row["schedule"], row["checkpoint"], 1)), None)
        if base is None:
            row["normalised_measured"] = row["normalised_predicted"] = None
            row["normalised_error"] = None
            continue
        row["normalised_measured"] = base["measured_s"] / row["measured_s"]
        row["normalised_predicted"] = base["predicted_s"] / row["predicted_s"]
        row["normalised_error"] = row["normalised_predicted"] / row["normalised_measured"] - 1
    per_m = {}
    for m in sorted({r["M"] for r in rows}):
        errors = [r["error"] for r in rows if r["M"] == m]
        per_m[str(m)] = {"median_error": statistics.median(errors),
                         "too_fast": sum(e < 0 for e in errors),
                         "too_slow": sum(e > 0 for e in errors)}
    errors = [abs(r["error"]) for r in rows]
    tau = kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    in_situ = [abs(r["in_situ_error"]) for r in rows if "in_situ_error" in r]
    summary = {
        "configurations": len(rows),
        "in_situ_median_abs_error": statistics.median(in_situ) if in_situ else None,
        "median_abs_error": statistics.median(errors) if errors else None,
        "worst_abs_error": max(errors) if errors else None,
        "kendall_tau": tau,
        "one_sign_at_some_M": any(v["too_fast"] == 0 or v["too_slow"] == 0
                                  for v in per_m.values() if v["too_fast"] + v["too_slow"] > 1),
    }
    summary["goals_met"] = bool(
        errors and summary["median_abs_error"] <= GOALS["median_abs_error"]
        and summary["worst_abs_error"] <= GOALS["worst_abs_error"]
        and tau >= GOALS["kendall_tau"] and not summary["one_sign_at_some_M"])
    return {"rows": rows, "per_M": per_m, "summary": summary, "goals": GOALS}


def print_report(name: str, report: dict[str, Any]) -> None:
    print(f"{name}: predicted (profile launch) against measured (measure launch)")
    print(f"{'M':>3} {'schedule':<8}{'ckpt':<12}{'measured':>9}{'predicted':>10}{'err':>7}"
          f"{'norm. meas.':>12}{'pred.':>7}{'err':>7}")
    for r in report["rows"]:
        norm = ("" if r["normalised_error"] is None else
                f"{r['normalised_measured']:>12.2f}{r['normalised_predicted']:>7.2f}"
                f"{r['normalised_error']:>+7.1%}")
        print(f"{r['M']:>3} {r['schedule']:<8}{r['checkpoint']:<12}{r['measured_s']:>9.4f}"
              f"{r['predicted_s']:>10.4f}{r['error']:>+7.1%}{norm}")
    s = report["summary"]
    if s.get("in_situ_median_abs_error") is not None:
        print(f"  from the actions' own in-pipeline costs (in situ): median |error| "
              f"{s['in_situ_median_abs_error']:.1%}")
    print(f"  median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}, "
          f"Kendall tau {s['kendall_tau']:.2f}, one sign at some M: {s['one_sign_at_some_M']}; "
          f"goals met: {s['goals_met']}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["transformer", "encoder", "amoebanet"])
    parser.add_argument("--phase", choices=["all", "profile", "measure", "report"], default="all")
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
                 for kind in ("profile", "measured", "validation")}
        if args.phase in ("all", "profile"):
            load = os.getloadavg()
            started = time.monotonic()
            run = json.loads(spawn(profile_worker, K, None, args, setup=setup_process,
                                   pg_timeout_s=300, timeout_s=None)[0])
            write_json(paths["profile"], {"family": name, "config": _config(args),
                                          "provenance": provenance(load),
                                          "seconds": time.monotonic() - started, **run})
        if args.phase in ("all", "measure"):
            profile = json.loads(paths["profile"].read_text())
            load = os.getloadavg()
            started = time.monotonic()
            run = json.loads(spawn(measure_worker, K, None, args, profile["balance"],
                                   setup=setup_process, pg_timeout_s=300, timeout_s=None)[0])
            write_json(paths["measured"], {"family": name, "config": _config(args),
                                           "balance": profile["balance"],
                                           "provenance": provenance(load),
                                           "seconds": time.monotonic() - started, **run})
        profile = json.loads(paths["profile"].read_text())
        measured = json.loads(paths["measured"].read_text())
        report = compare(profile, measured)
        report.update(family=name, balance=profile["balance"],
                      profile_provenance=profile["provenance"],
                      measured_provenance=measured["provenance"],
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
