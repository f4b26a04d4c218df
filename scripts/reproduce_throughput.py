"""Table 2 at CPU scale, and ``gp.simulate`` against measurement.

One run per model family (AmoebaNet-D and a deep Transformer from the apps; see
``THROUGHPUT_FAMILIES`` in ``scripts/reproduction.py``), two gloo processes, one thread each,
each pinned to its own core (``gp.bind_cpus``) and keeping freed memory mapped
(``gp.hold_freed_memory``), as ``scripts/bench_pipeline.py`` runs them. In that run:

1. **Costs.** Both processes measure every layer's forward (with and without autograd) and
   backward on one micro-batch, for each micro-batch size N/M, layer by layer on the real
   activations (the loss counts with the last layer); both at once and once per round of the
   measurement below, so that the machine's load (shared with other jobs here) touches costs
   and steps alike; medians over rounds, mean of the two processes. The K=2 balance comes
   from a first whole-batch profile. The transfer time: a gloo ping-pong between the two
   processes for several payload sizes, fitted as latency + bytes / bandwidth.
2. **Measured.** For each M, round-robin (one step of each configuration per round, so that
   changes in machine load touch all alike; medians over rounds): the plain module in one
   process on the whole batch, and ``DistributedGPipe`` at K=2 with the balance
   ``balance_by_time`` would choose (optimal min-max cut of the measured per-layer
   forward+backward time), for several schedules and re-materialization modes. Each step's
   time is its slowest rank's. Each rank's peak tensor memory during a step (storages alive at
   once, ``LiveTensorBytes``: the CPU analogue of ``torch.cuda.max_memory_allocated``) above
   what it held before the step (parameters, buffers, the batch; gradients freed) is recorded
   once per configuration, and beside it the peak resident memory above the resident size.
3. **Predicted.** ``gp.simulate`` on the same schedule, with stage costs summed from the
   layer costs, the no-autograd forward for re-materialized micro-batches, the recomputation
   in backward, and the fitted transfer time of the boundary's payload. Peak memory from the
   same simulation (its walk of each rank's actions) with sizes measured on one real
   micro-batch (``stage_memory``): saved tensors, input and output messages, gradients, and
   the most an action adds while it runs.
4. **Table 2.** Measured K=2 throughput for M = 1, 4, 8, 32 (fill-drain, ``except_last`` as
   in the paper), normalised to K=2, M=1; predicted for K = 2, 4, 8, 16 from the same costs.

Writes ``throughput.json`` (every row), ``throughput.png`` (Table 2 curves) and
``simulator.png`` (predicted against measured step time and memory).

    python scripts/reproduce_throughput.py [--families amoebanet transformer --steps 5]
    python scripts/reproduce_throughput.py --tiny --out /tmp/throughput   # for the tests
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import gpipe_core as gp
from gpipe_core.launch import spawn
from gpipe_core.microbatch import scatter
from gpipe_core.partition import optimal_balance
from gpipe_core.remat import checkpoint_stop
from scripts.harness import (
    LiveTensorBytes,
    add_draft_argument,
    provenance,
    pyplot,
    refuse_dirty_tree,
    save_figure,
    set_draft,
    setup_process,
    step_memory_mb,
    timed_step,
    write_json,
)
from scripts.reproduction import (
    APP_FAMILIES,
    THROUGHPUT_FAMILIES,
    TINY_THROUGHPUT_FAMILIES,
    Family,
    Size,
    layer_memory,
    layer_sizes,
    nbytes,
)

K = 2  # measured pipelines: two processes on this 2-core machine
MB = 2**20
# (schedule, re-materialization) measured at every M; the first is the paper's Table 2 setting.
CONFIGS = [("gpipe", "except_last"), ("gpipe", "never"), ("gpipe", "always"), ("1f1b", "never"),
           ("1f1b_slack1", "never")]
PREDICTED_STAGES = [2, 4, 8, 16]
CALIBRATION = ("gpipe", "never")  # its in-pipeline action costs calibrate the layer costs
PAPER_TABLE2 = {  # ../shared/PAPER.md, throughput normalised to K=2, M=1 (TPU)
    "amoebanet": {(1, 2): 1, (1, 4): 1.13, (1, 8): 1.38, (4, 2): 1.07, (4, 4): 1.26,
                  (4, 8): 1.72, (32, 2): 1.21, (32, 4): 1.84, (32, 8): 3.48},
    "transformer": {(1, 2): 1, (1, 4): 1.07, (1, 8): 1.3, (4, 2): 1.7, (4, 4): 3.2,
                    (4, 8): 4.8, (32, 2): 1.8, (32, 4): 3.4, (32, 8): 6.3},
}


@dataclass
class LayerCosts:
    """Seconds per layer for one micro-batch (medians over repeats); the loss is in the last."""

    forward: list[float]
    forward_no_grad: list[float]
    backward: list[float]


def _backward_shares(model: nn.Sequential, run_forwards: Callable[[], list[Tensor]]
                     ) -> list[list[float]]:
    """Each layer's share of each micro-batch's backward (run last micro-batch first), from the
    moments its output gradients were ready (full backward pre-hooks): layer i's backward ran
    from its own hook to layer i-1's (the last layer's, loss included, from the start of the
    backward; the first's to its end)."""
    n = len(model)
    ready: list[float | None] = [None] * n
    hooks = [layer.register_full_backward_pre_hook(
        lambda module, grad, i=i: ready.__setitem__(i, time.perf_counter()))
        for i, layer in enumerate(model)]
    shares = []
    try:
        losses = run_forwards()  # with the hooks in place (they wrap each layer's outputs)
        for loss in reversed(losses):
            ready[:] = [None] * n
            start = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            ready[n - 1] = start  # the last layer's output gradient is the loss's: at once
            for i in reversed(range(n - 1)):  # a layer whose outputs needed none took no time
                if ready[i] is None:
                    ready[i] = ready[i + 1]
            times = [float(ready[i - 1] if i > 0 else end) - float(ready[i])  # type: ignore[arg-type]
                     for i in range(n)]
            shares.append([max(t, 0.0) for t in times])
    finally:
        for hook in hooks:
            hook.remove()
    return shares


def profile_layers(model: nn.Sequential, inputs: Any, targets: Any, loss_fn: Any,
                   repeats: int, microbatches: int = 1) -> LayerCosts:
    """Time each layer's forward (with and without autograd) and backward on one micro-batch
    of ``inputs`` split in ``microbatches``, as they run in a fill-drain step on one stage: the
    forwards of all micro-batches, then their backwards, last first (the loss counts with the
    last layer); means over the micro-batches.

    Layers are timed in sequence rather than one at a time: a layer run twice in a row on the
    same input finds its weights and input in cache, and a backward call per layer pays
    autograd's per-call cost; and the backward of a micro-batch follows the forwards of the
    others, so that its saved tensors are no longer in cache, as in the pipeline. Pass 1 is the
    no-autograd forward, pass 2 the forwards with autograd and the whole backwards (their
    totals), pass 3 splits each backward between layers with hooks, scaled to pass 2's totals
    (the hooks themselves cost ~10% of a backward).
    """
    n = len(model)
    chunks = list(zip(scatter(inputs, microbatches), scatter(targets, microbatches), strict=True))
    samples: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(3)]

    def forward(x: Any, y: Any, times: list[list[float]] | None) -> Tensor:
        for i, layer in enumerate(model):
            start = time.perf_counter()
            x = layer(x)
            if i == n - 1:
                x = loss_fn(x, y)
            if times is not None:
                times[i].append(time.perf_counter() - start)
        return x  # type: ignore[no-any-return]

    for _ in range(repeats):
        with torch.no_grad():
            for x, y in chunks:
                forward(x, y, samples[1])
        losses = [forward(x, y, samples[0]) for x, y in chunks]
        totals = []
        for loss in reversed(losses):
            start = time.perf_counter()
            loss.backward()
            totals.append(time.perf_counter() - start)
        del losses
        model.zero_grad(set_to_none=True)
        shares = _backward_shares(model, lambda: [forward(x, y, None) for x, y in chunks])
        model.zero_grad(set_to_none=True)
        for total, share in zip(totals, shares, strict=True):
            scale = total / sum(share) if sum(share) > 0 else 0.0
            for i, value in enumerate(share):
                samples[2][i].append(value * scale)
    forward_s, no_grad, backward = ([statistics.median(t) for t in kind] for kind in samples)
    return LayerCosts(forward_s, no_grad, backward)


def microbatch_efficiency(model: nn.Sequential, inputs: Any, targets: Any, loss_fn: Any,
                          microbatches: list[int], rounds: int) -> dict[int, float]:
    """Per-sample efficiency of one micro-batch of N/M samples against the whole batch of N,
    for each M: (forward + backward of the whole batch) / (M x that of one micro-batch), from
    ``gp.profile_stages`` with the whole model as one stage (1.0: a micro-batch costs its share;
    0.5: it costs twice its share). What fixed-K throughput loses with M on top of the bubble,
    which the paper's accelerators did not lose at their batch sizes."""
    seconds = {}
    for m in sorted(set(microbatches) | {1}):
        profile = gp.profile_stages(model, [len(model)], inputs, targets, loss_fn=loss_fn,
                                    chunks=m, rounds=rounds)
        seconds[m] = m * (profile.forward[0] + profile.backward[0])
    return {m: seconds[1] / seconds[m] for m in sorted(set(microbatches))}


def efficiency_worker(rank: int, world_size: int, args: argparse.Namespace) -> str:
    """One pinned process: the micro-batch efficiency curve of each batch size asked for."""
    family, size = _families(args)[args.family]
    model = gp.materialize(family.build(size), seed=0)
    curves = {}
    for batch_size in args.efficiency_batches or [batch_size_of(family, args)]:
        inputs, targets = family.batch(batch_size)
        curves[batch_size] = microbatch_efficiency(model, inputs, targets, family.loss_fn,
                                                   args.microbatches, args.profile_repeats)
    return json.dumps({str(n): {str(m): e for m, e in c.items()} for n, c in curves.items()})


def smallest_efficient_batch(curves: dict[int, dict[int, float]], largest_m: int,
                             floor: float = 0.9) -> int | None:
    """The smallest batch size whose micro-batch at ``largest_m`` keeps ``floor`` of the whole
    batch's per-sample efficiency (None: none does)."""
    fits = [n for n, curve in curves.items() if curve.get(largest_m, 0.0) >= floor]
    return min(fits) if fits else None


def choose_batch(curves: dict[int, dict[int, float]], microbatches: list[int],
                 floor: float = 0.9) -> tuple[int, list[int], bool]:
    """Table 2's mini-batch and M values: the smallest measured batch whose smallest
    micro-batch (at the largest M) keeps ``floor`` of the whole batch's per-sample efficiency,
    dropping the largest M until one does, as long as an M above 1 is left; and whether the
    floor holds. Where no batch keeps it even for the second M, the largest batch with every
    M (the most efficient the measurement offers; the table then says the floor failed)."""
    kept = sorted(microbatches)
    while len(kept) > 1:
        batch = smallest_efficient_batch(curves, kept[-1], floor)
        if batch is not None:
            return batch, kept, True
        kept = kept[:-1]
    return max(curves), sorted(microbatches), False


def mean_costs(per_rank: list[dict[Any, Any]], m: int) -> LayerCosts:
    """Each rank profiled every layer under the same load; a layer's cost is their mean."""
    costs = [LayerCosts(**(c[m] if m in c else c[str(m)])) for c in per_rank]
    return LayerCosts(*[[statistics.fmean(v) for v in zip(*[getattr(c, f) for c in costs],
                                                          strict=True)]
                        for f in ("forward", "forward_no_grad", "backward")])


def action_costs(pipe: gp.DistributedGPipe, checkpoint: str, m: int, steps: int
                 ) -> dict[str, Any]:
    """This rank's actions as they ran in the timed steps, step by step: mean compute seconds
    per kind (``F``/``B``, ``_remat`` for re-materialized micro-batches), and the seconds per
    step spent computing and waiting for a neighbour's message (from the runtime's timeline).

    Per step, because on a shared machine a step's actions are slowed together (preempted by
    other jobs): each step is simulated from its own actions and compared with its own time.
    """
    stop = checkpoint_stop(checkpoint, m)
    events = pipe.timeline
    per_step = len(events) // steps
    result: dict[str, Any] = {"steps": [], "compute_per_step": 0.0, "wait_per_step": 0.0}
    for step in range(steps):
        groups: dict[str, list[float]] = {}
        for event in events[step * per_step:(step + 1) * per_step]:
            assert event.ready is not None
            kind = "F" if "F" in event.action else "B"
            mb = int(event.action.split(kind)[1])
            groups.setdefault(kind + ("_remat" if mb < stop else ""), []).append(
                event.end - event.ready)
            result["wait_per_step"] += (event.ready - event.start) / steps
            result["compute_per_step"] += (event.end - event.ready) / steps
        result["steps"].append({k: statistics.fmean(v) for k, v in groups.items()})
    return result


def in_situ_costs(step_per_rank: list[dict[str, float]]) -> dict[str, list[float]]:
    """Stage costs for ``gp.simulate`` from one step's actions' own compute times."""
    costs: dict[str, list[float]] = {"forward": [], "forward_no_grad": [], "backward": [],
                                     "recompute": []}
    for c in step_per_rank:
        forward = c.get("F", c.get("F_remat", 0.0))
        backward = c.get("B", c.get("B_remat", 0.0))
        costs["forward"].append(forward)
        costs["forward_no_grad"].append(c.get("F_remat", forward))
        costs["backward"].append(backward)
        costs["recompute"].append(max(c.get("B_remat", backward) - backward, 0.0))
    return costs


def ping_pong(rank: int, sizes: list[int], repeats: int) -> dict[int, float]:
    """One-way seconds for a message of each size (bytes) between ranks 0 and 1: RTT / 2."""
    result = {}
    for size in sizes:
        buffer = torch.zeros(max(size // 4, 1))
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            times.append((time.perf_counter() - start) / 2)
        result[size] = statistics.median(times)
    return result


def fit_transfer(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares latency (s) and seconds per byte through (bytes, one-way seconds)."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return max(mean_y - slope * mean_x, 0.0), max(slope, 0.0)


# --- prediction -----------------------------------------------------------------------------


def stage_sums(values: list[float], balance: list[int]) -> list[float]:
    bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
    return [float(sum(values[a:b])) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def predict(costs: LayerCosts, sizes: Any, balance: list[int],
            schedule: str, checkpoint: str, m: int, transfer: tuple[float, float],
            memory: list[StageMemory] | None = None) -> gp.Simulation:
    """``gp.simulate`` for one configuration from per-layer costs (one micro-batch each); with
    ``memory`` (:func:`stage_memory`), each rank's peak tensor memory in ``peak_bytes``."""
    k = len(balance)
    bounds = [sum(balance[: i + 1]) for i in range(k)]
    latency, per_byte = transfer
    links = [latency + per_byte * sizes.outputs[b - 1] for b in bounds[:-1]]
    return gp.simulate(
        gp.get_schedule(schedule, k, m), stage_sums(costs.forward, balance),
        stage_sums(costs.backward, balance), transfer=links, checkpoint=checkpoint,
        recompute=stage_sums(costs.forward, balance),
        forward_no_grad=stage_sums(costs.forward_no_grad, balance),
        **(memory_sizes(memory) if memory is not None else {}))


def calibrate(costs: LayerCosts, rows: list[dict[str, Any]], m: int, balance: list[int]
              ) -> LayerCosts:
    """Scale each layer's costs by its stage's ratio of in-pipeline to profiled cost, taken
    from the ``CALIBRATION`` configuration at the same M (mean over its timed steps)."""
    ref = next(r for r in rows if r["M"] == m and (r["schedule"], r["checkpoint"]) == CALIBRATION)
    forward, backward = stage_sums(costs.forward, balance), stage_sums(costs.backward, balance)
    scale_f, scale_b = [], []
    for s, rank in enumerate(ref["actions_per_rank"]):
        scale_f.append(statistics.fmean(step["F"] for step in rank["steps"]) / forward[s])
        scale_b.append(statistics.fmean(step["B"] for step in rank["steps"]) / backward[s])
    stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
    return LayerCosts([c * scale_f[stage_of[i]] for i, c in enumerate(costs.forward)],
                      [c * scale_f[stage_of[i]] for i, c in enumerate(costs.forward_no_grad)],
                      [c * scale_b[stage_of[i]] for i, c in enumerate(costs.backward)])


@dataclass
class StageMemory:
    """Bytes one stage holds for one micro-batch, measured on real tensors (layer_memory)."""

    saved: float  # what its forward keeps for backward (distinct storages)
    extra: float  # the most a forward or backward adds above what the stage holds before it
    received: float  # its input message (kept; it is what re-materialization keeps)
    sent: float  # its output message
    grads: float  # its parameters' gradients


def stage_memory(model: nn.Sequential, balance: list[int], inputs: Any, targets: Any,
                 loss_fn: Any) -> list[StageMemory]:
    """Measure :class:`StageMemory` for each stage of ``balance`` on one micro-batch."""
    bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
    result = []
    x = inputs
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        stage = nn.Sequential(*list(model)[a:b])
        last = s == len(balance) - 1
        memory = layer_memory(stage, x, targets, loss_fn if last else None)
        with torch.no_grad():
            y = stage(x)
        # During layer i's forward or backward the stage holds the micro-batch's saved tensors
        # up to layer i and layer i's transient.
        extra = max(c + t for c, t in zip(itertools.accumulate(memory.saved), memory.transient,
                                           strict=True))
        result.append(StageMemory(
            saved=sum(memory.saved), extra=extra, received=nbytes(x) if s > 0 else 0.0,
            sent=0.0 if last else nbytes(y),
            grads=float(sum(p.numel() * p.element_size() for p in stage.parameters()))))
        x = y
    return result


def memory_sizes(stages: list[StageMemory]) -> dict[str, list[float]]:
    """:class:`StageMemory` as ``gp.simulate``'s sizes: per pending micro-batch a stage keeps
    its received input and, unless re-materialized, its saved tensors; the messages it sent
    (held as the transport holds them, see ``gp.simulate``); its gradients from its first
    backward on; and during an action that action's extra."""
    return {"activation_bytes": [st.saved + st.received for st in stages],
            "input_bytes": [st.received for st in stages],
            "output_bytes": [st.sent for st in stages],
            "gradient_bytes": [st.grads for st in stages],
            "working_bytes": [st.extra for st in stages]}


# --- the measured run -----------------------------------------------------------------------


def worker(rank: int, world_size: int, args: argparse.Namespace) -> str | None:
    """One family's measurements on this rank; rank 0 returns the run as JSON text."""
    families = _families(args)
    family, size = families[args.family]
    inputs, targets = family.batch(batch_size_of(family, args))
    plain = gp.materialize(family.build(size), seed=0)

    # 1. The balance from whole-batch layer costs, both ranks at once; transfer time.
    profile_layers(plain, inputs, targets, family.loss_fn, 1)  # warm
    first: list[Any] = [None] * K
    dist.all_gather_object(first, asdict(profile_layers(plain, inputs, targets, family.loss_fn,
                                                        args.profile_repeats)))
    whole_batch = mean_costs([{1: c} for c in first], 1)  # the same on every rank
    whole = [f + b for f, b in zip(whole_batch.forward, whole_batch.backward, strict=True)]
    if args.balance == "params":  # what balance_by_params gives, as the NMT app chose
        balance = list(gp.balance_by_params(family.build(size), K))
    else:  # what balance_by_time computes from these costs
        balance = list(optimal_balance(whole, K))
    full_sizes = layer_sizes(family.build(size), inputs)
    payloads = sorted({1024, 64 * 1024, 1 << 20, 4 << 20}
                      | {int(b) for b in full_sizes.outputs})
    transfer_points = ping_pong(rank, payloads, repeats=args.pingpong_repeats)

    # 2. Every configuration, round-robin per M.
    def plain_step() -> None:
        if rank == 0:
            plain.zero_grad(set_to_none=True)
            family.loss_fn(plain(inputs), targets).backward()

    rows = []
    costs: dict[int, LayerCosts] = {}
    for m in args.microbatches:
        # Layer costs on this M's micro-batch are measured in the same rounds as the steps, so
        # that the machine's load (shared here) touches costs and steps alike.
        profiles: list[LayerCosts] = []

        def profile(m: int = m, profiles: list[LayerCosts] = profiles) -> None:
            profiles.append(profile_layers(plain, inputs, targets, family.loss_fn, 1,
                                           microbatches=m))

        configs: dict[tuple[str, str], Any] = {("plain", "-"): (plain_step, plain),
                                               ("profile", "-"): (profile, plain)}
        for schedule, checkpoint in CONFIGS:
            pipe = gp.DistributedGPipe(family.build(size), balance, chunks=m, schedule=schedule,
                                       checkpoint=checkpoint, loss_fn=family.loss_fn, seed=0,
                                       record=True)

            def step(pipe: gp.DistributedGPipe = pipe) -> None:
                pipe.zero_grad(set_to_none=True)
                pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None)

            configs[(schedule, checkpoint)] = (step, pipe)
        times: dict[tuple[str, str], list[float]] = {key: [] for key in configs}
        memory: dict[tuple[str, str], Any] = {}
        for round_ in range(args.warmup + args.steps):
            for key, (fn, module) in configs.items():
                if round_ == args.warmup and isinstance(module, gp.DistributedGPipe):
                    module.timeline.clear()  # keep the timed rounds' actions only
                if round_ == args.warmup - 1:  # a warm step measures memory, untimed
                    module.zero_grad(set_to_none=True)
                    tensors = LiveTensorBytes([list(module.parameters()),
                                               list(module.buffers()), inputs, targets])

                    def tracked(fn: Any = fn, tensors: LiveTensorBytes = tensors) -> None:
                        with tensors:
                            fn()

                    _, rss_added = step_memory_mb(tracked)
                    memory[key] = (tensors.peak / MB, rss_added)
                    continue
                seconds = timed_step(fn)
                if round_ >= args.warmup:
                    times[key].append(seconds)
        del times[("profile", "-")]
        costs[m] = LayerCosts(*[[statistics.median(v) for v in zip(*[getattr(p, f) for p in
                                                                    profiles[args.warmup:]],
                                                                  strict=True)]
                                for f in ("forward", "forward_no_grad", "backward")])
        for (schedule, checkpoint), samples in times.items():
            rank_memory: list[Any] = [None] * K
            dist.all_gather_object(rank_memory, memory[(schedule, checkpoint)])
            module = configs[(schedule, checkpoint)][1]
            actions: list[Any] = [None] * K
            dist.all_gather_object(actions, action_costs(module, checkpoint, m, args.steps)
                                   if isinstance(module, gp.DistributedGPipe) else None)
            rows.append({"M": m, "schedule": schedule, "checkpoint": checkpoint,
                         "seconds": statistics.median(samples), "samples": samples,
                         "step_memory_mb_per_rank": [tensor for tensor, _ in rank_memory],
                         "step_rss_mb_per_rank": [rss for _, rss in rank_memory],
                         "actions_per_rank": actions})
        del configs
    all_costs: list[Any] = [None] * K
    dist.all_gather_object(all_costs, {m: asdict(c) for m, c in costs.items()})
    all_transfer: list[Any] = [None] * K
    dist.all_gather_object(all_transfer, transfer_points)
    if rank == 0:
        return json.dumps({
            "rows": rows, "balance": balance, "costs_per_rank": all_costs,
            "transfer_points": {str(k): v for k, v in all_transfer[0].items()},
            "layers": len(plain), "parameters": sum(p.numel() for p in plain.parameters()),
            "size": size, "batch_size": batch_size_of(family, args)})
    return None


def analyse(run: dict[str, Any], family: Family, args: argparse.Namespace) -> dict[str, Any]:
    """Predictions beside the measurements, and Table 2."""
    families = _families(args)
    _, size = families[args.family]
    inputs, targets = family.batch(batch_size_of(family, args))
    real = gp.materialize(family.build(size), seed=0)  # tensor sizes, measured once per M
    memory: dict[int, list[StageMemory]] = {}
    transfer = fit_transfer({int(k): v for k, v in run["transfer_points"].items()})
    costs = {m: mean_costs(run["costs_per_rank"], m) for m in args.microbatches}
    balance = run["balance"]
    plain_time = {r["M"]: r["seconds"] for r in run["rows"] if r["schedule"] == "plain"}
    accuracy = []
    for row in run["rows"]:
        if row["schedule"] == "plain":
            continue
        m = row["M"]
        sizes = layer_sizes(family.build(size), _first_microbatch(inputs, m))
        if m not in memory:
            memory[m] = stage_memory(real, balance, _first_microbatch(inputs, m),
                                     _first_microbatch(targets, m), family.loss_fn)
        sim = predict(costs[m], sizes, balance, row["schedule"], row["checkpoint"], m, transfer,
                      memory[m])
        mem = [peak / MB for peak in sim.peak_bytes]
        row.update(predicted_seconds=sim.step_time, predicted_bubble=sim.bubble_fraction,
                   time_error=sim.step_time / row["seconds"] - 1,
                   predicted_step_memory_mb_per_rank=mem,
                   speedup_over_plain=plain_time[m] / row["seconds"])
        latency, per_byte = transfer
        link = latency + per_byte * sizes.outputs[balance[0] - 1]
        in_situ = []  # each timed step simulated from its own actions' compute times
        for step, measured_step in enumerate(row["samples"]):
            stage_costs = in_situ_costs([a["steps"][step] for a in row["actions_per_rank"]])
            sim_step = gp.simulate(
                gp.get_schedule(row["schedule"], K, m), stage_costs["forward"],
                stage_costs["backward"], transfer=[link] * (K - 1),
                checkpoint=row["checkpoint"], recompute=stage_costs["recompute"],
                forward_no_grad=stage_costs["forward_no_grad"])
            in_situ.append((sim_step.step_time, measured_step))
        row.update(in_situ_seconds=statistics.median(p for p, _ in in_situ),
                   in_situ_error=statistics.median(p / q - 1 for p, q in in_situ),
                   compute_per_step=[a["compute_per_step"] for a in row["actions_per_rank"]],
                   wait_per_step=[a["wait_per_step"] for a in row["actions_per_rank"]],
                   profiled_compute_per_step=[
                       m * (f + b) + fng * checkpoint_stop(row["checkpoint"], m)
                       for f, b, fng in zip(stage_sums(costs[m].forward, balance),
                                            stage_sums(costs[m].backward, balance),
                                            stage_sums(costs[m].forward_no_grad, balance),
                                            strict=True)])
        measured_mem = row["step_memory_mb_per_rank"]
        if all(v is not None for v in measured_mem):
            row["memory_error_per_rank"] = [p / q - 1 for p, q in zip(mem, measured_mem, strict=True)]
        accuracy.append(row)
    # Calibrated: layer costs scaled per stage so that the reference configuration's actions
    # (fill-drain, no re-materialization, same M) cost what they cost inside the pipeline;
    # then every *other* configuration is predicted from them (held out).
    calibrated = {m: calibrate(costs[m], accuracy, m, balance) for m in args.microbatches}
    for row in accuracy:
        if (row["schedule"], row["checkpoint"]) == CALIBRATION:
            continue
        m = row["M"]
        sizes = layer_sizes(family.build(size), _first_microbatch(inputs, m))
        sim = predict(calibrated[m], sizes, balance, row["schedule"], row["checkpoint"], m,
                      transfer)
        row.update(calibrated_seconds=sim.step_time,
                   calibrated_error=sim.step_time / row["seconds"] - 1)
    calibrated_errors = [abs(r["calibrated_error"]) for r in accuracy if "calibrated_error" in r]
    errors = [abs(r["time_error"]) for r in accuracy]
    in_situ_errors = [abs(r["in_situ_error"]) for r in accuracy]
    mem_errors = [abs(e) for r in accuracy for e in r.get("memory_error_per_rank", [])]
    # Table 2: the paper's setting (fill-drain, except_last), normalised to K=2, M=1.
    measured = {r["M"]: r["seconds"] for r in accuracy
                if (r["schedule"], r["checkpoint"]) == CONFIGS[0]}
    table2: dict[str, Any] = {"measured_K2": {}, "ideal_K2": {}, "bubble_only_efficiency_K2": {},
                              "ideal_efficiency_K2": {}, "predicted": {}}
    base = measured.get(1)
    for m, seconds in measured.items():
        table2["measured_K2"][m] = base / seconds if base else None
        # GPipe's ideal at K=2: M/(M+K-1) of the ranks busy, normalised to M=1 (which is 1/K)
        table2["ideal_K2"][m] = (m / (m + K - 1)) / (1 / K)
        table2["ideal_efficiency_K2"][m] = m / (m + K - 1)
        row = next(r for r in accuracy if r["M"] == m
                   and (r["schedule"], r["checkpoint"]) == CONFIGS[0])
        # the compute the ranks did in the step (their actions' own times, from the timeline)
        # over the time they had: what the bubble alone leaves, micro-batch efficiency apart
        table2["bubble_only_efficiency_K2"][m] = (statistics.fmean(row["compute_per_step"])
                                                  / seconds)
    for key, layer_costs in (("predicted", costs), ("predicted_calibrated", calibrated)):
        table2[key] = {}
        for k in [k for k in PREDICTED_STAGES if k <= run["layers"]]:
            for m in args.microbatches:
                c = layer_costs[m]
                whole = [f + b for f, b in zip(c.forward, c.backward, strict=True)]
                bal = list(optimal_balance(whole, k))
                sizes = layer_sizes(family.build(size), _first_microbatch(inputs, m))
                sim = predict(c, sizes, bal, CONFIGS[0][0], CONFIGS[0][1], m, transfer)
                table2[key][f"K={k},M={m}"] = {"seconds": sim.step_time, "balance": bal,
                                               "bubble": sim.bubble_fraction}
        predicted_base = table2[key]["K=2,M=1"]["seconds"]
        for entry in table2[key].values():
            entry["throughput"] = predicted_base / entry["seconds"]
    table2["paper"] = {f"K={k},M={m}": v for (m, k), v in PAPER_TABLE2.get(args.family, {}).items()}
    return {
        "family": args.family, "size": run["size"], "layers": run["layers"],
        "parameters": run["parameters"], "batch_size": run["batch_size"], "balance": balance,
        "transfer_latency_s": transfer[0], "transfer_bytes_per_s": 1 / transfer[1] if transfer[1] else None,
        "transfer_points": run["transfer_points"],
        "plain_seconds": plain_time, "rows": accuracy, "table2": table2,
        "time_error_median": statistics.median(errors), "time_error_max": max(errors),
        "in_situ_error_median": statistics.median(in_situ_errors),
        "in_situ_error_max": max(in_situ_errors),
        "calibrated_error_median": statistics.median(calibrated_errors),
        "calibrated_error_max": max(calibrated_errors),
        "memory_error_median": statistics.median(mem_errors) if mem_errors else None,
        "memory_error_max": max(mem_errors) if mem_errors else None,
        "memory_within_10pct": sum(e <= 0.10 for e in mem_errors),
        "memory_predictions": len(mem_errors),
        "costs": {m: asdict(c) for m, c in costs.items()},
    }


def _families(args: argparse.Namespace) -> dict[str, tuple[Family, Size]]:
    if args.tiny:
        return TINY_THROUGHPUT_FAMILIES
    return {**THROUGHPUT_FAMILIES, **APP_FAMILIES}


def batch_size_of(family: Family, args: argparse.Namespace) -> int:
    """The mini-batch of the run: ``--batch-size`` if given, else the family's."""
    return int(getattr(args, "batch_size", 0) or family.batch_size)


def _first_microbatch(inputs: Any, m: int) -> Any:
    return scatter(inputs, m)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["amoebanet", "transformer"],
                        help="Table 2's models (amoebanet, transformer) or the apps' defaults "
                             "(nmt_app, amoebanet_app)")
    parser.add_argument("--balance", choices=["time", "params"], default="time",
                        help="the K=2 cut: optimal for the profiled time, or by parameters")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--steps", type=int, default=5, help="timed rounds per M")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed rounds per M (>= 1: the last measures memory)")
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--pingpong-repeats", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=0,
                        help="the mini-batch (default: each family's; see --efficiency)")
    parser.add_argument("--efficiency", action="store_true",
                        help="first measure each family's per-sample efficiency against "
                             "micro-batch size (one pinned process), for --efficiency-batches")
    parser.add_argument("--efficiency-batches", type=int, nargs="*", default=[],
                        help="batch sizes whose efficiency curve to measure (default: the "
                             "family's); the report names the smallest whose micro-batch at the "
                             "largest M keeps 90%% of the whole batch's efficiency")
    parser.add_argument("--auto-batch", action="store_true",
                        help="with --efficiency and no --batch-size: measure Table 2 at the "
                             "smallest of --efficiency-batches that keeps 90%% efficiency at the "
                             "largest M, dropping the largest M values where none does")
    parser.add_argument("--tiny", action="store_true", help="tiny models for the tests")
    parser.add_argument("--out", default="docs/reproduction")
    parser.add_argument("--tag", default="",
                        help="written as throughput_TAG.json, throughput_TAG.png, simulator_TAG.png")
    add_draft_argument(parser)
    args = parser.parse_args()
    # a published result from a dirty tree is refused now, not after the run (issue 40)
    set_draft(args.draft)
    refuse_dirty_tree(Path(args.out) / "throughput.json")
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup {args.warmup} and --steps {args.steps} must be at least 1")
    if 1 not in args.microbatches:
        parser.error("--microbatches must include 1: Table 2 is normalised to K=2, M=1")
    families = _families(args)
    unknown = sorted(set(args.families) - set(families))
    if unknown:
        parser.error(f"--families {' '.join(unknown)}: not one of {', '.join(families)}")
    started = time.monotonic()
    load_before = os.getloadavg()
    report: dict[str, Any] = {"config": vars(args), "families": {}}
    for name in args.families:
        family, _ = families[name]
        args.family = name
        efficiency = None
        if args.efficiency:
            print(f"{name}: per-sample efficiency against micro-batch size ...", flush=True)
            raw = json.loads(spawn(efficiency_worker, 1, None, args, setup=setup_process,
                                   process_group=False, timeout_s=None)[0])
            curves = {int(n): {int(m): e for m, e in c.items()} for n, c in raw.items()}
            efficiency = {"curves": curves, "floor": 0.9,
                          "smallest_efficient_batch": smallest_efficient_batch(
                              curves, max(args.microbatches))}
            print(f"  {efficiency}", flush=True)
        asked = (args.batch_size, args.microbatches)
        if args.batch_size == 0 and args.efficiency and args.auto_batch:
            args.batch_size, args.microbatches, efficient = choose_batch(
                efficiency["curves"], args.microbatches)  # type: ignore[index]
            efficiency["floor_met"] = efficient  # type: ignore[index]
            print(f"  chosen: batch {args.batch_size}, M {args.microbatches}"
                  + ("" if efficient else f" (no batch keeps {efficiency['floor']:.0%} at M="  # type: ignore[index]
                     f"{sorted(args.microbatches)[1]}: the most efficient measured)"),
                  flush=True)
        print(f"{name}: measuring K={K} for M={args.microbatches} ...", flush=True)
        run = json.loads(spawn(worker, K, None, args, setup=setup_process, pg_timeout_s=300,
                               timeout_s=None)[0])
        report["families"][name] = analyse(run, family, args)
        report["families"][name]["microbatch_efficiency"] = efficiency
        report["families"][name]["microbatches"] = list(args.microbatches)
        args.batch_size, args.microbatches = asked
        print_family(report["families"][name])
    del args.family
    report["wall_seconds"] = time.monotonic() - started
    report["provenance"] = provenance(load_before)
    out = Path(args.out)
    suffix = f"_{args.tag}" if args.tag else ""
    names = [f"throughput{suffix}.json", f"throughput{suffix}.png", f"simulator{suffix}.png"]
    write_json(out / names[0], report)
    plot_table2(report, out / names[1])
    plot_accuracy(report, out / names[2])
    print(f"wrote {', '.join(str(out / n) for n in names)} ({report['wall_seconds']:.0f} s)")


def print_family(result: dict[str, Any]) -> None:
    print(f"{result['family']} {result['size']}: {result['layers']} layers, "
          f"{result['parameters']:,} parameters, batch {result['batch_size']}, K=2 balance "
          f"{result['balance']}; transfer {result['transfer_latency_s'] * 1e6:.0f} us + bytes at "
          f"{(result['transfer_bytes_per_s'] or 0) / 1e9:.2f} GB/s")
    print(f"{'M':>3} {'schedule':<12}{'ckpt':<12}{'measured':>9}{'predicted':>10}{'err':>7}"
          f"{'in situ':>9}{'err':>7}{'compute/step meas.':>20}{'profiled':>12}"
          f"{'mem MB meas.':>14}{'pred.':>10}")
    for r in result["rows"]:
        meas = "/".join(f"{v:.0f}" if v is not None else "-" for v in r["step_memory_mb_per_rank"])
        pred = "/".join(f"{v:.0f}" for v in r["predicted_step_memory_mb_per_rank"])
        compute = "/".join(f"{v:.3f}" for v in r["compute_per_step"])
        profiled = "/".join(f"{v:.3f}" for v in r["profiled_compute_per_step"])
        print(f"{r['M']:>3} {r['schedule']:<12}{r['checkpoint']:<12}{r['seconds']:>9.4f}"
              f"{r['predicted_seconds']:>10.4f}{r['time_error']:>7.1%}"
              f"{r['in_situ_seconds']:>9.4f}{r['in_situ_error']:>7.1%}{compute:>20}"
              f"{profiled:>12}{meas:>14}{pred:>10}")
    print(f"step time |error| from profiled layer costs: median "
          f"{result['time_error_median']:.1%}, worst {result['time_error_max']:.1%}; from the "
          f"actions' own compute times (in situ): median {result['in_situ_error_median']:.1%}, "
          f"worst {result['in_situ_error_max']:.1%}; calibrated on {'/'.join(CALIBRATION)} at "
          f"each M, the other configurations: median {result['calibrated_error_median']:.1%}, "
          f"worst {result['calibrated_error_max']:.1%}; memory |error| median "
          f"{(result['memory_error_median'] or 0):.1%}, worst {(result['memory_error_max'] or 0):.1%}")
    table = result["table2"]
    ms = sorted(int(m) for m in table["measured_K2"])
    ks = sorted({int(key.split(",")[0][2:]) for key in table["predicted"]})
    print("throughput normalised to K=2, M=1 (fill-drain, except_last): measured K=2, GPipe's "
          "ideal M/(M+K-1) normalised alike, the bubble-only efficiency (compute the ranks did / "
          "time they had) against its ideal | predicted from profiled costs | predicted from "
          "calibrated costs")
    print(f"{'M':>3}{'K=2 meas.':>11}{'ideal':>7}{'busy':>7}{'ideal':>7}"
          + "".join(f"{'K=' + str(k):>8}" for k in ks) * 2)

    def at(name: str, m: int) -> float:
        values = table[name]
        return float(values[m] if m in values else values[str(m)])

    for m in ms:
        print(f"{m:>3}{at('measured_K2', m):>11.2f}{at('ideal_K2', m):>7.2f}"
              f"{at('bubble_only_efficiency_K2', m):>7.0%}{at('ideal_efficiency_K2', m):>7.0%}"
              + "".join(
            f"{table[key][f'K={k},M={m}']['throughput']:>8.2f}"
            for key in ("predicted", "predicted_calibrated") for k in ks))


def plot_table2(report: dict[str, Any], path: Path) -> None:
    names = list(report["families"])
    fig, axes = pyplot().subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        table = report["families"][name]["table2"]
        ks = sorted({int(key.split(",")[0][2:]) for key in table["predicted"]})
        ms = sorted({int(key.split("M=")[1]) for key in table["predicted"]})
        for index, k in enumerate(ks):
            color = f"C{index}"
            ax.plot(ms, [table["predicted"][f"K={k},M={m}"]["throughput"] for m in ms], "-o",
                    color=color, label=f"predicted K={k}")
            ax.plot(ms, [table["predicted_calibrated"][f"K={k},M={m}"]["throughput"] for m in ms],
                    "--", color=color, label=f"calibrated K={k}")
        measured = sorted((int(m), v) for m, v in table["measured_K2"].items())
        ax.plot([m for m, _ in measured], [v for _, v in measured], "ks", markersize=8,
                fillstyle="none", label="measured K=2")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("throughput / (K=2, M=1)")
        ax.set_title(f"{name}: Table 2 at CPU scale")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_accuracy(report: dict[str, Any], path: Path) -> None:
    fig, (ax_time, ax_mem) = pyplot().subplots(1, 2, figsize=(10, 4.2))
    markers = {"amoebanet": "o", "transformer": "^"}
    colors = {"gpipe": "tab:blue", "1f1b": "tab:orange", "1f1b_slack1": "tab:green"}
    for name, result in report["families"].items():
        for r in result["rows"]:
            ax_time.scatter(r["seconds"], r["predicted_seconds"], marker=markers.get(name, "o"),
                            color=colors.get(r["schedule"], "gray"), s=18)
            ax_time.scatter(r["seconds"], r["in_situ_seconds"], marker=markers.get(name, "o"),
                            facecolors="none", edgecolors=colors.get(r["schedule"], "gray"),
                            s=18)
            for meas, pred in zip(r["step_memory_mb_per_rank"],
                                  r["predicted_step_memory_mb_per_rank"], strict=True):
                if meas is not None:
                    ax_mem.scatter(meas, pred, marker=markers.get(name, "o"),
                                   color=colors.get(r["schedule"], "gray"), s=18)
    for ax, unit in ((ax_time, "step time, s"), (ax_mem, "step memory above start, MB")):
        lo, hi = ax.get_xlim()
        lo, hi = min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.plot([lo, hi], [lo * 1.1, hi * 1.1], "k:", lw=0.6)
        ax.plot([lo, hi], [lo * 0.9, hi * 0.9], "k:", lw=0.6)
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
    for schedule, color in colors.items():
        ax_time.scatter([], [], color=color, label=schedule)
    for name, marker in markers.items():
        ax_time.scatter([], [], color="gray", marker=marker, label=name)
    ax_time.legend(fontsize=7)
    ax_time.set_title("gp.simulate vs measured, K=2 (dotted: +-10%)\nfilled: profiled layer "
                      "costs; hollow: in-situ action costs", fontsize=9)
    ax_mem.set_title("peak memory per rank")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
