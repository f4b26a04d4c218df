"""Choosing the schedule, the number of devices K, micro-batches M and the balance under a
memory budget.

From per-layer costs measured on the whole mini-batch (forward and backward seconds, bytes kept
for backward, input bytes, parameter bytes), :func:`plan` tries every K up to the devices
available, every M that divides the batch into micro-batches of at least ``min_microbatch``
samples, every checkpoint mode and every schedule asked for (with virtual stages: V stages per
device for interleaved 1F1B, 2 for ZB-V); balances layers optimally over the stages; predicts
the step with
:func:`~gpipe_core.simulate.simulate`; and returns the fastest plan whose predicted peak memory
per device fits the budget. Per-micro-batch costs are modelled as the whole-batch cost divided
by M plus a fixed per-action overhead, which is what small micro-batches cost on real hardware,
unless ``microbatch_costs`` gives the costs measured at that M (what a profile of each M
gives: small micro-batches run layers below their whole-batch efficiency).

For a model that does not exist yet, give :func:`plan` ``costs`` counted on ``meta``
(:func:`~gpipe_core.costs.layer_costs`) and a ``device``
(:class:`~gpipe_core.devices.Device`) instead: each micro-batch's per-layer seconds then come
from its FLOPs and operator calls on that device (below peak for tiny micro-batches), each
boundary's transfer from its message bytes over the link, the memory budget from the device,
and the parameter memory from ``optimizer`` (bytes per parameter: weights, gradients, state).
:func:`plan_largest` searches a ladder of model sizes for the largest that fits for each K.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .costs import LayerCosts
from .devices import Device, bytes_per_parameter
from .partition import optimal_balance
from .schedule import SCHEDULE_NAMES, get_schedule
from .simulate import simulate
from .stage_profile import StageProfile

__all__ = ["Plan", "plan", "plan_largest", "NoPlanFits"]

Size = TypeVar("Size")
# Per-layer seconds of one micro-batch: (forward, backward) or, with a split backward's
# halves as measured, (forward, backward, backward_input, backward_weight); a half may be None.
MicrobatchCosts = (tuple[Sequence[float], Sequence[float]]
                   | tuple[Sequence[float], Sequence[float], Sequence[float] | None,
                           Sequence[float] | None])
CHECKPOINTS = ("never", "except_last", "always")


class NoPlanFits(ValueError):
    """No configuration fits the memory budget; ``smallest_peak`` says by how much."""

    def __init__(self, message: str, smallest_peak: float, budget: float) -> None:
        super().__init__(message)
        self.smallest_peak = smallest_peak
        self.budget = budget


@dataclass(frozen=True)
class Plan:
    """One candidate configuration and its predicted cost."""

    num_stages: int  # stages (partitions); the devices when each runs one (num_ranks)
    num_microbatches: int
    checkpoint: str
    balance: list[int]
    step_time: float
    bubble_fraction: float
    peak_bytes: float  # the largest device's parameters + kept activations
    schedule: str = "gpipe"
    num_ranks: int = 0  # devices; 0: one per stage
    # per device: parameter memory (weights, gradients, optimizer state) and the rest of its
    # peak (activations kept for backward, recomputation)
    param_bytes: list[float] = field(default_factory=list)
    activation_bytes: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_ranks:
            object.__setattr__(self, "num_ranks", self.num_stages)

    def describe(self) -> str:
        stages = (f"K={self.num_stages}" if self.num_ranks == self.num_stages
                  else f"{self.num_stages} stages on K={self.num_ranks}")
        return (
            f"{self.schedule} {stages} M={self.num_microbatches} checkpoint={self.checkpoint} "
            f"balance={self.balance}: {self.step_time:.4g} s/step, bubble "
            f"{self.bubble_fraction:.0%}, peak {self.peak_bytes / 2**30:.2f} GiB/device"
        )


def plan(
    costs: LayerCosts | None = None,
    *,
    device: Device | None = None,
    optimizer: str | float = "adam",
    forward: Sequence[float] | None = None,
    backward: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    input_bytes: Sequence[float] | None = None,
    param_bytes: Sequence[float] | None = None,
    batch_size: int,
    max_stages: int = 1,
    memory_budget: float | None = None,
    schedule: str | Sequence[str] = "gpipe",
    virtual_stages: Sequence[int] = (2,),
    per_action_overhead: float = 0.0,
    transfer: float = 0.0,
    min_microbatch: int = 1,
    microbatch_costs: Mapping[int, MicrobatchCosts] | None = None,
    backward_weight: Sequence[float] | None = None,
    backward_input: Sequence[float] | None = None,
    profiles: Sequence[StageProfile] | None = None,
    stages: Sequence[int] | None = None,
    microbatches: Sequence[int] | None = None,
    checkpoints: Sequence[str] = CHECKPOINTS,
    balance: Sequence[int] | None = None,
) -> list[Plan]:
    """All feasible plans, fastest first; raises :class:`NoPlanFits` if none fits.

    Either measured costs (``forward``, ``backward``: seconds per layer on the whole batch;
    ``activation_bytes``, ``input_bytes``, ``param_bytes`` per layer) and ``memory_budget``
    bytes per device, or ``costs`` counted on ``meta`` and a ``device`` (``memory_budget``
    defaults to the device's memory; ``optimizer``: a name of
    :data:`~gpipe_core.devices.OPTIMIZER_BYTES` or bytes per parameter).
    ``microbatch_costs[M] = (forward, backward)``: per-layer seconds of one micro-batch when
    the batch is split in M, used for that M instead of the whole-batch cost / M + overhead;
    ``(forward, backward, backward_input, backward_weight)`` adds the halves of a split
    backward as measured (either may be None).
    ``profiles``: per-layer measurements (:func:`~gpipe_core.profile.profile_stages` with one
    stage per layer, ``balance=[1] * len(model)``), one or more per M: they give
    ``microbatch_costs`` for their M (a profile of a fused schedule gives B, one of a split
    schedule I and W; give both and a split schedule pays what its halves measured, which
    may be more than B), the whole-batch costs for the balance (M times the smallest M's),
    and the M to try. Without a memory budget (and sizes), every plan fits.
    ``schedule``: any name :func:`~gpipe_core.schedule.get_schedule` knows, or several (the
    plans of all of them compete; ``"all"``: every built-in one). ``"interleaved_1f1b"`` and
    ``"interleaved_zb"`` are tried with each V of ``virtual_stages`` stages per device, ``"zb_v"`` and ``"dualpipe_v"``
    with 2. For schedules
    that split the backward (``"zb_h1"``, ``"zb_h2"``, ``"zb_v"``), ``backward_weight`` gives
    each layer's part of ``backward`` spent on parameter gradients (W; the rest is I); without
    it, half. ``backward_input`` with it: I as measured, so that I + W may cost more than B
    (the split's own overhead, which can make a zero-bubble schedule slower than 1F1B). ``stages``: the device counts K to try (default 1 to ``max_stages``);
    ``microbatches``: the M to try (default every divisor of the batch); ``checkpoints``: the
    re-materialization modes to try. ``balance``: a fixed split (layers per stage, e.g. one
    already running) instead of the balanced one; only layouts with ``len(balance)`` stages
    are planned.
    """
    if schedule == "all":
        names = [name for name in SCHEDULE_NAMES if name not in ("fill_drain", "one_f_one_b",
                                                                  "1f1b_slackN")]
    else:
        names = [schedule] if isinstance(schedule, str) else list(schedule)
    layouts = [(name, v) for name in names
               for v in (virtual_stages if name in ("interleaved_1f1b", "interleaved_zb") else
                         (2,) if name in ("zb_v", "dualpipe_v") else (1,))]
    counts = list(stages) if stages is not None else list(range(1, max_stages + 1))
    divisors = [m for m in range(1, batch_size // min_microbatch + 1) if batch_size % m == 0]
    if microbatches is not None:
        bad = [m for m in microbatches if m < 1 or batch_size % m]
        if bad:
            raise ValueError(f"microbatches {bad} do not divide batch_size={batch_size}; give "
                             "divisors of the batch")
        divisors = [m for m in divisors if m in microbatches]
    unknown = [c for c in checkpoints if c not in CHECKPOINTS]
    if unknown:
        raise ValueError(f"checkpoints {unknown} unknown; choose from {CHECKPOINTS}")
    stage_kept: Callable[[int, int], float] | None = None
    boundary_bytes: Sequence[float] | None = None
    if profiles:
        measured = _from_profiles(profiles)
        microbatch_costs = {**measured, **(microbatch_costs or {})}
        smallest_m = min(measured)
        if forward is None or backward is None:
            forward = [smallest_m * c for c in measured[smallest_m][0]]
            backward = [smallest_m * c for c in measured[smallest_m][1]]
        if microbatches is None:
            divisors = [m for m in divisors if m in measured]
        n_layers = len(forward)
        if memory_budget is None and activation_bytes is None:
            activation_bytes = input_bytes = param_bytes = [0.0] * n_layers
            memory_budget = float("inf")
    if costs is not None:
        if device is None:
            raise ValueError("plan(costs) needs the device the costs run on: device=gp.DEVICES"
                             "['h100_80gb'] or a gp.Device(...)")
        whole = costs.scaled(batch_size)
        forward = [device.compute_seconds(f, ops) for f, ops in
                   zip(whole.forward_flops, whole.forward_ops, strict=True)]
        backward = [device.compute_seconds(f, ops) for f, ops in
                    zip(whole.backward_flops, whole.backward_ops, strict=True)]
        microbatch_costs = {m: ([device.compute_seconds(f / m, ops) for f, ops in
                                 zip(whole.forward_flops, whole.forward_ops, strict=True)],
                                [device.compute_seconds(f / m, ops) for f, ops in
                                 zip(whole.backward_flops, whole.backward_ops, strict=True)])
                            for m in divisors}
        per_parameter = bytes_per_parameter(optimizer)
        param_bytes = [count * per_parameter for count in whole.param_count]
        activation_bytes = [s + i for s, i in
                            zip(whole.saved_bytes, whole.saved_input_bytes, strict=True)]
        input_bytes = whole.input_bytes
        stage_kept = whole.kept_bytes
        boundary_bytes = whole.output_bytes
        if memory_budget is None:
            memory_budget = device.memory_bytes
    if (forward is None or backward is None or activation_bytes is None or input_bytes is None
            or param_bytes is None or memory_budget is None):
        raise ValueError("give costs= and device=, or forward, backward, activation_bytes, "
                         "input_bytes, param_bytes and memory_budget")
    n = len(forward)
    microbatch_costs = dict(microbatch_costs or {})
    for m, (f, b, *_) in microbatch_costs.items():
        if len(f) != n or len(b) != n:
            raise ValueError(f"microbatch_costs[{m}] has {len(f)} forward and {len(b)} backward "
                             f"costs for {n} layers; give one per layer")
    if not (len(backward) == len(activation_bytes) == len(input_bytes) == len(param_bytes) == n):
        raise ValueError("give forward, backward, activation_bytes, input_bytes and param_bytes "
                         "for every layer (equal lengths)")
    for name, values in (("backward_weight", backward_weight), ("backward_input", backward_input)):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} values for {n} layers")
    if balance is not None:
        balance = [int(b) for b in balance]
        if sum(balance) != n or min(balance) < 1:
            raise ValueError(f"balance {balance} must give every one of the {n} layers to a "
                             f"stage, at least one each (it sums to {sum(balance)})")
        if not any(k * v == len(balance) for k in counts for _, v in layouts):
            raise ValueError(f"balance has {len(balance)} stages but the layouts tried have "
                             f"{sorted({k * v for k in counts for _, v in layouts})}; give "
                             f"stages=[{len(balance)}] (or K with K x V = {len(balance)})")
    plans: list[Plan] = []
    smallest = float("inf")
    for k in counts:
        for name, v in layouts:
            if k * v <= n and (balance is None or k * v == len(balance)):
                found, least = _plans_for(
                    name, k, v, forward=forward, backward=backward,
                    activation_bytes=activation_bytes, input_bytes=input_bytes,
                    param_bytes=param_bytes, divisors=divisors, memory_budget=memory_budget,
                    per_action_overhead=per_action_overhead, transfer=transfer,
                    microbatch_costs=microbatch_costs, backward_weight=backward_weight,
                    backward_input=backward_input, checkpoints=checkpoints, stage_kept=stage_kept,
                    boundary_bytes=boundary_bytes, device=device, balance=balance)
                plans += found
                smallest = min(smallest, least)
    if not plans:
        over = (f"the smallest configuration needs {smallest / 2**30:.2f} GiB, "
                f"{(smallest - memory_budget) / 2**30:.2f} GiB ({smallest / memory_budget - 1:.0%})"
                " over" if smallest < float("inf") else "no configuration was possible")
        raise NoPlanFits(
            f"no plan fits {memory_budget / 2**30:.2f} GiB per device with K in {counts}: "
            f"{over}; allow more stages, a smaller batch, re-materialization or a larger budget",
            smallest, memory_budget)
    return sorted(plans, key=lambda p: (p.step_time, p.peak_bytes))


def plan_largest(
    ladder: Sequence[Size],
    costs_for: Callable[[Size], LayerCosts],
    *,
    stages: Sequence[int],
    **plan_kwargs: object,
) -> dict[int, tuple[int, Plan] | None]:
    """For each K in ``stages``, the index of the largest ladder entry with a plan on exactly K
    devices, and its fastest plan (``None``: not even the first entry fits).

    ``costs_for(size)``: that model's :class:`~gpipe_core.costs.LayerCosts` (counted once per
    size and reused). Assumes memory grows along the ladder (each entry grows the last), so
    the search bisects: O(log len(ladder)) counts per K. ``plan_kwargs`` go to :func:`plan`.
    """
    counted: dict[int, LayerCosts] = {}

    def best(index: int, k: int) -> Plan | str | None:
        """The fastest plan; "short": fewer layers than K stages (try larger); None: too big."""
        if index not in counted:
            counted[index] = costs_for(ladder[index])
        if len(counted[index]) < k:
            return "short"
        try:
            return plan(counted[index], stages=[k], **plan_kwargs)[0]  # type: ignore[arg-type]
        except NoPlanFits:
            return None

    result: dict[int, tuple[int, Plan] | None] = {}
    for k in stages:
        low, high = -1, len(ladder)  # ladder[low] fits (or low = -1), ladder[high] does not
        found: Plan | None = None
        while high - low > 1:
            middle = (low + high) // 2
            candidate = best(middle, k)
            if candidate is None:
                high = middle
            else:
                low = middle
                found = candidate if isinstance(candidate, Plan) else None
        result[k] = None if low < 0 or found is None else (low, found)
    return result


def _plans_for(
    name: str,
    k: int,
    v: int,
    *,
    forward: Sequence[float],
    backward: Sequence[float],
    activation_bytes: Sequence[float],
    input_bytes: Sequence[float],
    param_bytes: Sequence[float],
    divisors: Sequence[int],
    memory_budget: float,
    per_action_overhead: float,
    transfer: float,
    microbatch_costs: Mapping[int, MicrobatchCosts],
    backward_weight: Sequence[float] | None,
    backward_input: Sequence[float] | None,
    checkpoints: Sequence[str],
    stage_kept: Callable[[int, int], float] | None,
    boundary_bytes: Sequence[float] | None,
    device: Device | None,
    balance: Sequence[int] | None = None,
) -> tuple[list[Plan], float]:
    """The plans that fit of schedule ``name`` with ``k * v`` stages on ``k`` devices, and
    the smallest peak memory of any of its configurations (fitting or not)."""
    num_stages = k * v
    if balance is None:
        balance = optimal_balance([f + b for f, b in zip(forward, backward, strict=True)],
                                  num_stages)
    balance = list(balance)
    bounds = [sum(balance[:i]) for i in range(num_stages + 1)]
    stages = list(zip(bounds[:-1], bounds[1:], strict=True))

    def per_stage(values: Sequence[float], a: int, b: int) -> float:
        return float(sum(values[a:b]))

    plans = []
    smallest = float("inf")
    def share(part: Sequence[float] | None, bwd: Sequence[float]) -> list[float] | None:
        """A half of each stage's backward when split: its whole-batch share of the stage."""
        if part is None:
            return None
        return [cost * (per_stage(part, a, b) / per_stage(backward, a, b)
                        if per_stage(backward, a, b) > 0 else 0.5)
                for cost, (a, b) in zip(bwd, stages, strict=True)]

    for m in divisors:
        if m in microbatch_costs:
            f_m, b_m, *halves = microbatch_costs[m]
            fwd = [per_stage(f_m, a, b) for a, b in stages]
            bwd = [per_stage(b_m, a, b) for a, b in stages]
            i_m, w_m = (list(halves) + [None, None])[:2]
            inp = None if i_m is None else [per_stage(i_m, a, b) for a, b in stages]
            wgt = None if w_m is None else [per_stage(w_m, a, b) for a, b in stages]
            if inp is None and wgt is None:
                inp, wgt = share(backward_input, bwd), share(backward_weight, bwd)
        else:
            fwd = [per_stage(forward, a, b) / m + per_action_overhead for a, b in stages]
            bwd = [per_stage(backward, a, b) / m + per_action_overhead for a, b in stages]
            inp, wgt = share(backward_input, bwd), share(backward_weight, bwd)
        acts = [(stage_kept(a, b) if stage_kept is not None
                 else per_stage(activation_bytes, a, b)) / m for a, b in stages]
        inputs = [input_bytes[a] / m for a, _ in stages]
        params = [per_stage(param_bytes, a, b) for a, b in stages]
        links: float | list[float] = transfer
        if boundary_bytes is not None and device is not None:
            links = [transfer + device.transfer_seconds(boundary_bytes[b - 1] / m)
                     for _, b in stages[:-1]]
        try:
            actions = get_schedule(name, num_stages, m, num_ranks=k)
        except ValueError:  # this M does not suit the schedule (DualPipeV: M < 2K)
            continue
        on_rank = [actions.stages_on(r) for r in range(k)]
        for checkpoint in checkpoints:
            sim = simulate(actions, fwd, bwd, backward_input=inp, backward_weight=wgt,
                           transfer=links,
                           checkpoint=checkpoint, activation_bytes=acts, input_bytes=inputs)
            # Re-materializing needs one micro-batch's full activations during backward
            # (a split backward's I keeps them until W; the simulation counts that).
            rebuilt = checkpoint != "never" and not actions.splits_backward
            held = [sum(params[s] for s in mine) for mine in on_rank]
            kept = [sim.peak_bytes[r] + (max(acts[s] for s in mine) if rebuilt else 0.0)
                    for r, mine in enumerate(on_rank)]
            peak = max(h + a for h, a in zip(held, kept, strict=True))
            smallest = min(smallest, peak)
            if peak <= memory_budget:
                plans.append(Plan(num_stages, m, checkpoint, balance, sim.step_time,
                                  sim.bubble_fraction, peak, name, k, held, kept))
    return plans, smallest


def _from_profiles(profiles: Sequence[StageProfile]) -> dict[int, MicrobatchCosts]:
    """Per M, the per-layer costs the profiles of that M give: forward and B from a fused
    schedule's profile (else I + W), I and W from a split one's."""
    by_m: dict[int, list[StageProfile]] = {}
    for profile in profiles:
        by_m.setdefault(profile.num_microbatches, []).append(profile)
    result: dict[int, MicrobatchCosts] = {}
    for m, group in sorted(by_m.items()):
        fused = [p for p in group if p.backward_input is None]
        split = [p for p in group if p.backward_input is not None]
        base = fused[0] if fused else split[0]
        halves = split[0] if split else None
        result[m] = (base.forward, base.backward,
                     halves.backward_input if halves else None,
                     halves.backward_weight if halves else None)
    lengths = {len(p.forward) for p in profiles}
    if len(lengths) != 1:
        raise ValueError(f"profiles have {sorted(lengths)} stages; give per-layer profiles of "
                         "one model (balance=[1] * len(model)), one stage per layer")
    return result
