"""Every schedule side by side, in the simulator: step time, bubble and memory per rank.

For ``--ranks`` R and ``--microbatches`` M, each schedule runs the same model: R plain stages'
worth of layers, split into R stages (one per rank) or 2R (two per rank: interleaved 1F1B,
interleaved zero bubble, ZB-V, DualPipeV). A plain stage's forward costs ``--forward`` units,
its backward ``--backward``, of which ``--weight`` is the parameters' part (W); a stage of half
the layers costs half. Prints, per schedule: step time, its bubble (idle share of the ranks'
time), the step against GPipe's ideal (M+R-1)/M of the work and against perfect parallelism,
and the peak activations each rank holds in plain-stage micro-batches (a chunk micro-batch of
a half stage counts 1/2). Writes JSON and one timeline picture per schedule.

    python scripts/compare_schedules.py [--ranks 2 --microbatches 8 --forward 1 --backward 2
                                         --weight 1 --transfer 0 --out docs/schedules]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gpipe_core as gp
from gpipe_core.trace import write_timeline_png
from scripts.harness import write_json

ONE_PER_RANK = ("gpipe", "1f1b", "zb_h1", "zb_h2")
TWO_PER_RANK = ("interleaved_1f1b", "interleaved_zb", "zb_v", "dualpipe_v")


def compare(ranks: int, microbatches: int, forward: float, backward: float, weight: float,
            transfer: float) -> list[dict[str, object]]:
    rows = []
    work = microbatches * (forward + backward)  # per rank, whatever the schedule
    for name in ONE_PER_RANK + TWO_PER_RANK:
        v = 2 if name in TWO_PER_RANK else 1
        stages = v * ranks
        try:
            schedule = gp.get_schedule(name, stages, microbatches, num_ranks=ranks)
        except ValueError as exc:  # DualPipeV needs M >= 2R
            rows.append({"schedule": name, "skipped": str(exc)})
            continue
        sim = gp.simulate(schedule, [forward / v] * stages, [backward / v] * stages,
                          backward_weight=[weight / v] * stages, transfer=transfer)
        rows.append({
            "schedule": name, "stages_per_rank": v, "step_time": sim.step_time,
            "bubble": sim.bubble_fraction,
            "vs_gpipe_ideal": work * (microbatches + ranks - 1) / microbatches / sim.step_time,
            "vs_perfect": work / sim.step_time,
            "peak_microbatches_per_rank": [p / v for p in sim.peak_inflight],
            "events": sim.events, "placement": schedule.placement,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward", type=float, default=1.0)
    parser.add_argument("--backward", type=float, default=2.0)
    parser.add_argument("--weight", type=float, default=1.0,
                        help="the parameters' part of --backward (W)")
    parser.add_argument("--transfer", type=float, default=0.0,
                        help="seconds (units) a message takes between ranks")
    parser.add_argument("--out", default="docs/schedules")
    args = parser.parse_args()
    if not 0 <= args.weight <= args.backward:
        parser.error(f"--weight {args.weight} must lie between 0 and --backward {args.backward}")
    rows = compare(args.ranks, args.microbatches, args.forward, args.backward, args.weight,
                   args.transfer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"r{args.ranks}_m{args.microbatches}"
    print(f"R={args.ranks} ranks, M={args.microbatches}, a plain stage: F={args.forward} "
          f"B={args.backward} (W={args.weight}), transfer {args.transfer}")
    print(f"{'schedule':<18}{'stages/rank':>12}{'step':>8}{'bubble':>8}{'vs ideal':>10}"
          f"{'vs perfect':>12}  peak micro-batches per rank")
    for row in rows:
        if "skipped" in row:
            print(f"{row['schedule']:<18}  skipped: {row['skipped']}")
            continue
        peaks = " / ".join(f"{p:g}" for p in row["peak_microbatches_per_rank"])  # type: ignore[attr-defined]
        print(f"{row['schedule']:<18}{row['stages_per_rank']:>12}{row['step_time']:>8.1f}"
              f"{row['bubble']:>8.1%}{row['vs_gpipe_ideal']:>10.2f}{row['vs_perfect']:>12.2f}"
              f"  {peaks}")
        placement = row.pop("placement")
        write_timeline_png(row.pop("events"), out / f"{tag}_{row['schedule']}.png",  # type: ignore[arg-type]
                           num_stages=args.ranks * int(row["stages_per_rank"]),  # type: ignore[call-overload]
                           placement=placement if row["stages_per_rank"] != 1 else None)  # type: ignore[arg-type]
    write_json(out / f"schedules_{tag}.json", {"config": vars(args), "rows": rows})
    print(f"wrote {out}/schedules_{tag}.json and a timeline per schedule")


if __name__ == "__main__":
    main()
