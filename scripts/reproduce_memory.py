"""Table 1 at CPU scale: the largest model whose training step fits a per-process memory budget.

For each model family (AmoebaNet-D grown in (L, D), on 32x32 images and, activation-heavy as
the paper's model is, on 56x56 ones; the Transformer grown in depth; see
``scripts/reproduction.py``) and each configuration of the paper's columns:

- ``naive-1``: the plain module, whole mini-batch;
- ``pipeline-1``: ``gp.GPipe`` with one partition on one device, re-materialization
  (``--checkpoint``, default ``always``) and M micro-batches;
- ``pipeline-K``: ``gp.DistributedGPipe`` on K gloo processes, every one under the budget;

the script searches for the largest model that runs two full training steps (forward,
backward, optimiser step: RMSProp for AmoebaNet, Adam for the Transformer) with every
process's memory under the budget. Two steps, because the optimiser's state is allocated in
the first and held through the second's activations.

What counts against the budget is the process's *resident-size peak above its baseline*: the
resident size just before the model is materialized (Python, torch, gloo and the meta model:
about 760-780 MB per process in docs/reproduction/memory.json's ``baseline_mb``, the analogue
of an accelerator's runtime context, which the paper's 8 and 16 GB do not count either),
reset with ``malloc_trim`` and ``/proc/self/clear_refs``; the peak is ``VmHWM`` after the
steps. Every trial runs in fresh processes (spawned interpreters), so no earlier trial's
memory is counted, and models are built on ``meta``: a pipeline rank materializes only its
own partition. A watchdog thread stops a trial as soon as a process goes over the budget, so
the search never holds much more than the budget per process.

The allocator. Resident size depends on glibc's malloc: by default its mmap threshold grows
(up to 32 MB) as large blocks are freed, after which freed activations stay in the heap and
count; one training step measured 761 MB under a fixed threshold and 972 MB under the default
(docs/REPRODUCTION.md, the large-NMT demo). Every trial's processes therefore start with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` at ``--mmap-threshold`` (128 KB,
glibc's initial value; giving it fixes it, which turns the growth off) and
``MALLOC_ARENA_MAX=1`` (every thread, gloo's included, in one heap), set in the environment
the spawned interpreters inherit: glibc reads them when it initialises, before the
interpreter's first allocation, whereas ``mallopt`` at process start would run only after the
spawn bootstrap has imported torch under the default. Each process records the variables it
saw and probes the effect (a freed large block, allocated again, still gets its own mapping);
the settings are in the JSON's ``allocator``.

Beside the resident-size peak every process records its *live-tensor peak*
(``scripts.harness.LiveTensorBytes``, the CPU analogue of ``max_memory_allocated``: bytes of
tensor storage alive at once, everything the trial allocated after the baseline: weights,
gradients, optimiser state, activations, recomputation, messages), the *parameter memory*
measured after the steps (weights + gradients + optimiser state) and the *residual* (resident
peak above baseline minus parameter memory: activations, recomputation, messages, and the
allocator's slack and gloo's buffers, which only the resident size sees).

The search assumes that memory grows along the ladder (each entry grows L or D of the last):
on the family's coarse ladder it starts at the previous column's answer, gallops up (or down)
by doubling strides and bisects; then it bisects the *fine ladder* between that answer and the
next coarse entry, which did not fit (AmoebaNet: D in steps of 16 at the answer's L, or L in
steps of 1 at its D, whichever the coarse step grew; the Transformer: L in steps of 1). Every
trial, coarse and fine, is recorded. A cell is reported as a bracket, [largest size that fits,
smallest that does not], adjacent entries of the fine ladder, with their parameter counts;
every ratio between two columns (in parameters) is reported as the interval the brackets allow,
[fits / does-not-fit, does-not-fit / fits] (:func:`ratio_interval`), beside the point ratio of
the fitting sizes and the paper's. Memory is summed over processes as the paper's columns are.

Where the budget binds (the cell has both ends), ``gp.plan``'s memory prediction is checked
against the fitting trial: per-layer bytes kept for backward are measured on the whole
mini-batch in a fresh process (``scripts.reproduction.layer_memory``), the plan is asked for
the cell's K, M and re-materialization on the trial's balance, and its per-rank peak is set
beside the measured live-tensor and resident-size peaks (:func:`compare_with_plan`).

    python scripts/reproduce_memory.py [--budget-mb 512 --stages 2 4 8 --chunks 8]
    python scripts/reproduce_memory.py --tiny --out /tmp/memory   # seconds, for the tests
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import gpipe_core as gp
from gpipe_core.launch import spawn, start, stop
from gpipe_core.partition import optimal_balance
from scripts.harness import (
    LiveTensorBytes,
    add_draft_argument,
    provenance,
    pyplot,
    refuse_dirty_tree,
    reset_peak_rss,
    rss_mb,
    save_figure,
    set_draft,
    write_json,
)
from scripts.reproduction import (
    FAMILIES,
    TINY_FAMILIES,
    Family,
    LayerSizes,
    Size,
    layer_memory,
    layer_sizes,
)

MB = 2**20
STEPS = 2  # the optimiser's state exists from the first step on; the second holds it all
BYTES_PER_PARAMETER = 4  # in units of the weights: weights, gradients, two optimiser states

# The paper's Table 1 (../shared/PAPER.md): largest model per column and its parameters.
PAPER = {
    "amoebanet": {"naive-1": ("(18,208)", 82e6), "pipeline-1": ("(18,416)", 318e6),
                  "pipeline-2": ("(18,544)", 542e6), "pipeline-4": ("(36,544)", 1.05e9),
                  "pipeline-8": ("(72,512)", 1.8e9)},
    "transformer": {"naive-1": ("3 layers", 282.2e6), "pipeline-1": ("13 layers", 785.8e6),
                    "pipeline-8": ("103 layers", 5.3e9), "pipeline-32": ("415 layers", 21.0e9),
                    "pipeline-128": ("1663 layers", 83.9e9)},
}
PAPER_FAMILY = {"amoebanet_56px": "amoebanet"}  # the paper's model that a family scales down

Interval = tuple[float, float | None]  # [low, high]; high None: unbounded


@dataclass
class Trial:
    """One size in one configuration: did every process stay under the budget?"""

    family: str
    index: int  # position on its ladder
    size: dict[str, int]
    column: str
    fits: bool
    seconds: float
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per process, see _trial_worker
    reason: str = ""  # why it does not fit
    ladder: str = "coarse"  # "coarse": the family's ladder; "fine": the cell's fine ladder


# --- the allocator ---------------------------------------------------------------------------


def allocator_settings(mmap_threshold: int) -> dict[str, str]:
    """glibc's malloc variables every trial process starts with (none for 0: glibc's default)."""
    if not mmap_threshold:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold),
            "MALLOC_TRIM_THRESHOLD_": str(mmap_threshold), "MALLOC_ARENA_MAX": "1"}


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in this process's environment (which spawned interpreters inherit)."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def allocator_state() -> dict[str, Any]:
    """This process's glibc malloc variables, and whether a freed large block leaves the heap.

    The probe frees a block that was mapped on its own and allocates it again: under a fixed
    mmap threshold below its size the second gets its own mapping too (``hblkhd`` grows);
    under glibc's default the free raised the threshold to the block's size and the second
    comes from the heap, where it stays resident when freed. The block is larger than all the
    heap's free memory (``fordblks``), so that no free chunk can serve it, and below glibc's
    32 MB cap on the growing threshold. ``None``: not glibc >= 2.33, or too much free heap.
    """
    state: dict[str, Any] = {"environment": {name: os.environ.get(name) for name in
                                             allocator_settings(1)},
                             "freed_block_unmapped": None}
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return state
    mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = max(mallinfo2().fordblks, 0) + (1 << 20)
    if size >= 32 << 20:
        return state
    libc.free(libc.malloc(size))
    before = mallinfo2().hblkhd
    block = libc.malloc(size)
    state["freed_block_unmapped"] = mallinfo2().hblkhd - before >= size
    state["probe_bytes"] = size
    libc.free(block)
    return state


# --- one trial, in fresh processes ----------------------------------------------------------


def _memory_costs(sizes: LayerSizes, chunks: int, checkpoint: str) -> list[float]:
    """A layer's predicted memory on its rank (meta sizes, no data): its parameters four times
    (weights, gradients, two optimiser states), its input per micro-batch, and, re-materialized,
    one micro-batch's saved activations."""
    kept = [s / chunks if checkpoint != "never" else s for s in sizes.saved]
    return [BYTES_PER_PARAMETER * p + k + i
            for p, k, i in zip(sizes.params, kept, sizes.inputs, strict=True)]


def _memory_balance(family: Family, model: torch.nn.Sequential, inputs: Any, stages: int,
                    chunks: int, checkpoint: str) -> list[int]:
    """Layers per rank minimising the largest rank's predicted memory (:func:`_memory_costs`)."""
    costs = _memory_costs(layer_sizes(model, inputs), chunks, checkpoint)
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


def _family(spec: dict[str, Any]) -> Family:
    return (TINY_FAMILIES if spec["tiny"] else FAMILIES)[spec["family"]]


def _trial_worker(rank: int, world_size: int, spec: dict[str, Any], root: str) -> None:
    """One rank of a trial (gpipe_core.launch, a process group when ``distributed(spec)``)."""
    family = _family(spec)
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
        # Every tensor the trial allocates counts (the batch existed before the baseline).
        tensors = LiveTensorBytes([inputs, targets])
        watcher.start()
        with tensors:
            result.update(_measure(spec, family, model, inputs, targets, balance))
        stop.set()
        watcher.join()
        peak = rss_mb("VmHWM")
        assert peak is not None
        parameter_memory = result["parameter_memory_mb"]
        result.update(
            baseline_mb=baseline, resident_peak_mb=peak,
            resident_peak_above_baseline_mb=peak - baseline,
            live_tensor_peak_mb=tensors.peak / MB,
            residual_mb=peak - baseline - parameter_memory,
            live_tensor_activation_mb=tensors.peak / MB - parameter_memory,
            balance=balance, allocator=allocator_state())
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


def _column_stages(column: str) -> int:
    return int(column.split("-")[1]) if column.startswith("pipeline-") else 1


def run_trial(family: Family, size: Size, index: int, column: str, args: argparse.Namespace,
              ladder: str = "coarse") -> Trial:
    """Run one size in fresh processes; end them all once one reports going over budget."""
    stages = _column_stages(column)
    spec = {"family": family.name, "size": size, "column": column,
            "stages": stages, "chunks": args.chunks, "checkpoint": args.checkpoint,
            "budget": args.budget_mb * MB, "tiny": args.tiny}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        with _environment(allocator_settings(args.mmap_threshold)):
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
        raise RuntimeError(f"trial {family.name} {family.describe(size)} {column} "
                           f"failed:\n{errors[0]}")
    if len(results) < stages and not any(not r["fits"] for r in results.values()):
        raise RuntimeError(
            f"trial {family.name} {family.describe(size)} {column}: only "
            f"{len(results)} of {stages} processes reported within {args.trial_timeout} s; "
            "raise --trial-timeout")
    ranks = [results[r] for r in sorted(results)]
    fits = len(ranks) == stages and all(r["fits"] for r in ranks)
    reason = "" if fits else next((r.get("reason") or "over budget at its peak"
                                   for r in ranks if not r["fits"]), "")
    return Trial(family.name, index, size, column, fits, seconds, ranks, reason, ladder)


# --- the search -----------------------------------------------------------------------------


def largest_fitting(family: Family, sizes: list[Size], column: str, start: int,
                    args: argparse.Namespace, log: list[Trial], *, ladder: str = "coarse",
                    known: dict[int, bool] | None = None) -> int:
    """Largest index of ``sizes`` that fits (-1 if none), starting the search at ``start``.

    ``known``: indices whose answer is known already (not run again).
    """
    known = dict(known or {})

    def fits(index: int) -> bool:
        if index not in known:
            trial = run_trial(family, sizes[index], index, column, args, ladder)
            known[index] = trial.fits
            log.append(trial)
            resident = max((r.get("resident_peak_above_baseline_mb", float("nan"))
                            for r in trial.ranks), default=float("nan"))
            live = max((r.get("live_tensor_peak_mb", float("nan")) for r in trial.ranks),
                       default=float("nan"))
            print(f"  {column:<11} {ladder:<6} {family.describe(trial.size):<14} "
                  f"{'fits' if trial.fits else 'over':<5} resident peak above baseline "
                  f"{resident:7.1f} MB, live tensors {live:7.1f} MB ({trial.seconds:.1f} s)"
                  f"{'' if trial.fits else ' ' + trial.reason}", flush=True)
        return known[index]

    top = len(sizes) - 1
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


def fine_ladder(family: Family, fits: Size, over: Size) -> list[Size]:
    """``fits``, the sizes between it and ``over`` at the family's fine steps, ``over``.

    Adjacent coarse entries differ in one dimension; the fine ladder steps that dimension
    (AmoebaNet: D by 16 at the same L, or L by 1 at the same D), so memory still grows along
    it. A dimension without a fine step leaves the two entries adjacent.
    """
    changed = [name for name in fits if fits[name] != over[name]]
    if len(changed) != 1:
        raise ValueError(f"ladder entries {fits} and {over} differ in {changed}; a ladder "
                         "step grows exactly one dimension")
    name = changed[0]
    step = family.fine_steps.get(name, 0)
    between = [] if step <= 0 else [{**fits, name: value} for value in
                                    range(fits[name] + step, over[name], step)]
    return [dict(fits), *between, dict(over)]


def search_cell(family: Family, column: str, start: int, args: argparse.Namespace,
                log: list[Trial]) -> tuple[int, Size | None, Size | None, list[Size]]:
    """The coarse answer's index, then the bracket on the fine ladder above it:
    (coarse index, largest size that fits, smallest that does not, the fine ladder)."""
    index = largest_fitting(family, family.ladder, column, start, args, log)
    if index < 0:
        return index, None, family.ladder[0], []
    if index == len(family.ladder) - 1:  # the ladder's top fits: no upper end
        return index, family.ladder[index], None, []
    fine = fine_ladder(family, family.ladder[index], family.ladder[index + 1])
    at = largest_fitting(family, fine, column, 0, args, log, ladder="fine",
                         known={0: True, len(fine) - 1: False})
    return index, fine[at], fine[at + 1], fine


def parameter_count(family: Family, size: Size) -> int:
    """Parameters of the family's model at ``size`` (counted on meta, nothing allocated)."""
    return sum(p.numel() for p in family.build(size).parameters())


def summarize(family: Family, column: str, index: int, fits: Size | None, over: Size | None,
              fine: list[Size], log: list[Trial]) -> dict[str, Any]:
    """One cell: its bracket, and the fitting trial's memory, labelled for what it is."""
    bracket = {"fits": None if fits is None else
               {"size": fits, "parameters": parameter_count(family, fits)},
               "does_not_fit": None if over is None else
               {"size": over, "parameters": parameter_count(family, over)}}
    if fits is None:
        return {"column": column, "fits": False, "bracket": bracket}
    trial = next(t for t in log if t.column == column and t.size == fits and t.fits)
    ranks = trial.ranks
    return {
        "column": column, "fits": True, "index": index, "size": fits, "bracket": bracket,
        "fine_ladder": fine,
        "parameters": sum(r["parameters"] for r in ranks),
        # all processes summed, as the paper's columns are
        "parameter_memory_mb": sum(r["parameter_memory_mb"] for r in ranks),
        "residual_mb": sum(r["residual_mb"] for r in ranks),
        "live_tensor_activation_mb": sum(r["live_tensor_activation_mb"] for r in ranks),
        # the largest process
        "max_rank_resident_peak_above_baseline_mb": max(
            r["resident_peak_above_baseline_mb"] for r in ranks),
        "max_rank_live_tensor_peak_mb": max(r["live_tensor_peak_mb"] for r in ranks),
        "max_rank_resident_peak_mb": max(r["resident_peak_mb"] for r in ranks),
        "baseline_mb": max(r["baseline_mb"] for r in ranks),
        "balance": ranks[0].get("balance"),
        "next_size_over_budget": index + 1 >= len(family.ladder) or any(
            t.column == column and t.ladder == "coarse" and t.index == index + 1 and not t.fits
            for t in log),
    }


# --- ratios between columns, as intervals ---------------------------------------------------


def ratio_interval(numerator: tuple[float, float | None],
                   denominator: tuple[float, float | None]) -> Interval:
    """The ratio of two cells' largest fitting sizes, bounded by their brackets.

    Each argument is a cell's (largest that fits, smallest that does not; None: unknown). The
    largest fitting size lies in [fits, does-not-fit), so the ratio lies in
    [fits_a / does-not-fit_b, does-not-fit_a / fits_b] (high None: unbounded).
    """
    top_fits, top_over = numerator
    bottom_fits, bottom_over = denominator
    if top_fits <= 0 or bottom_fits <= 0:
        raise ValueError(f"sizes must be positive: numerator {numerator}, denominator "
                         f"{denominator}")
    low = top_fits / bottom_over if bottom_over is not None else 0.0
    high = top_over / bottom_fits if top_over is not None else None
    return low, high


def ratio_intervals(cells: list[dict[str, Any]]) -> dict[str, Interval]:
    """``"b / a": [low, high]`` in parameters for every column b after a (both fitting)."""
    ends = {c["column"]: (c["bracket"]["fits"]["parameters"],
                          None if c["bracket"]["does_not_fit"] is None
                          else c["bracket"]["does_not_fit"]["parameters"])
            for c in cells if c["fits"]}
    names = [c["column"] for c in cells if c["fits"]]
    return {f"{b} / {a}": ratio_interval(ends[b], ends[a])
            for i, a in enumerate(names) for b in names[i + 1:]}


# --- gp.plan's memory prediction against the measured cells ---------------------------------


def _column_plan(column: str, chunks: int, checkpoint: str) -> tuple[int, int, str]:
    """(K, M, re-materialization) of a column: naive-1 is one stage, one batch, nothing rebuilt."""
    if column == "naive-1":
        return 1, 1, "never"
    return _column_stages(column), chunks, checkpoint


def predicted_rank_bytes(*, activation_bytes: list[float], input_bytes: list[float],
                         param_bytes: list[float], balance_costs: list[float], stages: int,
                         chunks: int, checkpoint: str, batch_size: int
                         ) -> tuple[list[int], list[float]]:
    """``gp.plan``'s balance and per-rank peak bytes (parameter memory + kept activations) for
    one configuration, on the per-layer bytes given (whole mini-batch).

    ``gp.plan`` balances layers by their forward + backward cost; given ``balance_costs`` as
    the forward and no backward it balances as the trial did, so prediction and measurement
    concern the same partition. The budget is left open: this asks for a prediction, not a
    choice.
    """
    best = gp.plan(forward=balance_costs, backward=[0.0] * len(balance_costs),
                   activation_bytes=activation_bytes, input_bytes=input_bytes,
                   param_bytes=param_bytes, batch_size=batch_size, stages=[stages],
                   microbatches=[chunks], checkpoints=[checkpoint],
                   memory_budget=float("inf"))[0]
    return best.balance, [h + a for h, a in zip(best.param_bytes, best.activation_bytes,
                                                strict=True)]


def compare_with_plan(predicted_bytes: list[float], ranks: list[dict[str, Any]],
                      budget_mb: float) -> dict[str, Any]:
    """Predicted against measured peak, per rank and for the largest rank: the live-tensor
    peak (what the plan models: tensors) and the resident-size peak above baseline (what the
    budget counts); errors as predicted / measured - 1."""
    predicted = [b / MB for b in predicted_bytes]
    live = [r["live_tensor_peak_mb"] for r in ranks]
    resident = [r["resident_peak_above_baseline_mb"] for r in ranks]
    if len(predicted) != len(ranks):
        raise ValueError(f"{len(predicted)} predicted ranks for {len(ranks)} measured")
    return {
        "predicted_rank_peak_mb": predicted,
        "measured_rank_live_tensor_peak_mb": live,
        "measured_rank_resident_peak_above_baseline_mb": resident,
        "predicted_peak_mb": max(predicted),
        "measured_live_tensor_peak_mb": max(live),
        "measured_resident_peak_above_baseline_mb": max(resident),
        "error_vs_live_tensor": max(predicted) / max(live) - 1,
        "error_vs_resident": max(predicted) / max(resident) - 1,
        "predicted_fits_budget": max(predicted) <= budget_mb,
    }


def _saved_bytes_worker(rank: int, world_size: int, spec: dict[str, Any]) -> list[float]:
    """Bytes each layer keeps for backward on the whole mini-batch, measured (fresh process)."""
    family = _family(spec)
    model = gp.materialize(family.build(spec["size"]), seed=0)
    inputs, targets = family.batch(family.batch_size)
    return layer_memory(model, inputs, targets, family.loss_fn).saved


def plan_check(family: Family, cell: dict[str, Any], log: list[Trial],
               args: argparse.Namespace) -> dict[str, Any]:
    """``gp.plan``'s prediction for a cell's fitting size against its fitting trial."""
    size = cell["size"]
    spec = {"family": family.name, "size": size, "tiny": args.tiny}
    saved = spawn(_saved_bytes_worker, 1, None, spec, process_group=False,
                  timeout_s=args.trial_timeout)[0]
    model = family.build(size)
    inputs, _ = family.batch(family.batch_size)
    sizes = layer_sizes(model, inputs)
    stages, chunks, checkpoint = _column_plan(cell["column"], args.chunks, args.checkpoint)
    balance, predicted = predicted_rank_bytes(
        activation_bytes=saved, input_bytes=sizes.inputs,
        param_bytes=[BYTES_PER_PARAMETER * p for p in sizes.params],
        balance_costs=_memory_costs(sizes, args.chunks, args.checkpoint), stages=stages,
        chunks=chunks, checkpoint=checkpoint, batch_size=family.batch_size)
    trial = next(t for t in log if t.column == cell["column"] and t.size == size and t.fits)
    return {"stages": stages, "chunks": chunks, "checkpoint": checkpoint,
            "predicted_balance": balance, "measured_balance": cell["balance"] or [len(model)],
            **compare_with_plan(predicted, trial.ranks, args.budget_mb)}


# --- the run --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=512.0,
                        help="per-process peak resident memory above the baseline, MB")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8],
                        help="pipeline-K columns run with DistributedGPipe")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches M of the pipelines")
    parser.add_argument("--checkpoint", default="always",
                        help="re-materialization of the pipeline columns")
    parser.add_argument("--families", nargs="+",
                        default=["amoebanet", "amoebanet_56px", "transformer"])
    parser.add_argument("--trial-timeout", type=float, default=600.0, help="seconds per trial")
    parser.add_argument("--mmap-threshold", type=int, default=128 << 10,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ of "
                             "every trial process, bytes (0: glibc's default, unfixed)")
    parser.add_argument("--tiny", action="store_true", help="tiny ladders for the tests")
    parser.add_argument("--out", default="docs/reproduction")
    add_draft_argument(parser)
    args = parser.parse_args()
    # a published result from a dirty tree is refused now, not after the run (issue 40)
    set_draft(args.draft)
    refuse_dirty_tree(Path(args.out) / "memory.json")
    if args.checkpoint not in ("always", "except_last", "never"):
        parser.error(f"--checkpoint {args.checkpoint!r} is not one of always, except_last, never")
    families = TINY_FAMILIES if args.tiny else FAMILIES
    columns = ["naive-1", "pipeline-1"] + [f"pipeline-{k}" for k in args.stages]
    started = time.monotonic()
    load_before = os.getloadavg()
    report: dict[str, Any] = {
        "provenance": provenance(load_before),
        "config": vars(args),
        "allocator": {"settings": allocator_settings(args.mmap_threshold),
                      "how": "environment of the spawned trial processes, read by glibc at "
                             "its initialisation (before the interpreter's first allocation); "
                             "each rank's 'allocator' records what it saw and the probe's result"},
        "families": {}}
    for name in args.families:
        family = families[name]
        print(f"{name}: batch {family.batch_size}, budget {args.budget_mb:.0f} MB/process "
              f"above baseline, M={args.chunks}, checkpoint={args.checkpoint}", flush=True)
        log: list[Trial] = []
        cells, start_at = [], 0
        for column in columns:
            index, fits, over, fine = search_cell(family, column, start_at, args, log)
            cells.append(summarize(family, column, index, fits, over, fine, log))
            start_at = max(index, 0)
        naive = cells[0].get("parameters")
        paper = PAPER[PAPER_FAMILY.get(name, name)]
        for cell in cells:
            if cell["fits"] and naive:
                cell["ratio_to_naive"] = cell["parameters"] / naive
            if cell["fits"] and cell["bracket"]["does_not_fit"] is not None:
                cell["plan_check"] = plan_check(family, cell, log, args)
            if cell["column"] in paper:
                cell["paper_size"], cell["paper_parameters"] = paper[cell["column"]]
                cell["paper_ratio_to_naive"] = paper[cell["column"]][1] / paper["naive-1"][1]
        report["families"][name] = {"batch_size": family.batch_size, "cells": cells,
                                    "ratio_intervals": ratio_intervals(cells),
                                    "trials": [asdict(t) for t in log]}
        report["wall_seconds"] = time.monotonic() - started
        report["provenance"] = provenance(load_before)  # load average before and now
        write_json(Path(args.out) / "memory.json", report)  # each family as it completes
    out = Path(args.out)
    print_table(report)
    plot(report, out / "memory.png")
    print(f"wrote {out}/memory.json and memory.png ({report['wall_seconds']:.0f} s)")


def _size(size: Size | None) -> str:
    return "-" if size is None else "(" + ",".join(str(v) for v in size.values()) + ")"


def _interval(interval: Interval | None) -> str:
    if interval is None:
        return "-"
    low, high = interval
    return f"[{low:.2f}, {'inf' if high is None else f'{high:.2f}'}]"


def print_table(report: dict[str, Any]) -> None:
    for name, result in report["families"].items():
        print(f"\n{name} (budget {report['config']['budget_mb']:.0f} MB per process; memory "
              "columns: parameter memory and residual summed over processes, peaks of the "
              "largest process, MB)")
        print(f"{'column':<12}{'fits':<10}{'over':<10}{'params':>12}{'param':>8}{'resid.':>8}"
              f"{'RSS pk':>8}{'live pk':>8}{'plan pk':>8}{'/naive-1':>16}{'paper':>7}")
        ratios = result["ratio_intervals"]
        for c in result["cells"]:
            over = c["bracket"]["does_not_fit"]
            if not c["fits"]:
                print(f"{c['column']:<12}nothing fits (smallest over: {_size(over['size'])})")
                continue
            paper = c.get("paper_ratio_to_naive")
            planned = c.get("plan_check", {}).get("predicted_peak_mb", float("nan"))
            print(f"{c['column']:<12}{_size(c['size']):<10}"
                  f"{_size(None if over is None else over['size']):<10}{c['parameters']:>12,}"
                  f"{c['parameter_memory_mb']:>8.1f}{c['residual_mb']:>8.1f}"
                  f"{c['max_rank_resident_peak_above_baseline_mb']:>8.1f}"
                  f"{c['max_rank_live_tensor_peak_mb']:>8.1f}{planned:>8.1f}"
                  f"{_interval(ratios.get(c['column'] + ' / naive-1')):>16}"
                  f"{paper if paper is not None else float('nan'):>7.2f}")
        for key, interval in ratios.items():
            if "naive-1" not in key:
                print(f"  {key}: {_interval(interval)}")


def plot(report: dict[str, Any], path: Path) -> None:
    names = list(report["families"])
    fig, axes = pyplot().subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        cells = [c for c in report["families"][name]["cells"] if c["fits"]]
        labels = [c["column"] for c in cells]
        fitting = [c["bracket"]["fits"]["parameters"] / 1e6 for c in cells]
        over = [c["bracket"]["does_not_fit"]["parameters"] / 1e6
                if c["bracket"]["does_not_fit"] is not None else f
                for c, f in zip(cells, fitting, strict=True)]
        ax.bar(labels, fitting, color="tab:blue", label="largest that fits (this machine)")
        ax.errorbar(labels, fitting, yerr=[[0.0] * len(cells),
                                           [o - f for o, f in zip(over, fitting, strict=True)]],
                    fmt="none", ecolor="black", capsize=4, label="up to the smallest over")
        for i, c in enumerate(cells):
            ax.text(i, fitting[i], f"{c.get('ratio_to_naive', 1):.1f}x",
                    ha="center", va="bottom", fontsize=8)
            if "paper_ratio_to_naive" in c:
                ax.plot(i, c["paper_ratio_to_naive"] * fitting[0], "r_",
                        markersize=20, label="paper's ratio x our naive-1" if i == 0 else None)
        ax.set_ylabel("largest model, M parameters")
        ax.set_title(f"{name}: {report['config']['budget_mb']:.0f} MB per process")
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
