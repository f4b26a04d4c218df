"""``gp.plan``'s choice against the best configuration measured by ``reproduce_throughput.py``.

Reads ``throughput.json`` (no new measurement): for each model, gives ``gp.plan`` the
whole-batch per-layer costs profiled in that run, the meta-device activation, input and
parameter sizes (parameters counted four times: weights, gradients, two optimiser states),
the fitted transfer time and a memory budget, lets it choose among what was measured (K=1 with
M=1, which is the plain module, and K=2 fill-drain with M = 1, 4, 8, 32 and every
re-materialization mode), and compares the measured time of its choice with the fastest
measured configuration; three times: with ``per_action_overhead=0``, with the overhead that
makes the plan's per-micro-batch cost model match the profiled costs of smaller micro-batches
(:func:`fitted_overhead`), and with the costs profiled at each M (``microbatch_costs``).
Writes ``simulator_plan.json`` next to the input.

    python scripts/plan_vs_measured.py [--results docs/reproduction/throughput.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import gpipe_core as gp
from scripts.harness import write_json
from scripts.reproduction import THROUGHPUT_FAMILIES, layer_sizes


def fitted_overhead(result: dict[str, Any], num_stages: int = 2) -> float:
    """Per-action seconds that make ``gp.plan``'s model (whole-batch cost / M + overhead per
    action per stage) add up to the profiled compute of M micro-batches: the median over M."""
    whole = sum(result["costs"]["1"]["forward"]) + sum(result["costs"]["1"]["backward"])
    fits = []
    for m, costs in result["costs"].items():
        if int(m) > 1:
            per_mb = sum(costs["forward"]) + sum(costs["backward"])
            fits.append((int(m) * per_mb - whole) / (2 * int(m) * num_stages))
    fits.sort()
    return max(fits[len(fits) // 2], 0.0) if fits else 0.0


def compare(result: dict[str, Any], budget_bytes: float, overhead: float,
            per_microbatch: bool = False) -> dict[str, Any]:
    family, size = THROUGHPUT_FAMILIES[result["family"]]
    inputs, _ = family.batch(family.batch_size)
    sizes = layer_sizes(family.build(size), inputs)
    costs = result["costs"]["1"]  # whole batch, per layer
    measured = {(2, r["M"], r["checkpoint"]): r["seconds"] for r in result["rows"]
                if r["schedule"] == "gpipe"}
    measured[(1, 1, "never")] = result["plain_seconds"]["1"]
    plans = gp.plan(forward=costs["forward"], backward=costs["backward"],
                    activation_bytes=sizes.saved, input_bytes=sizes.inputs,
                    param_bytes=[4 * p for p in sizes.params], batch_size=family.batch_size,
                    max_stages=2, memory_budget=budget_bytes,
                    transfer=result["transfer_latency_s"], per_action_overhead=overhead,
                    microbatch_costs={int(m): (c["forward"], c["backward"])
                                      for m, c in result["costs"].items()}
                    if per_microbatch else None)
    # Only the plan's configurations that were measured can be checked against measurement.
    candidates = [p for p in plans
                  if (p.num_stages, p.num_microbatches, p.checkpoint) in measured]
    chosen = candidates[0]
    key = (chosen.num_stages, chosen.num_microbatches, chosen.checkpoint)
    best_key = min(measured, key=lambda k: measured[k])
    return {
        "family": result["family"],
        "plan_choice": {"K": key[0], "M": key[1], "checkpoint": key[2],
                        "predicted_seconds": chosen.step_time,
                        "predicted_peak_mb": chosen.peak_bytes / 2**20,
                        "measured_seconds": measured[key]},
        "best_measured": {"K": best_key[0], "M": best_key[1], "checkpoint": best_key[2],
                          "seconds": measured[best_key]},
        "choice_over_best": measured[key] / measured[best_key] - 1,
        "budget_mb": budget_bytes / 2**20,
        "per_action_overhead_s": overhead,
        "microbatch_costs": per_microbatch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="docs/reproduction/throughput.json")
    parser.add_argument("--budget-mb", type=float, default=512.0)
    args = parser.parse_args()
    report = json.loads(Path(args.results).read_text())
    budget = args.budget_mb * 2**20
    rows = [row for result in report["families"].values()
            for row in (compare(result, budget, 0.0),
                        compare(result, budget, fitted_overhead(result)),
                        compare(result, budget, 0.0, per_microbatch=True))]
    for row in rows:
        c, b = row["plan_choice"], row["best_measured"]
        model = ("the profiled cost of each M" if row["microbatch_costs"] else
                 f"whole-batch cost / M + {row['per_action_overhead_s'] * 1e3:.1f} ms per action")
        print(f"{row['family']} ({model}): "
              f"gp.plan chose K={c['K']} M={c['M']} {c['checkpoint']} "
              f"(predicted {c['predicted_seconds']:.3f} s, measured {c['measured_seconds']:.3f} s); "
              f"best measured K={b['K']} M={b['M']} {b['checkpoint']} {b['seconds']:.3f} s: "
              f"choice {row['choice_over_best']:+.0%} over the best")
    out = Path(args.results).with_name("simulator_plan.json")
    write_json(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
