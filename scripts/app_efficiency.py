"""The apps' own pipelines: efficiency at K=2 against GPipe's bubble, balance, re-materialization.

Reads what ``reproduce_throughput.py --families nmt_app amoebanet_app`` measured (the apps'
CPU defaults, ``--tag`` per balance) and prints, per app, M and balance, for the apps' default
schedule (fill-drain) without and with re-materialization:

- speedup over the plain module in one process (same rounds), and efficiency = speedup / K
  beside the bubble-limited ideal M / (M + K - 1), i.e. 1 - (K-1)/(M+K-1);
- each rank's compute and wait per step (the runtime's timeline), which says whether the
  stages are balanced;
- re-materialization (``except_last``): its time overhead and the peak tensor memory per rank
  it saves.

Writes ``app_efficiency.json`` beside the first input: its own provenance, each input's
(the measurement: commit, CPU, load), and the rows.

    python scripts/app_efficiency.py docs/reproduction/throughput_apps_params.json \\
        docs/reproduction/throughput_apps_time.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from scripts.harness import provenance, write_json

K = 2


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    balance_rule = report["config"].get("balance", "time")
    for name, result in report["families"].items():
        plain = {int(m): s for m, s in result["plain_seconds"].items()}
        by_key = {(r["M"], r["schedule"], r["checkpoint"]): r for r in result["rows"]}
        for m in sorted(plain):
            never = by_key.get((m, "gpipe", "never"))
            remat = by_key.get((m, "gpipe", "except_last"))
            if never is None:
                continue
            speedup = plain[m] / never["seconds"]
            row: dict[str, Any] = {
                "app": name, "balance_rule": balance_rule, "balance": result["balance"], "M": m,
                "plain_seconds": plain[m], "pipeline_seconds": never["seconds"],
                "speedup": speedup, "efficiency": speedup / K, "bubble_ideal": m / (m + K - 1),
                "compute_per_rank": never["compute_per_step"],
                "wait_per_rank": never["wait_per_step"],
                "memory_mb_per_rank": never["step_memory_mb_per_rank"],
            }
            if remat is not None:
                row.update(
                    remat_seconds=remat["seconds"],
                    remat_overhead=remat["seconds"] / never["seconds"] - 1,
                    remat_memory_mb_per_rank=remat["step_memory_mb_per_rank"],
                    remat_memory_saved=[1 - a / b for a, b in zip(
                        remat["step_memory_mb_per_rank"], never["step_memory_mb_per_rank"],
                        strict=True)])
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args()
    reports = {str(path): json.loads(path.read_text()) for path in args.results}
    rows = [row for report in reports.values() for row in summarize(report)]
    print(f"{'app':<14}{'balance':<16}{'M':>3}{'plain s':>9}{'pipe s':>8}{'speedup':>8}"
          f"{'eff.':>6}{'ideal':>6}{'compute/rank s':>16}{'wait/rank s':>13}"
          f"{'remat +time':>12}{'remat mem saved':>17}")
    for r in rows:
        compute = "/".join(f"{v:.3f}" for v in r["compute_per_rank"])
        wait = "/".join(f"{v:.3f}" for v in r["wait_per_rank"])
        saved = "/".join(f"{v:.0%}" for v in r.get("remat_memory_saved", []))
        label = f"{r['balance_rule']} {r['balance']}"
        print(f"{r['app']:<14}{label:<16}{r['M']:>3}{r['plain_seconds']:>9.3f}"
              f"{r['pipeline_seconds']:>8.3f}{r['speedup']:>8.2f}{r['efficiency']:>6.0%}"
              f"{r['bubble_ideal']:>6.0%}{compute:>16}{wait:>13}"
              f"{r.get('remat_overhead', float('nan')):>12.0%}{saved:>17}")
    out = args.results[0].with_name("app_efficiency.json")
    write_json(out, {"provenance": provenance(),
                     "inputs": {path: report.get("provenance") for path, report in reports.items()},
                     "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
