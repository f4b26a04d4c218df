"""Table 1 at CPU scale: the largest model whose training step fits a per-process memory budget.

For each model family (AmoebaNet-D grown in (L, D), the Transformer grown in depth; see
``scripts/reproduction.py``) and each configuration of the paper's columns:

- ``naive-1``: the plain module, whole mini-batch;
- ``pipeline-1``: ``gp.GPipe`` with one partition on one device, re-materialization
  (``--checkpoint``, default ``always``) and M micro-batches;
- ``pipeline-K``: ``gp.DistributedGPipe`` on K gloo processes, every one under the budget;

the script searches the family's size ladder for the largest model that runs two full training
steps (forward, backward, optimiser step: RMSProp for AmoebaNet, Adam for the Transformer) with
every process's memory under the budget. Two steps, because the optimiser's state is allocated
in the first and held through the second's activations.

What counts against the budget is the process's *peak resident memory above its baseline*: the
resident size just before the model is materialized (Python, torch, gloo and the meta model:
756-782 MB here in docs/reproduction/memory.json's trials, the analogue of an accelerator's runtime context, which the paper's 8 and 16 GB do
not count either), reset with ``malloc_trim`` and ``/proc/self/clear_refs``; the peak is
``VmHWM`` after the steps. Every trial runs in fresh processes (spawned interpreters), so no
earlier trial's memory is counted, and models are built on ``meta``: a pipeline rank
materializes only its own partition. A watchdog thread stops a trial as soon as a process goes
over the budget, so the search never holds much more than the budget per process.

The search assumes that memory grows along the ladder (each entry grows L or D of the last):
it starts at the previous column's answer, gallops up (or down) by doubling strides and
bisects; every trial is recorded. Per cell it reports parameters, parameter memory (weights,
gradients and optimiser state, measured), peak activation memory (the rest of the peak above
the baseline: activations, recomputation, messages, allocator slack), each summed over
processes as the paper's columns are, and the parameter ratio to naive-1 beside the paper's.

    python scripts/reproduce_memory.py [--budget-mb 512 --stages 2 4 --chunks 8]
    python scripts/reproduce_memory.py --tiny --out /tmp/memory   # seconds, for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import gpipe_core as gp
from gpipe_core.launch import start, stop
from gpipe_core.partition import optimal_balance
from scripts.harness import pyplot, reset_peak_rss, rss_mb, save_figure, write_json
from scripts.reproduction import FAMILIES, TINY_FAMILIES, Family, layer_sizes

MB = 2**20
STEPS = 2  # the optimiser's state exists from the first step on; the second holds it all

# The paper's Table 1 (../shared/PAPER.md): largest model per column and its parameters.
PAPER = {
    "amoebanet": {"naive-1": ("(18,208)", 82e6), "pipeline-1": ("(18,416)", 318e6),
                  "pipeline-2": ("(18,544)", 542e6), "pipeline-4": ("(36,544)", 1.05e9),
                  "pipeline-8": ("(72,512)", 1.8e9)},
    "transformer": {"naive-1": ("3 layers", 282.2e6), "pipeline-1": ("13 layers", 785.8e6),
                    "pipeline-8": ("103 layers", 5.3e9), "pipeline-32": ("415 layers", 21.0e9),
                    "pipeline-128": ("1663 layers", 83.9e9)},
}


@dataclass
class Trial:
    """One size in one configuration: did every process stay under the budget?"""

    family: str
    index: int
    size: dict[str, int]
    column: str
    fits: bool
    seconds: float
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per process, see _measure
    reason: str = ""  # why it does not fit


# --- one trial, in fresh processes ----------------------------------------------------------


def _memory_balance(family: Family, model: torch.nn.Sequential, inputs: Any, stages: int,
                    chunks: int, checkpoint: str) -> list[int]:
    """Layers per rank minimising the largest rank's predicted memory (meta sizes, no data).

    A rank holds its parameters four times (weights, gradients, two optimiser states), its
    input per micro-batch, and, re-materialized, one micro-batch's saved activations.
    """
    sizes = layer_sizes(model, inputs)
    kept = [s / chunks if checkpoint != "never" else s for s in sizes.saved]
    costs = [4 * p + k + i for p, k, i in zip(sizes.params, kept, sizes.inputs, strict=True)]
    return list(optimal_balance(costs, stages))


def _watch(rank: int, root: str, baseline_mb: float, budget_mb: float,
           stop: threading.Event) -> None:
    """End this process as soon as its resident memory passes the budget, saying so."""
    while not stop.wait(0.005):
        now = rss_mb("VmRSS")
        if now is not None and now - baseline_mb > budget_mb:
            result = {"rank": rank, "fits": False,
                      "reason": f"stopped at {now - baseline_mb:.0f} MB above baseline"}
            Path(root, f"rank-{rank}.json").write_text(json.dumps(result))
            os._exit(0)


def _warm_up(family: Family) -> None:
    """One training step of the family's smallest model on two samples, then free it.

    The runtime allocates some memory once per process on its first step (autograd's worker
    state, kernel caches, thread pools: 20-40 MB here); doing that before the baseline keeps it
    out of every model's count, as an accelerator's runtime context is out of the paper's.
    """
    model = gp.materialize(family.build(family.ladder[0]), seed=0)
    optimizer = family.optimizer(list(model.parameters()))
    inputs, targets = family.batch(2)
    family.loss_fn(model(inputs), targets).backward()
    optimizer.step()
    del model, optimizer


def _trial_worker(rank: int, world_size: int, spec: dict[str, Any], root: str) -> None:
    """One rank of a trial (gpipe_core.launch, a process group when ``distributed(spec)``)."""
    families = TINY_FAMILIES if spec["tiny"] else FAMILIES
    family = families[spec["family"]]
    distributed = _distributed(spec)
    result: dict[str, Any] = {"rank": rank}
    try:
        model = family.build(spec["size"])
        inputs, targets = family.batch(family.batch_size)
        balance = None
        if distributed:
            balance = _memory_balance(family, model, inputs, world_size, spec["chunks"],
                                      spec["checkpoint"])
        _warm_up(family)
        reset_peak_rss()
        baseline = rss_mb("VmRSS")
        assert baseline is not None
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, daemon=True,
                                   args=(rank, root, baseline, spec["budget"] / MB, stop))
        watcher.start()
        result.update(_measure(spec, family, model, inputs, targets, balance))
        stop.set()
        watcher.join()
        peak = rss_mb("VmHWM")
        assert peak is not None
        result.update(baseline_mb=baseline, peak_mb=peak, above_baseline_mb=peak - baseline,
                      balance=balance)
        result["activation_mb"] = result["above_baseline_mb"] - result["parameter_memory_mb"]
        result["fits"] = (peak - baseline) * MB <= spec["budget"]
    except Exception:  # noqa: BLE001 -- recorded, the parent raises with it
        result.update(fits=False, error=traceback.format_exc())
    Path(root, f"rank-{rank}.json").write_text(json.dumps(result))
    # Other ranks of a trial stopped for memory may wait on this one: the parent ends them.
    os._exit(0)


def _measure(spec: dict[str, Any], family: Family, model: torch.nn.Sequential, inputs: Any,
             targets: Any, balance: list[int] | None) -> dict[str, Any]:
    """Materialize this process's share, run the training steps, count what it holds."""
    column = spec["column"]
    if column == "naive-1":
        net: torch.nn.Module = gp.materialize(model, seed=0)
    elif column == "pipeline-1":
        net = gp.GPipe(gp.materialize(model, seed=0), [len(model)], chunks=spec["chunks"],
                       checkpoint=spec["checkpoint"])
    else:
        assert balance is not None
        net = gp.DistributedGPipe(model, balance, chunks=spec["chunks"],
                                  checkpoint=spec["checkpoint"], loss_fn=family.loss_fn, seed=0)
    params = list(net.parameters())
    optimizer = family.optimizer(params)
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        if isinstance(net, gp.DistributedGPipe):
            net.step(inputs if net.is_first else None, targets if net.is_last else None)
        else:
            family.loss_fn(net(inputs), targets).backward()
        optimizer.step()
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                for v in s.values() if isinstance(v, torch.Tensor))
    return {"parameters": sum(p.numel() for p in params),
            "parameter_memory_mb": (weights + grads + state) / MB}


def _distributed(spec: dict[str, Any]) -> bool:
    return bool(spec["column"].startswith("pipeline-") and spec["stages"] > 1)


def run_trial(family: Family, index: int, column: str, args: argparse.Namespace) -> Trial:
    """Run one size in fresh processes; end them all once one reports going over budget."""
    stages = int(column.split("-")[1]) if column.startswith("pipeline-") else 1
    spec = {"family": family.name, "size": family.ladder[index], "column": column,
            "stages": stages, "chunks": args.chunks, "checkpoint": args.checkpoint,
            "budget": args.budget_mb * MB, "tiny": args.tiny}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        context = start(_trial_worker, stages, root, spec, root, pg_timeout_s=120,
                        process_group=_distributed(spec))
        deadline = began + args.trial_timeout
        results: dict[int, dict[str, Any]] = {}
        while len(results) < stages and time.monotonic() < deadline:
            for rank in range(stages):
                path = Path(root, f"rank-{rank}.json")
                if rank not in results and path.exists():
                    try:
                        results[rank] = json.loads(path.read_text())
                    except json.JSONDecodeError:
                        continue  # still being written
            if any(not r["fits"] for r in results.values()):
                break
            if all(not p.is_alive() for p in context.processes) and len(results) < stages:
                time.sleep(0.2)  # a last file may land after its process ends
                if all(not Path(root, f"rank-{r}.json").exists() for r in range(stages)
                       if r not in results):
                    break
            time.sleep(0.05)
        stop(context)
    seconds = time.monotonic() - began
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"trial {family.name} {family.describe(spec['size'])} {column} "
                           f"failed:\n{errors[0]}")
    if len(results) < stages and not any(not r["fits"] for r in results.values()):
        raise RuntimeError(
            f"trial {family.name} {family.describe(spec['size'])} {column}: only "
            f"{len(results)} of {stages} processes reported within {args.trial_timeout} s; "
            "raise --trial-timeout")
    ranks = [results[r] for r in sorted(results)]
    fits = len(ranks) == stages and all(r["fits"] for r in ranks)
    reason = "" if fits else next((r.get("reason") or "over budget at its peak"
                                   for r in ranks if not r["fits"]), "")
    return Trial(family.name, index, family.ladder[index], column, fits, seconds, ranks, reason)


# --- the search -----------------------------------------------------------------------------


def largest_fitting(family: Family, column: str, start: int, args: argparse.Namespace,
                    log: list[Trial]) -> int:
    """Largest ladder index that fits (-1 if none), starting the search at ``start``."""
    known: dict[int, bool] = {}

    def fits(index: int) -> bool:
        if index not in known:
            trial = run_trial(family, index, column, args)
            known[index] = trial.fits
            log.append(trial)
            peak = max((r.get("above_baseline_mb", float("nan")) for r in trial.ranks),
                       default=float("nan"))
            print(f"  {column:<11} {family.describe(trial.size):<14} "
                  f"{'fits' if trial.fits else 'over':<5} peak above baseline "
                  f"{peak:7.1f} MB  ({trial.seconds:.1f} s){'' if trial.fits else ' ' + trial.reason}",
                  flush=True)
        return known[index]

    top = len(family.ladder) - 1
    start = min(max(start, 0), top)
    if fits(start):
        lo, stride = start, 1  # lo fits; gallop up until something does not
        while lo + stride <= top and fits(lo + stride):
            lo, stride = lo + stride, stride * 2
        hi = min(lo + stride, top + 1)  # does not fit (or past the ladder)
    else:
        hi, stride = start, 1  # hi does not fit; gallop down until something does
        while hi - stride >= 0 and not fits(hi - stride):
            hi, stride = hi - stride, stride * 2
        lo = hi - stride if hi - stride >= 0 else -1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def summarize(family: Family, column: str, index: int, log: list[Trial]) -> dict[str, Any]:
    if index < 0:
        return {"column": column, "fits": False}
    trial = next(t for t in log if t.column == column and t.index == index and t.fits)
    ranks = trial.ranks
    return {
        "column": column, "fits": True, "index": index, "size": trial.size,
        "parameters": sum(r["parameters"] for r in ranks),
        "parameter_memory_mb": sum(r["parameter_memory_mb"] for r in ranks),
        "activation_mb": sum(r["activation_mb"] for r in ranks),
        "max_rank_above_baseline_mb": max(r["above_baseline_mb"] for r in ranks),
        "max_rank_peak_mb": max(r["peak_mb"] for r in ranks),
        "baseline_mb": max(r["baseline_mb"] for r in ranks),
        "balance": ranks[0].get("balance"),
        "next_size_over_budget": index + 1 >= len(family.ladder) or any(
            t.column == column and t.index == index + 1 and not t.fits for t in log),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=512.0,
                        help="per-process peak resident memory above the baseline, MB")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8],
                        help="pipeline-K columns run with DistributedGPipe")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches M of the pipelines")
    parser.add_argument("--checkpoint", default="always",
                        help="re-materialization of the pipeline columns")
    parser.add_argument("--families", nargs="+", default=["amoebanet", "transformer"])
    parser.add_argument("--trial-timeout", type=float, default=600.0, help="seconds per trial")
    parser.add_argument("--tiny", action="store_true", help="tiny ladders for the tests")
    parser.add_argument("--out", default="docs/reproduction")
    args = parser.parse_args()
    if args.checkpoint not in ("always", "except_last", "never"):
        parser.error(f"--checkpoint {args.checkpoint!r} is not one of always, except_last, never")
    families = TINY_FAMILIES if args.tiny else FAMILIES
    columns = ["naive-1", "pipeline-1"] + [f"pipeline-{k}" for k in args.stages]
    started = time.monotonic()
    report: dict[str, Any] = {"config": vars(args), "families": {}}
    for name in args.families:
        family = families[name]
        print(f"{name}: batch {family.batch_size}, budget {args.budget_mb:.0f} MB/process "
              f"above baseline, M={args.chunks}, checkpoint={args.checkpoint}", flush=True)
        log: list[Trial] = []
        cells, start = [], 0
        for column in columns:
            index = largest_fitting(family, column, start, args, log)
            cells.append(summarize(family, column, index, log))
            start = max(index, 0)
        naive = cells[0].get("parameters")
        for cell in cells:
            if cell["fits"] and naive:
                cell["ratio_to_naive"] = cell["parameters"] / naive
            paper = PAPER[name].get(cell["column"])
            if paper is not None:
                cell["paper_size"], cell["paper_parameters"] = paper
                cell["paper_ratio_to_naive"] = paper[1] / PAPER[name]["naive-1"][1]
        report["families"][name] = {"batch_size": family.batch_size, "cells": cells,
                                    "trials": [asdict(t) for t in log]}
    report["wall_seconds"] = time.monotonic() - started
    out = Path(args.out)
    write_json(out / "memory.json", report)
    print_table(report)
    plot(report, out / "memory.png")
    print(f"wrote {out}/memory.json and memory.png ({report['wall_seconds']:.0f} s)")


def print_table(report: dict[str, Any]) -> None:
    for name, result in report["families"].items():
        print(f"\n{name} (budget {report['config']['budget_mb']:.0f} MB per process)")
        print(f"{'column':<12}{'size':<14}{'params':>12}{'param MB':>10}{'act. MB':>9}"
              f"{'ratio':>7}{'paper':>7}")
        for c in result["cells"]:
            if not c["fits"]:
                print(f"{c['column']:<12}nothing fits")
                continue
            size = ",".join(str(v) for v in c["size"].values())
            paper = c.get("paper_ratio_to_naive")
            print(f"{c['column']:<12}{size:<14}{c['parameters']:>12,}"
                  f"{c['parameter_memory_mb']:>10.1f}{c['activation_mb']:>9.1f}"
                  f"{c.get('ratio_to_naive', float('nan')):>7.2f}"
                  f"{paper if paper is not None else float('nan'):>7.2f}")


def plot(report: dict[str, Any], path: Path) -> None:
    names = list(report["families"])
    fig, axes = pyplot().subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        cells = [c for c in report["families"][name]["cells"] if c["fits"]]
        labels = [c["column"] for c in cells]
        ax.bar(labels, [c["parameters"] / 1e6 for c in cells], color="tab:blue",
               label="measured (this machine)")
        for i, c in enumerate(cells):
            ax.text(i, c["parameters"] / 1e6, f"{c.get('ratio_to_naive', 1):.1f}x",
                    ha="center", va="bottom", fontsize=8)
            if "paper_ratio_to_naive" in c:
                ax.plot(i, c["paper_ratio_to_naive"] * cells[0]["parameters"] / 1e6, "r_",
                        markersize=20, label="paper's ratio x our naive-1" if i == 0 else None)
        ax.set_ylabel("largest model, M parameters")
        ax.set_title(f"{name}: {report['config']['budget_mb']:.0f} MB per process")
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
