"""Plan a training run for a cluster from an app config, counted on ``meta`` (no memory).

Shared by ``python -m apps.nmt.plan`` and ``python -m apps.amoebanet.plan``: the app's model
is built on ``meta`` at full size, its per-layer costs counted (:func:`gpipe_core.layer_costs`)
for the config's batch, and :func:`gpipe_core.plan` picks K, M, the schedule, the
re-materialization and the balance that fit the device and run fastest. ``--largest`` grows
the model along the app's ladder (more layers at the config's width) and prints, for each K,
the largest that fits.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe_core as gp
from apps.config import ConfigError
from gpipe_core.costs import structural_key
from gpipe_core.microbatch import map_tensors

GiB = 2**30


@dataclass
class AppModel:
    """What the planner needs from an app: a model of a given depth and one sample."""

    build: Callable[[int], nn.Sequential]  # depth -> model on meta
    depth: int  # the config's depth (layers, or normal cells)
    depth_name: str
    sample: Any  # one sample's inputs, on meta
    batch_size: int  # samples per mini-batch
    unit: str  # what a sample is ("sentence pairs", "images")
    tokens_per_sample: int  # for tokens per second (1 for images)
    optimizer: str  # a name of gp.OPTIMIZER_BYTES
    describe: str
    # the training loss on the last layer's output (targets made inside, on the output's
    # device): counted with the last layer, whose stage holds what the loss saves for backward
    # for every micro-batch in flight (the NMT's log-probabilities over the vocabulary); None:
    # the layers alone
    loss: Callable[[Any], torch.Tensor] | None = None
    # n real inputs (random images, tokens that are not padding), for timing the model on
    # the machine that runs it (``measured_profile``); None: the model is only counted
    example: Callable[[int], Any] | None = None


def parser(app: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m apps.{app}.plan", description=(
        "Print the fastest pipeline plan that fits a cluster for an app config; with "
        "--largest, the largest model of the config's family that fits for each K. Config "
        "overrides go after --, e.g. -- --num_layers=48"))
    p.add_argument("--config", required=True, help="configs/<name>.yaml name or a path")
    p.add_argument("--device", default="h100_80gb",
                   help=f"a preset ({', '.join(gp.DEVICES)})")
    p.add_argument("--devices", type=int, default=8, help="accelerators available (max K)")
    p.add_argument("--memory-gb", type=float, help="override the device's memory (GB)")
    p.add_argument("--peak-tflops", type=float, help="override the device's peak TFLOP/s")
    p.add_argument("--achievable", type=float, help="override the achievable fraction of peak")
    p.add_argument("--link-gbps", type=float, help="override the link (GB/s, one direction)")
    p.add_argument("--batch", type=int, help="samples per mini-batch (default: the config's)")
    p.add_argument("--optimizer", help="optimizer state: a name "
                   f"({', '.join(gp.OPTIMIZER_BYTES)}) or bytes per parameter")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="activation dtype the step runs in")
    p.add_argument("--schedule", default="all", help="a schedule name, or 'all' to compare")
    p.add_argument("--largest", action="store_true", help="the largest model that fits per K")
    p.add_argument("--top", type=int, default=3, help="plans printed")
    return p


def device_from(args: argparse.Namespace) -> gp.Device:
    device = gp.get_device(args.device)
    changes: dict[str, float] = {}
    if args.memory_gb is not None:
        changes["memory_bytes"] = args.memory_gb * 1e9
    if args.peak_tflops is not None:
        changes["peak_flops"] = args.peak_tflops * 1e12
    if args.achievable is not None:
        changes["achievable"] = args.achievable
    if args.link_gbps is not None:
        changes["link_bandwidth"] = args.link_gbps * 1e9
    return gp.Device(**{**vars(device), **changes})


class _Loss(nn.Module):
    def __init__(self, loss: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, output: Any) -> torch.Tensor:
        return self.loss(output)


def _counted(model: AppModel, depth: int, dtype: torch.dtype) -> gp.LayerCosts:
    module = model.build(depth).to(dtype)
    sample = model.sample if dtype == torch.float32 else tuple(
        t.to(dtype) if t.is_floating_point() else t for t in model.sample) \
        if isinstance(model.sample, tuple) else model.sample.to(dtype)
    if model.loss is None:
        return gp.layer_costs(module, sample, same_layer=structural_key)
    layers = list(module._modules.values())
    costs = gp.layer_costs(nn.Sequential(*layers, _Loss(model.loss)), sample,
                           same_layer=structural_key)
    return with_loss(costs, rows=model.batch_size)


_TRAFFIC = ("forward_traffic_bytes", "backward_traffic_bytes", "forward_traffic_fixed_bytes",
            "backward_traffic_fixed_bytes")


def with_loss(costs: gp.LayerCosts, rows: int) -> gp.LayerCosts:
    """The costs of a model counted with its loss as one more layer, the loss folded into the
    last layer: its compute added, what it saves (its input included) added to what that layer
    keeps, so a stage ending there holds it per micro-batch in flight (and recomputes it with
    that layer); its backward's working bytes the larger of the loss's and the layer's (less
    what the loss saved, freed by then) at every micro-batch of 1 to ``rows`` rows (the
    batch); its output the loss."""
    merged = {name: list(getattr(costs, name)[:-1]) for name in (
        "names", "param_count", "param_bytes", "saved_bytes", "saved_input_bytes",
        "saved_fixed_bytes",
        "input_bytes", "output_bytes", "output_unsaved_bytes", "output_passthrough_bytes",
        "forward_working_bytes", "input_freed_bytes", "backward_bytes",
        "backward_fixed_bytes",
        "forward_flops", "backward_flops", "forward_ops", "backward_ops", *_TRAFFIC)}
    for name in ("param_count", "param_bytes", "forward_flops", "backward_flops", "forward_ops",
                 "backward_ops", *_TRAFFIC):
        merged[name][-1] += getattr(costs, name)[-1]
    merged["saved_bytes"][-1] += costs.saved_bytes[-1] + costs.saved_input_bytes[-1]
    merged["saved_fixed_bytes"][-1] += costs.saved_fixed_bytes[-1]
    # The loss's backward runs first (the output's gradient), then the layer's, which receives
    # it once the loss's saved tensors are freed: what the layer's own backward holds at once
    # is above a kept count that still has them.
    loss_saved = costs.saved_bytes[-1] + costs.saved_input_bytes[-1]
    merged["backward_bytes"][-1], merged["backward_fixed_bytes"][-1] = _upper_line(
        (merged["backward_bytes"][-1] - loss_saved, merged["backward_fixed_bytes"][-1]),
        (costs.backward_bytes[-1], costs.backward_fixed_bytes[-1]),
        (1 / costs.batch_size, max(rows, 1) / costs.batch_size))
    if costs.forward_working_bytes:
        # The loss runs after the layer, beside what the layer left: its output (less what the
        # loss saves of it, in the merged saved count already; all of it where the layer
        # saved it, a bound) and the loss's temporaries.
        merged["forward_working_bytes"][-1] = max(
            merged["forward_working_bytes"][-1],
            costs.forward_working_bytes[-1]
            + merged["output_bytes"][-1] - costs.saved_input_bytes[-1])
    merged["output_bytes"][-1] = costs.output_bytes[-1]  # the last stage ends in the loss
    merged["output_unsaved_bytes"][-1] = costs.output_unsaved_bytes[-1]
    merged["output_passthrough_bytes"][-1] = costs.output_passthrough_bytes[-1]
    return gp.LayerCosts(batch_size=costs.batch_size, **merged)


def _upper_line(first: tuple[float, float], second: tuple[float, float],
                span: tuple[float, float]) -> tuple[float, float]:
    """One ``(growing, fixed)`` count for two backward moments of one layer, each ``growing * x
    + fixed`` bytes for a micro-batch of ``x`` times the counted batch, of which the larger
    holds: the line through their upper envelope at the ends of ``span`` (exact there, an upper
    bound between). Not the larger part of each: the layer's weight-sized gradient (fixed) and
    the loss's logits-sized temporaries (growing) do not coincide."""
    low, high = span
    at_low, at_high = (max(g * x + f for g, f in (first, second)) for x in (low, high))
    growing = (at_high - at_low) / (high - low) if high > low else 0.0
    return growing, at_low - growing * low


def run(model: AppModel, args: argparse.Namespace) -> int:
    device = device_from(args)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    optimizer: str | float = args.optimizer or model.optimizer
    try:
        optimizer = float(optimizer)
    except ValueError:
        pass
    batch = args.batch or model.batch_size
    per_parameter = gp.devices.bytes_per_parameter(optimizer)
    schedule = args.schedule
    counts = [k for k in range(1, args.devices + 1)]
    costs = _counted(model, model.depth, dtype)
    print(f"{model.describe}: {costs.num_parameters / 1e9:.3f}B parameters, "
          f"{len(costs)} layers; batch {batch} {model.unit}; {device.name} "
          f"({device.memory_bytes / GiB:.1f} GiB, {device.peak_flops / 1e12:.0f} TFLOP/s x "
          f"{device.achievable:.2f}), up to {args.devices} devices; optimizer {optimizer} "
          f"({per_parameter:g} bytes/parameter)")
    try:
        plans = gp.plan(costs, device=device, optimizer=optimizer, batch_size=batch,
                        stages=[k for k in counts if k <= len(costs)], schedule=schedule)
    except gp.NoPlanFits as error:
        print(f"nothing fits: {error}")
        return 1
    for rank, best in enumerate(plans[: args.top], start=1):
        per_second = batch / best.step_time
        tokens = (f", {per_second * model.tokens_per_sample:,.0f} tokens/s"
                  if model.tokens_per_sample > 1 else "")
        memory = ", ".join(f"{(p + a) / GiB:.1f}" for p, a in
                           zip(best.param_bytes, best.activation_bytes, strict=True))
        print(f"{rank}. {best.schedule} K={best.num_ranks} M={best.num_microbatches} "
              f"checkpoint={best.checkpoint} balance={best.balance}\n"
              f"   {best.step_time:.3f} s/step, {per_second:,.1f} {model.unit}/s{tokens}, "
              f"bubble {best.bubble_fraction:.0%}; memory per device [{memory}] GiB of "
              f"{device.memory_bytes / GiB:.1f}")
    if args.largest:
        # x1.25 steps from an eighth to 32 times the config's depth
        ladder = sorted({max(1, round(model.depth * 1.25**i)) for i in range(-9, 16)})
        found = gp.plan_largest(ladder, lambda d: _counted(model, d, dtype),
                                stages=[k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                                        if k <= args.devices],
                                device=device, optimizer=optimizer, batch_size=batch,
                                schedule="gpipe")
        print(f"largest {model.depth_name} that fits (GPipe schedule, ladder x1.25):")
        for k, result in found.items():
            if result is None:
                print(f"  K={k}: none of the ladder fits")
                continue
            index, best = result
            size = _counted(model, ladder[index], dtype).num_parameters
            edge = " (the ladder's end: may fit more)" if index == len(ladder) - 1 else ""
            print(f"  K={k}: {model.depth_name}={ladder[index]}, {size / 1e9:.2f}B parameters, "
                  f"M={best.num_microbatches} checkpoint={best.checkpoint}, "
                  f"{best.step_time:.3f} s/step, peak {best.peak_bytes / GiB:.1f} GiB{edge}")
    return 0


def optimizer_name(name: str, momentum: float = 0.0) -> str:
    """An app's optimizer name as a key of :data:`gpipe_core.OPTIMIZER_BYTES`."""
    table = {"adam": "adam", "adamw": "adam", "lamb": "adam", "adafactor": "adafactor",
             "sgd": "momentum" if momentum else "sgd", "momentum": "momentum",
             "rmsprop": "rmsprop_momentum" if momentum else "rmsprop",
             "rmsproptf": "rmsprop_momentum" if momentum else "rmsprop"}
    if name not in table:
        raise ValueError(f"optimizer {name!r} has no known state size; pass --optimizer with "
                         f"one of {', '.join(gp.OPTIMIZER_BYTES)} or a number of bytes")
    return table[name]


def config_error(error: Exception, config_dir: Path) -> int:
    """Say what was wrong with the config (and which named configs there are); exit status 2."""
    names = ", ".join(sorted(p.stem for p in config_dir.glob("*.yaml")))
    print(f"error: {error}; give a YAML path or one of: {names}", file=sys.stderr)
    return 2


def split_overrides(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """Planner options, then ``--key=value`` config overrides after a ``--``."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


# ---------------------------------------------------------------------------------------------
# A train run's per-rank memory budget (``memory_budget_mb``)

MiB = 2**20
# One core of the CPU the apps train on, for gp.plan's time model, measured with one thread by
# scripts/measure_cpu_core.py (docs/reproduction/cpu_core.json; tests/scripts/
# test_measure_cpu_core.py keeps the two equal): fp32 matmul at half of peak_flops, the cost of
# a tiny operator, the median bandwidth of element-wise, normalisation and pooling layers; and
# what a gloo message between two ranks takes from each end's core, measured by
# scripts/measure_messages.py (docs/reproduction/cpu_messages.json). The link adds only a
# latency: a message's one-way time (80 us + bytes / 1.9 GB/s there) is less than the two
# ends' copies, which the simulation charges to the actions (they overlap in the transport).
# It ranks the choices; the budget is bytes.
CPU_CORE = gp.Device("cpu_core", memory_bytes=64 * GiB, peak_flops=203.4e9, achievable=0.5,
                     op_overhead=1.17e-6, memory_bandwidth=14.77e9, link_bandwidth=1e12,
                     link_latency=5e-6, message_overhead=45.8e-6, message_bandwidth=2.79e9,
                     source="measured (docs/reproduction/cpu_core.json, cpu_messages.json) on "
                            "AMD EPYC, 1 thread per rank, a shared host: fp32 matmul "
                            "102 GFLOP/s, 1.17 us per tiny op, element-wise layers 14.8 GB/s "
                            "(median); each end of a gloo message 45.8 us + bytes / 2.79 GB/s")
# What a budget lets the planner choose among: the fixed modes and kept layers per stage
BUDGET_CHECKPOINTS = ("never", "except_last", "always", "selective")


def budget_batch(model: AppModel, chunks: int) -> int:
    """The samples per mini-batch the budget is planned for: the app's batch, down to a multiple
    of ``chunks`` (gp.plan splits it into whole micro-batches), at least ``chunks``."""
    return max(chunks, model.batch_size - model.batch_size % chunks)


def budget_plan(model: AppModel, *, budget_mb: float, num_stages: int, chunks: int,
                schedule: str, balance: Sequence[int] | None = None,
                checkpoints: Sequence[str | gp.Remat] = BUDGET_CHECKPOINTS,
                costs: gp.LayerCosts | None = None,
                profiles: Sequence[gp.StageProfile] | None = None) -> gp.Plan:
    """The fastest plan at the run's K, M and schedule whose per-rank peak (parameters,
    gradients, optimizer state, kept activations: gp.plan's count on ``meta``) fits
    ``budget_mb``, choosing the re-materialization (a mode, or kept layers per stage) and,
    unless ``balance`` is given, the balance. ConfigError naming the budget, the smallest
    feasible peak and the fix when nothing fits. ``profiles``: per-layer seconds measured
    at ``chunks`` (``gp.profile_stages`` with one stage per layer) instead of ``CPU_CORE``'s
    prices; the bytes stay counted."""
    if costs is None:
        costs = _counted(model, model.depth, torch.float32)
    batch = budget_batch(model, chunks)
    try:
        return gp.plan(costs, device=CPU_CORE, optimizer=model.optimizer, batch_size=batch,
                       stages=[num_stages], microbatches=[chunks], schedule=schedule,
                       checkpoints=list(checkpoints), memory_budget=budget_mb * MiB,
                       balance=list(balance) if balance is not None else None,
                       profiles=profiles)[0]
    except gp.NoPlanFits as error:
        smallest = error.smallest_peak / MiB
        raise ConfigError(
            f"memory_budget_mb={budget_mb:g} fits no plan of num_stages={num_stages}, "
            f"chunks={chunks}, schedule={schedule!r}: the smallest feasible per-rank peak is "
            f"{smallest:.1f} MiB; give memory_budget_mb >= "
            f"{math.ceil(smallest * 10) / 10:g}, more num_stages or chunks, or 0 for no budget"
        ) from None


def describe_budget_plan(best: gp.Plan, budget_mb: float) -> str:
    """One line for the run's log: the chosen re-materialization and the predicted peaks."""
    peaks = ", ".join(f"{(p + a) / MiB:.1f}" for p, a in
                      zip(best.param_bytes, best.activation_bytes, strict=True))
    return (f"memory budget {budget_mb:g} MiB per rank: gp.plan chose checkpoint="
            f"{best.checkpoint} balance={best.balance} ({best.schedule}, M="
            f"{best.num_microbatches}); predicted per-rank peak [{peaks}] MiB (parameters, "
            f"gradients, optimizer state, kept activations), {best.step_time:.3f} s/step "
            f"predicted")


def measured_profile(model: AppModel, chunks: int, *, seed: int, device: torch.device,
                     rounds: int = 5) -> gp.StageProfile:
    """Each layer's seconds on ``device`` (a plain copy of the model, ``seed``'s weights) at
    ``chunks`` micro-batches of the planned batch, with the loss on the last layer: its forward
    with and without autograd and its backward with and without the rerun (what
    ``gp.plan(costs, profiles=...)`` takes), each from a replay in which every micro-batch ran
    that way (``never``, then ``always``: ``gp.StageProfile.combined``), as a layer that keeps
    its activations, or recomputes them, runs in the pipeline. Messages pass unpacked: the
    plan prices the boundaries it cuts by the device model (``Device.message_cpu_seconds``),
    where a profile that packs would charge every layer's boundary."""
    if model.example is None:
        raise ValueError(f"{model.describe}: no example inputs to time the model on")
    loss = model.loss
    plain = gp.materialize(model.build(model.depth), seed=seed, device=device)
    inputs = map_tensors(model.example(budget_batch(model, chunks)),
                            lambda t: t.to(device))
    kept, rematerialized = (
        gp.profile_stages(plain, [1] * len(plain), inputs,
                          loss_fn=None if loss is None else lambda out, _: loss(out),
                          chunks=chunks, checkpoint=mode, rounds=rounds, pack_messages=False)
        for mode in ("never", "always"))
    return gp.StageProfile.combined(kept, rematerialized)


def plan_for_budget(model: AppModel, config: Any, balance: Sequence[int] | None = None, *,
                    measure_on: torch.device | None = None,
                    max_parameters: int = 0) -> gp.Plan | None:
    """A train run's plan under ``config.memory_budget_mb`` at its ``num_stages``, ``chunks``
    and ``schedule`` (None without a budget); ``balance``: a fixed one (the config's, or a
    resumed checkpoint's). Run before any process group, so that a budget nothing fits is one
    ``error:`` line (the bytes are counted, whatever prices the time), and again where the
    pipeline is built, there with ``measure_on``: global rank 0 times each layer on that
    device (``measured_profile``) and plans with those seconds, and every rank gets its plan
    (timing differs between processes), as the apps' balance is chosen without a budget;
    where the balance those seconds give fits nothing, the counted plan's balance (so that a
    budget the first call accepted is never refused here); counted prices (``CPU_CORE``) for
    a model over ``max_parameters``, too large to time whole."""
    if not config.memory_budget_mb:
        return None

    def planned(profiles: list[gp.StageProfile] | None,
                fixed: Sequence[int] | None = balance) -> gp.Plan:
        return budget_plan(model, budget_mb=config.memory_budget_mb,
                           num_stages=config.num_stages, chunks=config.chunks,
                           schedule=config.schedule, balance=fixed, profiles=profiles)

    if measure_on is None or model.example is None:
        return planned(None)
    params = sum(p.numel() for p in model.build(model.depth).parameters())
    if params > max_parameters:
        return planned(None)
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            counted = planned(None)  # fits, or the run was refused before any process group
            profiles = [measured_profile(model, config.chunks, seed=config.seed,
                                         device=measure_on)]
            try:
                result[0] = planned(profiles)
            except ConfigError:  # the measured seconds' balance fits nothing: the counted one
                result[0] = planned(profiles, counted.balance)
        except ConfigError as error:  # every rank raises it
            result[0] = str(error)
    with gp.collectives("planning the memory budget"):
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], str):
        raise ConfigError(result[0])
    return result[0]
