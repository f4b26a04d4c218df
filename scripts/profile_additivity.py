"""Do per-layer profiles add up to a stage? gp.plan prices a stage as the sum of its layers'
seconds, each layer profiled as a stage of its own (``gp.profile_stages(model, [1] * n)``).
A layer profiled that way runs the runtime's per-action work once per layer, and, on its own
rank, packs its output and unpacks its input as a boundary between two ranks does; gp.plan with
costs and a device then adds each boundary's message compute (``Device.message_cpu_seconds``)
at the boundaries a plan cuts.

For each family (bench_pipeline's workloads at M=8, one thread) this profiles every layer
twice, with its messages packed (``pack_messages=True``, the default) and passed as within a
rank (``False``), and replays the stages of two layouts whole (``gp.profile_stages`` at their
balance, a boundary between ranks packed): gp.plan's 2-stage 1F1B balance and its 4-stage
interleaved 1F1B balance on 2 ranks, both from the unpacked profile. Per stage, the whole
replay's F + B per micro-batch against the sum of its layers' (packed; unpacked; unpacked plus
``CPU_CORE``'s message compute at the stage's boundaries to another rank), medians over
``--repeats``.

Writes ``docs/reproduction/profile_additivity.json`` (``--json``) with provenance.

    python scripts/profile_additivity.py [--families amoebanet_app nmt_app encoder]
                                         [--repeats 2 --rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
from argparse import Namespace
from typing import Any

import torch

import gpipe_core as gp
from apps.planning import CPU_CORE
from scripts.bench_pipeline import parse_args, workload
from scripts.efficiency_bound import FAMILIES, K, M, bench_arguments
from scripts.harness import provenance, write_json

LAYOUTS = ("1f1b", "interleaved_1f1b")  # one and two stages per rank, at K ranks


def stage_rows(family: str, args: Namespace) -> list[dict[str, Any]]:
    """Per layout and stage: the whole stage's replayed seconds and its layers' sums, each a
    median over ``args.repeats`` (one list of samples per field beside it)."""
    config = parse_args([*bench_arguments(family, args, {}), "--out", args.scratch,
                         "--json", os.path.join(args.scratch, "unused.json")])
    work = workload(config)
    model = work.build()
    n = len(model)
    costs = gp.layer_costs(model, work.inputs)
    whole_bytes = costs.scaled(len(work.targets)).output_bytes
    common = dict(loss_fn=work.loss_fn, chunks=M, rounds=args.rounds)
    samples: dict[tuple[str, int], dict[str, list[float]]] = {}
    balances: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        layers = {pack: gp.profile_stages(model, [1] * n, work.inputs, work.targets,
                                          schedule="1f1b", pack_messages=pack,
                                          **common)  # type: ignore[arg-type]
                  for pack in (True, False)}
        for schedule in LAYOUTS:
            if schedule not in balances:  # the first repeat's plan: the same stages after
                balances[schedule] = gp.plan(
                    costs, device=CPU_CORE, batch_size=len(work.targets), stages=[K],
                    microbatches=[M], schedule=schedule, checkpoints=["never"],
                    profiles=[layers[False]])[0].balance
            balance = balances[schedule]
            whole = gp.profile_stages(model, balance, work.inputs, work.targets,
                                      schedule=schedule, num_ranks=K,
                                      **common)  # type: ignore[arg-type]
            placement = gp.get_schedule(schedule, len(balance), M, num_ranks=K).placement
            ends = [sum(balance[:i]) for i in range(len(balance) + 1)]
            for s, (a, b) in enumerate(zip(ends[:-1], ends[1:], strict=True)):
                # each boundary to another rank: a message end in F and one in B
                crossing = [i for i in (s - 1, s) if 0 <= i < len(balance) - 1
                            and placement[i] != placement[i + 1]]
                messages = sum(2 * CPU_CORE.message_cpu_seconds(whole_bytes[ends[i + 1] - 1] / M)
                               for i in crossing)

                def summed(p: gp.StageProfile, a: int = a, b: int = b) -> float:
                    return sum(p.forward[a:b]) + sum(p.backward[a:b])

                row = samples.setdefault((schedule, s), {})
                for field, value in (
                        ("whole", whole.forward[s] + whole.backward[s]),
                        ("layers_packed", summed(layers[True])),
                        ("layers_unpacked", summed(layers[False])),
                        ("layers_unpacked_and_messages", summed(layers[False]) + messages)):
                    row.setdefault(field, []).append(value)
    rows = []
    for (schedule, s), fields in samples.items():
        medians = {field: statistics.median(values) for field, values in fields.items()}
        rows.append({"layout": schedule, "balance": balances[schedule], "stage": s,
                     "layers": balances[schedule][s], **medians,
                     **{f"{field}_over_whole": medians[field] / medians["whole"]
                        for field in medians if field != "whole"},
                     "samples": fields})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean absolute error of each sum against the whole stages, and how many stages the
    unpacked sum with messages priced nearer the whole than the packed sum did."""
    def error(field: str) -> float:
        return statistics.mean(abs(r[f"{field}_over_whole"] - 1) for r in rows)

    return {"mean_abs_error_packed": error("layers_packed"),
            "mean_abs_error_unpacked": error("layers_unpacked"),
            "mean_abs_error_unpacked_and_messages": error("layers_unpacked_and_messages"),
            "stages": len(rows),
            "stages_nearer_unpacked_and_messages": sum(
                abs(r["layers_unpacked_and_messages_over_whole"] - 1)
                < abs(r["layers_packed_over_whole"] - 1) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES,
                        default=["amoebanet_app", "nmt_app", "encoder"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed replays per profile")
    parser.add_argument("--quick", action="store_true", help="tiny models (the tests)")
    parser.add_argument("--scratch", default="/tmp/profile_additivity")
    parser.add_argument("--json", default="docs/reproduction/profile_additivity.json")
    args = parser.parse_args()
    if args.repeats < 1 or args.rounds < 1:
        parser.error(f"--repeats {args.repeats} and --rounds {args.rounds} must be at least 1")
    args.steps, args.order = 1, "fixed"  # bench_arguments' rounds and their order: unused here
    gp.hold_freed_memory()  # as the ranks and efficiency_bound's profiles run
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    families: dict[str, dict[str, Any]] = {}
    for family in args.families:
        rows = stage_rows(family, args)
        families[family] = {"summary": summarize(rows), "stages": rows}
        print(f"{family}:")
        for r in rows:
            print(f"  {r['layout']:16s} {r['balance']} stage {r['stage']}: whole "
                  f"{r['whole'] * 1e3:7.2f} ms; layers packed "
                  f"{r['layers_packed_over_whole']:.3f}, unpacked "
                  f"{r['layers_unpacked_over_whole']:.3f}, unpacked + messages "
                  f"{r['layers_unpacked_and_messages_over_whole']:.3f} of it")
        summary = families[family]["summary"]
        print(f"  mean |error|: packed {summary['mean_abs_error_packed']:.3f}, unpacked + "
              f"messages {summary['mean_abs_error_unpacked_and_messages']:.3f} (nearer in "
              f"{summary['stages_nearer_unpacked_and_messages']} of {summary['stages']} stages)")
    write_json(args.json, {"provenance": provenance(load_before), "config": vars(args),
                           "families": families})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
