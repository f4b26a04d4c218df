"""Choosing the schedule, the number of devices K, micro-batches M and the balance under a
memory budget.

From per-layer costs measured on the whole mini-batch (forward and backward seconds, bytes kept
for backward, input bytes, parameter bytes), :func:`plan` tries every K up to the devices
available, every M that divides the batch into micro-batches of at least ``min_microbatch``
samples, every checkpoint mode and every schedule asked for (with virtual stages: V stages per
device for interleaved 1F1B, 2 for ZB-V); balances layers optimally over the stages (and,
where a device holds several stages, also tries the balance whose simulated step is fastest:
a V's first and last stage share a rank, so stages balanced one by one can leave the ranks
unequal); predicts the step with
:func:`~gpipe_core.simulator.simulate`; and returns the fastest plan whose predicted peak memory
per device fits the budget. Per-micro-batch costs are modelled as the whole-batch cost divided
by M plus a fixed per-action overhead, which is what small micro-batches cost on real hardware,
unless ``microbatch_costs`` gives the costs measured at that M (what a profile of each M
gives: small micro-batches run layers below their whole-batch efficiency).

For a model that does not exist yet, give :func:`plan` ``costs`` counted on ``meta``
(:func:`~gpipe_core.costs.layer_costs`) and a ``device``
(:class:`~gpipe_core.devices.Device`) instead: each micro-batch's per-layer seconds then come
from its FLOPs, operator calls and (with the device's ``memory_bandwidth``) the bytes its
element-wise operators move on that device (below peak for tiny micro-batches), each
boundary's transfer from its message bytes over the link (and, with the device's
``message_bandwidth``, the compute each message takes from the ranks at both ends: a CPU
transport's copies), the memory budget from the device,
and the parameter memory from ``optimizer`` (bytes per parameter: weights, gradients, state).
:func:`plan_largest` searches a ladder of model sizes for the largest that fits for each K.

Selective re-materialization (``checkpoints`` holding ``"selective"``): for each configuration
the planner chooses, per stage, the layers whose activations are kept
(:class:`~gpipe_core.remat.Remat`). A stage keeps per micro-batch its input, its kept layers'
activations and the input of each run of recomputed layers, for as many micro-batches as the
schedule has in flight on it (fill-drain: M; 1F1B: about K - s on stage s, so early stages
gain most from recomputing); its backward pays the recomputed layers' forward again, and
(fused B) holds one recomputed run's activations at a time. The choice starts from keeping
everything and, while a device is over the budget, recomputes the layer of that device that
frees the most bytes per second of recomputation; then it keeps again, largest forward first,
every recomputed layer the budget still allows, and a stage of up to 8 layers tries every
choice of its own kept layers with the others' fixed. A :class:`~gpipe_core.remat.Remat` in
``checkpoints`` is evaluated as given (for a fixed balance).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .costs import LayerCosts
from .devices import Device, bytes_per_parameter
from .partition import optimal_balance
from .remat import Remat
from .schedule import SCHEDULE_NAMES, Schedule, get_schedule
from .simulator import Simulation, simulate
from .stage_profile import StageProfile

__all__ = ["Plan", "plan", "plan_largest", "NoPlanFits"]

Size = TypeVar("Size")
# Per-layer seconds of one micro-batch: (forward, backward) or, with a split backward's
# halves as measured, (forward, backward, backward_input, backward_weight); a half may be None.
MicrobatchCosts = (tuple[Sequence[float], Sequence[float]]
                   | tuple[Sequence[float], Sequence[float], Sequence[float] | None,
                           Sequence[float] | None])
CHECKPOINTS = ("never", "except_last", "always")
SELECTIVE = "selective"  # in ``checkpoints``: the planner chooses the kept layers per stage


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
    checkpoint: str  # a mode, or a selective choice as text (``str(Remat)``: "keep:[[0], []]")
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
    checkpoints: Sequence[str | Remat] = CHECKPOINTS,
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
    and the M to try. Without a memory budget (and sizes), every plan fits. ``profiles``
    with ``costs`` and ``device``: the seconds are the profiles' (measured on the machine
    that will run), the bytes, the budget and the transfers (and the messages' compute) the
    counted costs' and the device's (where a device's FLOP and bandwidth rates rank layers wrongly, as a CPU core's
    do for small convolutions and pooling).
    ``schedule``: any name :func:`~gpipe_core.schedule.get_schedule` knows, or several (the
    plans of all of them compete; ``"all"``: every built-in one). ``"interleaved_1f1b"`` and
    ``"interleaved_zb"`` are tried with each V of ``virtual_stages`` stages per device, ``"zb_v"`` and ``"dualpipe_v"``
    with 2. For schedules
    that split the backward (``"zb_h1"``, ``"zb_h2"``, ``"zb_v"``), ``backward_weight`` gives
    each layer's part of ``backward`` spent on parameter gradients (W; the rest is I); without
    it, half. ``backward_input`` with it: I as measured, so that I + W may cost more than B
    (the split's own overhead, which can make a zero-bubble schedule slower than 1F1B). ``stages``: the device counts K to try (default 1 to ``max_stages``);
    ``microbatches``: the M to try (default every divisor of the batch); ``checkpoints``: the
    re-materialization modes to try, ``"selective"`` for kept layers chosen per stage (the
    plan's ``checkpoint`` is then that choice as text, which ``checkpoint=`` takes), or a
    :class:`~gpipe_core.remat.Remat` to evaluate as given. ``balance``: a fixed split (layers per stage, e.g. one
    already running) instead of the balanced one; only layouts with ``len(balance)`` stages
    are planned. Without it, each layout's stages are balanced by their summed forward and
    backward; where a device holds several stages (interleaved, V), the balance whose
    simulated step is fastest at each M is planned beside it (every balance where there are
    at most 128, else a search moving one boundary at a time), so that a budget the ranks'
    balance exceeds still finds the other.
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
    unknown = [c for c in checkpoints if not isinstance(c, Remat)
               and c not in (*CHECKPOINTS, SELECTIVE)]
    if unknown:
        raise ValueError(f"checkpoints {unknown} unknown; choose from {[*CHECKPOINTS, SELECTIVE]}"
                         " or give a gp.Remat")
    fixed = [c for c in checkpoints if isinstance(c, Remat)]
    if fixed and balance is None:
        raise ValueError("a gp.Remat in checkpoints names layers of each stage: give the "
                         "balance it is for (balance=[...])")
    for choice in fixed:
        assert balance is not None
        choice.check(balance)
    stage_kept: Callable[[int, int], float] | None = None
    boundary_bytes: Sequence[float] | None = None
    backward_bytes: Sequence[float] | None = None
    backward_fixed: Sequence[float] | None = None
    own_saved: Sequence[float] | None = None
    gradient_bytes: Sequence[float] | None = None  # per layer: its parameters' gradients
    # per layer: its output not saved by it, which a stage ending there keeps for its backward
    output_unsaved: Sequence[float] | None = None
    saved_fixed: Sequence[float] | None = None  # per layer: what it saves at any batch size
    passthrough: Sequence[float] | None = None  # per layer: its output that is its input
    # per layer: what its forward holds while it runs only (temporaries; its input freed after)
    forward_working: tuple[Sequence[float], Sequence[float]] | None = None
    remat: dict[int, tuple[list[float], list[float]]] = {}
    if profiles:
        measured = _from_profiles(profiles)
        remat = _remat_from_profiles(profiles)
        microbatch_costs = {**measured, **(microbatch_costs or {})}
        smallest_m = min(measured)
        if forward is None or backward is None:
            forward = [smallest_m * c for c in measured[smallest_m][0]]
            backward = [smallest_m * c for c in measured[smallest_m][1]]
        if microbatches is None:
            divisors = [m for m in divisors if m in measured]
        n_layers = len(forward)
        if costs is None and memory_budget is None and activation_bytes is None:
            activation_bytes = input_bytes = param_bytes = [0.0] * n_layers
            memory_budget = float("inf")
    if costs is not None:
        if device is None:
            raise ValueError("plan(costs) needs the device the costs run on: device=gp.DEVICES"
                             "['h100_80gb'] or a gp.Device(...)")
        whole = costs.scaled(batch_size)
        if not profiles:  # with profiles, the seconds are the measured ones
            forward, backward = _compute_seconds(whole, device, 1)
            microbatch_costs = {m: _compute_seconds(whole, device, m) for m in divisors}
        elif forward is not None and len(forward) != len(whole):
            raise ValueError(f"profiles have {len(forward)} layers and costs {len(whole)}: "
                             "profile the model the costs count, one stage per layer "
                             "(balance=[1] * len(model))")
        per_parameter = bytes_per_parameter(optimizer)
        param_bytes = [count * per_parameter for count in whole.param_count]
        activation_bytes = [s + i for s, i in
                            zip(whole.saved_bytes, whole.saved_input_bytes, strict=True)]
        input_bytes = whole.input_bytes
        stage_kept = whole.kept_bytes
        boundary_bytes = whole.output_bytes
        backward_bytes = whole.backward_bytes or None  # None: costs counted before the field
        backward_fixed = whole.backward_fixed_bytes or [0.0] * len(whole.backward_bytes)
        own_saved = whole.saved_bytes
        gradient_bytes = whole.param_bytes  # a gradient has its weight's dtype and size
        output_unsaved = whole.output_unsaved_bytes or None  # None: counted before the field
        passthrough = whole.output_passthrough_bytes or None
        if whole.forward_working_bytes:  # counted before the fields: not modelled
            forward_working = (whole.forward_working_bytes, whole.input_freed_bytes)
        saved_fixed = whole.saved_fixed_bytes or None
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
                    microbatch_costs=microbatch_costs, microbatch_remat=remat,
                    backward_weight=backward_weight,
                    backward_input=backward_input, checkpoints=checkpoints, stage_kept=stage_kept,
                    boundary_bytes=boundary_bytes, backward_bytes=backward_bytes,
                    backward_fixed=backward_fixed, own_saved=own_saved,
                    gradient_bytes=gradient_bytes, output_unsaved=output_unsaved,
                    saved_fixed=saved_fixed, passthrough=passthrough,
                    forward_working=forward_working, device=device, balance=balance)
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
    microbatch_remat: Mapping[int, tuple[Sequence[float], Sequence[float]]] | None = None,
    backward_input: Sequence[float] | None,
    checkpoints: Sequence[str | Remat],
    stage_kept: Callable[[int, int], float] | None,
    boundary_bytes: Sequence[float] | None,
    device: Device | None,
    balance: Sequence[int] | None = None,
    backward_bytes: Sequence[float] | None = None,
    backward_fixed: Sequence[float] | None = None,
    own_saved: Sequence[float] | None = None,
    gradient_bytes: Sequence[float] | None = None,
    output_unsaved: Sequence[float] | None = None,
    saved_fixed: Sequence[float] | None = None,
    passthrough: Sequence[float] | None = None,
    forward_working: tuple[Sequence[float], Sequence[float]] | None = None,
) -> tuple[list[Plan], float]:
    """The plans that fit of schedule ``name`` with ``k * v`` stages on ``k`` devices, and
    the smallest peak memory of any of its configurations (fitting or not).

    With ``gradient_bytes`` (per layer; counted costs), a rank's parameter gradients count from
    its first backward on, as they are made (``param_bytes`` includes them: the plan's
    ``activation_bytes`` is the rest of the peak), and a rank holds the receives the transport
    posts early: a peak before the first backward has no gradients in it. With
    ``output_unsaved`` (per layer), a stage that sends its output and runs its last layer with
    autograd keeps that output for its backward, per micro-batch in flight, where its last
    layer did not save it already. ``saved_fixed`` (per layer): the part of the saved bytes
    that every micro-batch keeps whole, whatever its size (per-channel statistics).
    ``forward_working`` (per layer: its forward's temporaries, and the part of its input freed
    once it returns): what a re-materialized run's rerun holds beyond its rebuilt activations
    while each layer runs again, inside the backward."""
    num_stages = k * v

    def per_stage(values: Sequence[float], a: int, b: int) -> float:
        return float(sum(values[a:b]))

    def seconds(stages: Sequence[tuple[int, int]], m: int) -> _StageSeconds:
        """Each stage's seconds per micro-batch of ``m`` (forward, backward and its halves
        where split, a re-materialized forward's parts), each boundary's transfer and each
        message end's compute."""
        def share(part: Sequence[float] | None, bwd: Sequence[float]) -> list[float] | None:
            """A half of each stage's backward when split: its whole-batch share of it."""
            if part is None:
                return None
            return [cost * (per_stage(part, a, b) / per_stage(backward, a, b)
                            if per_stage(backward, a, b) > 0 else 0.5)
                    for cost, (a, b) in zip(bwd, stages, strict=True)]

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
        links: float | list[float] = transfer
        copies: float | list[float] = 0.0  # each end's compute per message (a CPU transport)
        if boundary_bytes is not None and device is not None:
            links = [transfer + device.transfer_seconds(boundary_bytes[b - 1] / m)
                     for _, b in stages[:-1]]
            copies = [device.message_cpu_seconds(boundary_bytes[b - 1] / m)
                      for _, b in stages[:-1]]
        layer_remat = (microbatch_remat or {}).get(m)
        return _StageSeconds(
            fwd, bwd, inp, wgt, links, copies,
            None if layer_remat is None else [per_stage(layer_remat[0], a, b)
                                              for a, b in stages],
            None if layer_remat is None else [per_stage(layer_remat[1], a, b)
                                              for a, b in stages])

    if balance is not None:
        balances = [list(balance)]
    else:
        balances = [list(optimal_balance([f + b for f, b in zip(forward, backward, strict=True)],
                                         num_stages))]
        if v > 1:  # stages share a rank: a balance of the stages need not balance the ranks
            modes = sorted({c if c in CHECKPOINTS else mode for c in checkpoints
                            if not isinstance(c, Remat) for mode in ("never", "always")})
            for m in divisors:
                try:
                    actions = get_schedule(name, num_stages, m, num_ranks=k)
                except ValueError:
                    continue
                for mode in modes:
                    def step_time(candidate: Sequence[int], m: int = m,
                                  actions: Schedule = actions, mode: str = mode) -> float:
                        return seconds(_stages_of(candidate), m).simulate(actions, mode)
                    found = _fastest_balance(balances[0], step_time)
                    if found not in balances:
                        balances.append(found)

    plans = []
    smallest = float("inf")
    for balance in balances:
        stages = _stages_of(balance)
        for m in divisors:
            timing = seconds(stages, m)
            fwd, bwd, inp, wgt = timing.forward, timing.backward, timing.inp, timing.wgt
            links, copies = timing.links, timing.copies
            outputs_kept = [0.0 if output_unsaved is None or b == len(forward)
                            else output_unsaved[b - 1] / m for _, b in stages]
            fixed = [0.0] * len(forward) if saved_fixed is None else list(saved_fixed)
            acts = [(stage_kept(a, b) if stage_kept is not None
                     else per_stage(activation_bytes, a, b)) / m + held_out
                    + per_stage(fixed, a, b) * (1 - 1 / m)
                    for (a, b), held_out in zip(stages, outputs_kept, strict=True)]
            inputs = [input_bytes[a] / m for a, _ in stages]
            # the messages a rank holds once sent (counted where the sizes come from costs)
            outputs = (None if boundary_bytes is None
                       else [boundary_bytes[b - 1] / m for _, b in stages])
            params = [per_stage(param_bytes, a, b) for a, b in stages]
            grads = (None if gradient_bytes is None
                     else [per_stage(gradient_bytes, a, b) for a, b in stages])
            try:
                actions = get_schedule(name, num_stages, m, num_ranks=k)
            except ValueError:  # this M does not suit the schedule (DualPipeV: M < 2K)
                continue
            on_rank = [actions.stages_on(r) for r in range(k)]
            held = [sum(params[s] for s in mine) for mine in on_rank]
            # the gradients a rank makes during its step: counted by the simulation, as made
            rank_grads = [0.0 if grads is None else sum(grads[s] for s in mine) for mine in on_rank]
            layer_forward = (list(microbatch_costs[m][0]) if m in microbatch_costs
                             else [f / m for f in forward])
            # a re-materialized micro-batch's first forward (without autograd) and the rerun its
            # backward adds: as measured where a profile of this M measured them, else each the
            # forward with autograd
            layer_remat = (microbatch_remat or {}).get(m)
            selective = _Selective(  # held throughout: the parameters less the step's gradients
                stages, actions, on_rank, [h - g for h, g in zip(held, rank_grads, strict=True)],
                layer_forward,
                _per_microbatch(activation_bytes, fixed, m), [i / m for i in input_bytes],
                [0.0] * len(forward) if backward_bytes is None or backward_fixed is None else [
                    b / m + fixed for b, fixed in zip(backward_bytes, backward_fixed, strict=True)],
                [0.0] * len(forward) if boundary_bytes is None else [o / m for o in boundary_bytes],
                None if own_saved is None else _per_microbatch(own_saved, fixed, m),
                dict(forward=fwd, backward=bwd, backward_input=inp, backward_weight=wgt,
                     transfer=links, activation_bytes=acts, input_bytes=inputs,
                     output_bytes=outputs, gradient_bytes=grads,
                     posted_receives=grads is not None, inputs_held=grads is not None,
                     message_cpu=copies), layer_remat,
                gradient_bytes,
                outputs_kept, None if passthrough is None else [p / m for p in passthrough],
                None if output_unsaved is None or boundary_bytes is None else [
                    (o - u) / m for o, u in zip(boundary_bytes, output_unsaved, strict=True)],
                None if forward_working is None else (
                    [w / m for w in forward_working[0]], [f / m for f in forward_working[1]]))
            for checkpoint in checkpoints:
                if checkpoint == SELECTIVE or isinstance(checkpoint, Remat):
                    if isinstance(checkpoint, Remat):
                        keep = [{a + i for i in layers} for layers, (a, _) in
                                zip(checkpoint.keep, stages, strict=True)]
                    else:
                        keep = selective.choose(memory_budget)
                    sim, kept = selective.evaluate(keep)
                    kept = [x - g for x, g in zip(kept, rank_grads, strict=True)]
                    peak = max(h + x for h, x in zip(held, kept, strict=True))
                    smallest = min(smallest, peak)
                    if peak <= memory_budget:
                        choice = Remat([{i - a for i in layers} for layers, (a, _) in
                                        zip(keep, stages, strict=True)])
                        plans.append(Plan(num_stages, m, str(choice), balance, sim.step_time,
                                          sim.bubble_fraction, peak, name, k, held, kept))
                    continue
                # During a backward: one micro-batch's rebuilt activations if re-materialized (a
                # split backward's I keeps them until W; the simulation counts that), and the
                # backward's own gradients and temporaries.
                every = [set(range(a, b)) if checkpoint == "never" else set() for a, b in stages]
                working = [selective.working(s, every[s]) for s in range(len(stages))]
                first_working = (None if grads is None else
                                 [selective.working(s, every[s], first=True)
                                  for s in range(len(stages))])
                sim = simulate(actions, fwd, bwd, backward_input=inp, backward_weight=wgt,
                               transfer=links, checkpoint=checkpoint,
                               forward_no_grad=timing.forward_no_grad,
                               recompute=timing.recompute,
                               activation_bytes=acts,
                               input_bytes=inputs, output_bytes=outputs, gradient_bytes=grads,
                               backward_working_bytes=working,
                               first_backward_working_bytes=first_working,
                               posted_receives=grads is not None,
                               inputs_held=grads is not None, message_cpu=copies)
                kept = [x - g for x, g in zip(sim.peak_bytes, rank_grads, strict=True)]
                peak = max(h + a for h, a in zip(held, kept, strict=True))
                smallest = min(smallest, peak)
                if peak <= memory_budget:
                    plans.append(Plan(num_stages, m, checkpoint, balance, sim.step_time,
                                      sim.bubble_fraction, peak, name, k, held, kept))
    return plans, smallest


@dataclass(frozen=True)
class _StageSeconds:
    """One balance's costs at one M: per stage, seconds per micro-batch of the forward, the
    backward and its halves where split (``inp``: I, ``wgt``: W), a re-materialized forward
    without autograd and its rerun; per boundary, the transfer and each message end's
    compute."""

    forward: list[float]
    backward: list[float]
    inp: list[float] | None
    wgt: list[float] | None
    links: float | list[float]
    copies: float | list[float]
    forward_no_grad: list[float] | None
    recompute: list[float] | None

    def simulate(self, actions: Schedule, checkpoint: str) -> float:
        """The simulated step time of ``actions`` at these costs (time only)."""
        return simulate(actions, self.forward, self.backward, backward_input=self.inp,
                        backward_weight=self.wgt, transfer=self.links, checkpoint=checkpoint,
                        forward_no_grad=self.forward_no_grad, recompute=self.recompute,
                        message_cpu=self.copies).step_time


def _stages_of(balance: Sequence[int]) -> list[tuple[int, int]]:
    """Each stage's first and past-last layer for layers per stage ``balance``."""
    bounds = list(itertools.accumulate(balance, initial=0))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


# Every balance is simulated where a layout has at most this many; above it, a local search
_BALANCE_SEARCH = 128


def _fastest_balance(start: Sequence[int], step_time: Callable[[Sequence[int]], float]
                     ) -> list[int]:
    """The balance (layers per stage, the same layers and stages as ``start``) of the fastest
    ``step_time``: every one where there are at most :data:`_BALANCE_SEARCH`; else, from
    ``start``, the best move of one boundary by one layer while it makes the step faster. The
    first of equals in that order (``start`` first) wins."""
    layers, count = sum(start), len(start)
    best, best_time = list(start), step_time(start)
    if math.comb(layers - 1, count - 1) <= _BALANCE_SEARCH:
        for cuts in itertools.combinations(range(1, layers), count - 1):
            candidate = [b - a for a, b in zip((0, *cuts), (*cuts, layers), strict=True)]
            seconds = step_time(candidate)
            if seconds < best_time * (1 - 1e-9):
                best, best_time = candidate, seconds
        return best
    while True:
        moves = []
        for i in range(count - 1):
            for shift in (-1, 1):
                candidate = list(best)
                candidate[i] += shift
                candidate[i + 1] -= shift
                if min(candidate[i], candidate[i + 1]) >= 1:
                    moves.append((step_time(candidate), candidate))
        if not moves:
            return best
        seconds, candidate = min(moves, key=lambda move: move[0])
        if seconds >= best_time * (1 - 1e-9):
            return best
        best, best_time = candidate, seconds


def _per_microbatch(values: Sequence[float], fixed: Sequence[float], m: int) -> list[float]:
    """Saved bytes per layer for one of ``m`` micro-batches: a share of the batch's part that
    grows with it, and the ``fixed`` part whole."""
    return [(v - f) / m + f for v, f in zip(values, fixed, strict=True)]


# Stages of at most this many layers try every choice of their kept layers (2^n evaluations)
_SUBSET_SEARCH = 8


class _Selective:
    """One configuration's per-layer sizes and costs, to evaluate and choose kept layers."""

    def __init__(self, stages: Sequence[tuple[int, int]], actions: Schedule,
                 on_rank: Sequence[Sequence[int]], held: Sequence[float],
                 layer_forward: Sequence[float], layer_bytes: Sequence[float],
                 layer_inputs: Sequence[float], layer_backward: Sequence[float],
                 layer_outputs: Sequence[float], layer_own: Sequence[float] | None,
                 simulate_kwargs: dict[str, Any],
                 layer_remat: tuple[Sequence[float], Sequence[float]] | None = None,
                 layer_grads: Sequence[float] | None = None,
                 outputs_kept: Sequence[float] | None = None,
                 layer_passthrough: Sequence[float] | None = None,
                 layer_saved_outputs: Sequence[float] | None = None,
                 layer_forward_working: tuple[Sequence[float], Sequence[float]] | None = None
                 ) -> None:
        self.stages = list(stages)
        self.actions = actions
        self.on_rank = on_rank
        self.held = held  # per rank: parameter bytes
        self.layer_forward = layer_forward  # per layer: one micro-batch's forward seconds
        # per layer: a recomputed layer's first forward (without autograd) and what its rerun
        # adds to the backward; each the forward with autograd where not measured
        self.layer_no_grad = layer_forward if layer_remat is None else layer_remat[0]
        self.layer_recompute = layer_forward if layer_remat is None else layer_remat[1]
        self.layer_bytes = layer_bytes  # per layer: activations kept for one micro-batch
        self.layer_inputs = layer_inputs  # per layer: its input, one micro-batch
        # per layer: what its backward holds at once beyond what was saved (the gradient it
        # receives, temporaries, its input's gradient), one micro-batch
        self.layer_backward = layer_backward
        self.layer_outputs = layer_outputs  # per layer: its output, one micro-batch
        # per layer: what it saves of its own making (not its inputs), one micro-batch
        self.layer_own = layer_own
        # per stage: the output it keeps for its backward when its last layer is kept
        self.outputs_known = outputs_kept is not None
        self.outputs_kept = list(outputs_kept or [0.0] * len(self.stages))
        self.layer_grads = layer_grads  # per layer: its parameters' gradients (None: not counted)
        # per layer: the part of its output that is its input passed on, one micro-batch
        self.layer_passthrough = layer_passthrough
        # per layer: the part of its output it saved for its own backward, one micro-batch
        self.layer_saved_outputs = layer_saved_outputs
        # per layer: its forward's temporaries, and its input freed once it returns, one
        # micro-batch (None: not counted)
        self.layer_forward_working = layer_forward_working
        self.simulate_kwargs = simulate_kwargs

    def _runs(self, s: int, keep: set[int]) -> list[list[int]]:
        """Stage s's maximal runs of kept or of recomputed layers (global indices), in order:
        the runs the stage's selective forward and backward go through."""
        a, b = self.stages[s]
        runs: list[list[int]] = []
        for i in range(a, b):
            if runs and (runs[-1][-1] in keep) == (i in keep):
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def kept_bytes(self, s: int, keep: set[int]) -> float:
        """One micro-batch's bytes kept by stage s: its kept layers' activations and the input
        of each recomputed run (the stage's input counts in its first layer's activations when
        that is kept: keeping all is ``"never"``'s size, keeping none ``"always"``'s). Where
        the layers' own saved bytes are known (costs counted on meta), a run of kept layers
        holds its whole input too, not only what its first layer saves of it (a cell that
        reads the two previous outputs saves neither whole). A run's input is the previous
        layer's output: what of it that layer saved (a kept layer) or passed on from its own
        input (counted whole where the previous run is that one layer) is counted once."""
        a, b = self.stages[s]
        output = self.outputs_kept[s] if b - 1 in keep else 0.0  # a kept last run's outputs
        if self.layer_own is None:
            return (sum(self.layer_bytes[i] for i in keep if a <= i < b)
                    + sum(self.layer_inputs[run[0]] for run in self._runs(s, keep)
                          if run[0] not in keep)) + output
        total = output
        previous: list[int] = []
        for run in self._runs(s, keep):
            total += self.layer_inputs[run[0]]
            shared = 0.0  # of this input, what the previous run holds already
            if previous and previous[-1] in keep and self.layer_saved_outputs is not None:
                shared = self.layer_saved_outputs[previous[-1]]
            if len(previous) == 1 and self.layer_passthrough is not None:
                shared = max(shared, self.layer_passthrough[previous[0]])
            total -= shared
            previous = run
            if run[0] in keep:  # its layers' activations, its first one's inputs counted above
                total += sum(self.layer_bytes[i] for i in run) - (
                    self.layer_bytes[run[0]] - self.layer_own[run[0]])
        return total

    def working(self, s: int, keep: set[int], first: bool = False) -> float:
        """What stage s's backward of one micro-batch adds to what its micro-batches keep, at
        its largest. The stage goes back through its runs (maximal runs of kept or of
        recomputed layers, last first), one autograd pass each, which holds the run's output
        and the gradient it received throughout (and the stage's received gradient is held
        until the stage's backward ends); going back layer by layer, a recomputed run's
        rebuilt activations up to the layer (a fused backward rebuilds one run at a time and
        frees each layer's as it passes it; a split backward's I keeps them all until W, which
        the simulation counts), and the layer's own backward (the gradient it receives,
        temporaries, its parameters' fresh gradients, its input's gradient); less what the
        kept layers it has passed saved of their own making (their intermediates and outputs,
        which only later layers read: all passed by then). Before a recomputed run's backward,
        its forward runs again (:meth:`_rerun`): a layer whose forward holds temporaries beside
        what it leaves (an AmoebaNet cell's concatenation) can make that the larger moment.
        What they saved of their inputs is not subtracted (an earlier layer may still hold it:
        AmoebaNet's cells read the two previous outputs), nor what the stage's last layer saved
        of its output (held to the end; all it saved where that is not known), so the count
        stays an upper bound; it may be negative (the kept bytes it adds to count the whole
        micro-batch). ``first``: the stage's first backward, whose gradients stay: while a
        layer's backward runs, the stage also holds the gradients its later layers made."""
        a, b = self.stages[s]
        runs = self._runs(s, keep)
        # what the kept layers from i on saved of their own making; of the stage's last, only
        # what is not its output (the stage holds that to its backward's end), all of it if
        # which outputs it saved is not known
        own = [self.layer_own[i] if self.layer_own is not None and i in keep and i < b - 1
               else 0.0 for i in range(a, b)]
        if self.layer_own is not None and b - 1 in keep and self.outputs_known:
            last_stage = s == len(self.stages) - 1  # it ends in the loss: a scalar
            saved_output = 0.0 if last_stage else max(
                self.layer_outputs[b - 1] - self.outputs_kept[s], 0.0)
            own[-1] = max(self.layer_own[b - 1] - saved_output, 0.0)
        passed_from = [sum(own[j - a:]) for j in range(a, b + 1)]
        # in the first backward, the gradients the later layers made, held while layer j's
        # backward runs (layer j's own are in its count, layer_backward, as it makes them)
        made_from = [sum(self.layer_grads[j + 1:b]) if first and self.layer_grads is not None
                     else 0.0 for j in range(a, b)]
        most = -float("inf")
        for run in runs:
            last = run[-1]
            rebuilt = last not in keep and not self.actions.splits_backward
            # the gradient the stage received is held until its backward ends
            stage_received = 0.0 if last == b - 1 else self.layer_outputs[b - 1]
            if last not in keep:
                most = max(most, self._rerun(run) + self.layer_outputs[last]
                           + stage_received - passed_from[last + 1 - a] + made_from[last - a])
            partial = 0.0
            for i in run:
                partial += self.layer_bytes[i] if rebuilt else 0.0
                # the run's received gradient, in the layer's own count at the run's end
                received = 0.0 if i == last else self.layer_outputs[last]
                most = max(most, partial + self.layer_backward[i] + self.layer_outputs[last]
                           + received + stage_received - passed_from[i + 1 - a]
                           + made_from[i - a])
        return most

    def _rerun(self, run: list[int]) -> float:
        """The most a recomputed run's rerun (the forward again, inside its backward) holds at
        once beyond the run's input (kept apart): as each layer runs, the activations rebuilt
        so far, its output (less what it saves of it), its temporaries and its input where
        freed after it. Zero where the forward's temporaries are not known."""
        if self.layer_forward_working is None or self.layer_saved_outputs is None:
            return 0.0
        temporaries, freed = self.layer_forward_working
        rebuilt = most = 0.0
        for i in run:
            # the run's first layer: what it saves of its own (the run's input is kept apart)
            rebuilt += (self.layer_own[i] if i == run[0] and self.layer_own is not None
                        else self.layer_bytes[i])
            most = max(most, rebuilt + self.layer_outputs[i] - self.layer_saved_outputs[i]
                       + temporaries[i] + (freed[i] if i != run[0] else 0.0))
        return most

    def evaluate(self, keep: Sequence[set[int]]) -> tuple[Simulation, list[float]]:
        """The simulation of this choice and each rank's peak above its parameters."""
        recompute = [sum(self.layer_recompute[i] for i in range(a, b) if i not in keep[s])
                     for s, (a, b) in enumerate(self.stages)]
        # the first forward: kept layers with autograd, recomputed ones without
        first_pass = [
            f - sum(self.layer_forward[i] - self.layer_no_grad[i]
                    for i in range(a, b) if i not in keep[s])
            for f, (s, (a, b)) in zip(self.simulate_kwargs["forward"], enumerate(self.stages),
                                      strict=True)]
        sim = simulate(self.actions, checkpoint="always", recompute=recompute,
                       forward_no_grad=first_pass,
                       kept_bytes=[self.kept_bytes(s, keep[s]) for s in range(len(self.stages))],
                       backward_working_bytes=[self.working(s, keep[s])
                                               for s in range(len(self.stages))],
                       first_backward_working_bytes=None if self.layer_grads is None else [
                           self.working(s, keep[s], first=True)
                           for s in range(len(self.stages))],
                       **self.simulate_kwargs)
        return sim, sim.peak_bytes

    def choose(self, budget: float) -> list[set[int]]:
        """Kept layers per stage: the best of two greedy passes (layers recomputed by bytes
        freed per second of recomputation, or by bytes alone) and of recomputing everything,
        then improved while that is faster and fits by keeping one more layer, or by keeping a
        recomputed layer in place of a kept one of the same stage; then, stage by stage, a
        stage of at most ``_SUBSET_SEARCH`` layers tries every choice of its own kept layers
        with the others' fixed (a swap of two layers at once is out of the single moves' reach
        where each half alone does not fit or is slower)."""
        options = [self._greedy(budget, per_second) for per_second in (True, False)]
        options.append([set() for _ in self.stages])  # recompute everything (as "always")
        scored = [(self._step_if_fits(keep, budget), index) for index, keep in enumerate(options)]
        time, best = min(scored)
        keep = options[best]
        if time == float("inf"):
            return keep  # nothing fits: the caller finds it over the budget
        budget_left = 200 * len(self.stages)  # evaluations for the improvements
        improved = True
        while improved and budget_left > 0:
            improved = False
            for s, (a, b) in enumerate(self.stages):
                moves = [(i, None) for i in range(a, b)] + list(
                    itertools.product(range(a, b), repeat=2))
                for i, j in moves:
                    if i in keep[s] or (j is not None and j not in keep[s]) or budget_left <= 0:
                        continue
                    trial = [set(layers) for layers in keep]
                    trial[s] = (trial[s] - {j}) | {i}
                    budget_left -= 1
                    trial_time = self._step_if_fits(trial, budget)
                    if trial_time < time * (1 - 1e-9):
                        keep, time, improved = trial, trial_time, True
        improved = True
        while improved:
            improved = False
            for s, (a, b) in enumerate(self.stages):
                if b - a > _SUBSET_SEARCH:
                    continue
                for size in range(b - a + 1):
                    for layers in itertools.combinations(range(a, b), size):
                        trial = [set(kept) for kept in keep]
                        trial[s] = set(layers)
                        trial_time = self._step_if_fits(trial, budget)
                        if trial_time < time * (1 - 1e-9):
                            keep, time, improved = trial, trial_time, True
        return keep

    def _step_if_fits(self, keep: Sequence[set[int]], budget: float) -> float:
        sim, kept = self.evaluate(keep)
        fits = all(h + x <= budget for h, x in zip(self.held, kept, strict=True))
        return sim.step_time if fits else float("inf")

    def _greedy(self, budget: float, per_second: bool) -> list[set[int]]:
        """Keep everything; while a device is over the budget, recompute its layer that frees
        the most bytes at its peak (per second of recomputation if ``per_second``); then keep
        again, largest forward first, every recomputed layer the budget still allows."""
        keep = [set(range(a, b)) for a, b in self.stages]
        rank_of = {s: r for r, mine in enumerate(self.on_rank) for s in mine}
        removed: list[int] = []
        while True:
            sim, kept = self.evaluate(keep)
            over = [r for r, x in enumerate(kept) if self.held[r] + x > budget]
            if not over:
                break
            best: tuple[float, int, int] | None = None
            for s in range(len(self.stages)):
                if rank_of[s] not in over:
                    continue
                # bytes at the peak: this stage's micro-batches in flight at once, and its
                # backward's working bytes (one recomputed run rebuilt at a time)
                inflight = sim.peak_inflight[rank_of[s]]

                def at_peak(layers: set[int], s: int = s, inflight: int = inflight) -> float:
                    return inflight * self.kept_bytes(s, layers) + self.working(s, layers)

                before = at_peak(keep[s])
                for i in sorted(keep[s]):
                    ratio = before - at_peak(keep[s] - {i})
                    if ratio < 0:
                        continue
                    if per_second:
                        ratio /= max(self.layer_recompute[i], 1e-30)
                    if best is None or ratio > best[0]:
                        best = (ratio, s, i)
            if best is None:
                return keep  # recomputing any one more layer frees nothing
            _, s, i = best
            keep[s].discard(i)
            removed.append(i)
        stage_of = {i: s for s, (a, b) in enumerate(self.stages) for i in range(a, b)}
        for i in sorted(removed, key=lambda j: -self.layer_forward[j]):
            keep[stage_of[i]].add(i)
            _, kept = self.evaluate(keep)
            if any(h + x > budget for h, x in zip(self.held, kept, strict=True)):
                keep[stage_of[i]].discard(i)
        return keep


def _compute_seconds(whole: LayerCosts, device: Device, m: int
                     ) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per layer of one micro-batch of ``whole`` / ``m``: its
    FLOPs and traffic split ``m`` ways, the operator calls and the traffic that does not grow
    with the batch not (costs counted before the traffic fields: no traffic)."""
    n = len(whole)

    def seconds(flops: list[float], ops: list[int], traffic: list[float],
                fixed: list[float]) -> list[float]:
        traffic, fixed = traffic or [0.0] * n, fixed or [0.0] * n
        return [device.compute_seconds(f / m, calls, t / m + t0)
                for f, calls, t, t0 in zip(flops, ops, traffic, fixed, strict=True)]

    return (seconds(whole.forward_flops, whole.forward_ops, whole.forward_traffic_bytes,
                    whole.forward_traffic_fixed_bytes),
            seconds(whole.backward_flops, whole.backward_ops, whole.backward_traffic_bytes,
                    whole.backward_traffic_fixed_bytes))


def _remat_from_profiles(profiles: Sequence[StageProfile]
                         ) -> dict[int, tuple[list[float], list[float]]]:
    """Per M, each layer's forward without autograd (a re-materialized micro-batch's first
    pass) and what the rerun adds to its backward, from a profile of that M that measured
    them (``checkpoint`` other than ``"never"``); a profile that ran none gives the forward
    with autograd for both."""
    result: dict[int, tuple[list[float], list[float]]] = {}
    for profile in sorted(profiles, key=lambda p: p.checkpoint == "never"):
        result.setdefault(profile.num_microbatches,
                          (list(profile.forward_no_grad), list(profile.recompute)))
    return result


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
