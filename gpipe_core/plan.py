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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .partition import optimal_balance
from .schedule import SCHEDULE_NAMES, get_schedule
from .simulate import simulate

__all__ = ["Plan", "plan"]


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
    *,
    forward: Sequence[float],
    backward: Sequence[float],
    activation_bytes: Sequence[float],
    input_bytes: Sequence[float],
    param_bytes: Sequence[float],
    batch_size: int,
    max_stages: int,
    memory_budget: float,
    schedule: str | Sequence[str] = "gpipe",
    virtual_stages: Sequence[int] = (2,),
    per_action_overhead: float = 0.0,
    transfer: float = 0.0,
    min_microbatch: int = 1,
    microbatch_costs: Mapping[int, tuple[Sequence[float], Sequence[float]]] | None = None,
    backward_weight: Sequence[float] | None = None,
) -> list[Plan]:
    """All feasible plans, fastest first; raises if none fits ``memory_budget`` bytes.

    ``microbatch_costs[M] = (forward, backward)``: per-layer seconds of one micro-batch when
    the batch is split in M, used for that M instead of the whole-batch cost / M + overhead.
    ``schedule``: any name :func:`~gpipe_core.schedule.get_schedule` knows, or several (the
    plans of all of them compete; ``"all"``: every built-in one). ``"interleaved_1f1b"`` and
    ``"interleaved_zb"`` are tried with each V of ``virtual_stages`` stages per device, ``"zb_v"`` and ``"dualpipe_v"``
    with 2. For schedules
    that split the backward (``"zb_h1"``, ``"zb_h2"``, ``"zb_v"``), ``backward_weight`` gives
    each layer's part of ``backward`` spent on parameter gradients (W; the rest is I); without
    it, half.
    """
    if schedule == "all":
        names = [name for name in SCHEDULE_NAMES if name not in ("fill_drain", "one_f_one_b",
                                                                  "1f1b_slackN")]
    else:
        names = [schedule] if isinstance(schedule, str) else list(schedule)
    layouts = [(name, v) for name in names
               for v in (virtual_stages if name in ("interleaved_1f1b", "interleaved_zb") else
                         (2,) if name in ("zb_v", "dualpipe_v") else (1,))]
    n = len(forward)
    microbatch_costs = dict(microbatch_costs or {})
    for m, (f, b) in microbatch_costs.items():
        if len(f) != n or len(b) != n:
            raise ValueError(f"microbatch_costs[{m}] has {len(f)} forward and {len(b)} backward "
                             f"costs for {n} layers; give one per layer")
    if not (len(backward) == len(activation_bytes) == len(input_bytes) == len(param_bytes) == n):
        raise ValueError("give forward, backward, activation_bytes, input_bytes and param_bytes "
                         "for every layer (equal lengths)")
    if backward_weight is not None and len(backward_weight) != n:
        raise ValueError(f"backward_weight has {len(backward_weight)} values for {n} layers")
    plans = []
    for k in range(1, max_stages + 1):
        for name, v in layouts:
            if k * v <= n:
                plans += _plans_for(name, k, v, forward=forward, backward=backward,
                                    activation_bytes=activation_bytes, input_bytes=input_bytes,
                                    param_bytes=param_bytes, batch_size=batch_size,
                                    memory_budget=memory_budget,
                                    per_action_overhead=per_action_overhead, transfer=transfer,
                                    min_microbatch=min_microbatch,
                                    microbatch_costs=microbatch_costs,
                                    backward_weight=backward_weight)
    if not plans:
        raise ValueError(
            f"no plan fits {memory_budget / 2**30:.2f} GiB per device with up to {max_stages} "
            "stages; allow more stages, a smaller batch, or a larger budget"
        )
    return sorted(plans, key=lambda p: (p.step_time, p.peak_bytes))


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
    batch_size: int,
    memory_budget: float,
    per_action_overhead: float,
    transfer: float,
    min_microbatch: int,
    microbatch_costs: Mapping[int, tuple[Sequence[float], Sequence[float]]],
    backward_weight: Sequence[float] | None,
) -> list[Plan]:
    """The plans that fit of schedule ``name`` with ``k * v`` stages on ``k`` devices."""
    num_stages = k * v
    balance = list(optimal_balance([f + b for f, b in zip(forward, backward, strict=True)],
                                   num_stages))
    bounds = [sum(balance[:i]) for i in range(num_stages + 1)]
    stages = list(zip(bounds[:-1], bounds[1:], strict=True))

    def per_stage(values: Sequence[float], a: int, b: int) -> float:
        return float(sum(values[a:b]))

    plans = []
    for m in range(1, batch_size // min_microbatch + 1):
        if batch_size % m:
            continue
        if m in microbatch_costs:
            f_m, b_m = microbatch_costs[m]
            fwd = [per_stage(f_m, a, b) for a, b in stages]
            bwd = [per_stage(b_m, a, b) for a, b in stages]
        else:
            fwd = [per_stage(forward, a, b) / m + per_action_overhead for a, b in stages]
            bwd = [per_stage(backward, a, b) / m + per_action_overhead for a, b in stages]
        # W's share of each backward when split: the whole-batch costs' share of the stage.
        wgt = None if backward_weight is None else [
            cost * (per_stage(backward_weight, a, b) / per_stage(backward, a, b)
                    if per_stage(backward, a, b) > 0 else 0.5)
            for cost, (a, b) in zip(bwd, stages, strict=True)
        ]
        acts = [per_stage(activation_bytes, a, b) / m for a, b in stages]
        inputs = [input_bytes[a] / m for a, _ in stages]
        params = [per_stage(param_bytes, a, b) for a, b in stages]
        try:
            actions = get_schedule(name, num_stages, m, num_ranks=k)
        except ValueError:  # this M does not suit the schedule (DualPipeV: M < 2K)
            continue
        on_rank = [actions.stages_on(r) for r in range(k)]
        for checkpoint in ("never", "except_last", "always"):
            sim = simulate(actions, fwd, bwd, backward_weight=wgt, transfer=transfer,
                           checkpoint=checkpoint, activation_bytes=acts, input_bytes=inputs)
            # Re-materializing needs one micro-batch's full activations during backward
            # (a split backward's I keeps them until W; the simulation counts that).
            rebuilt = checkpoint != "never" and not actions.splits_backward
            peak = max(sum(params[s] for s in mine) + sim.peak_bytes[r]
                       + (max(acts[s] for s in mine) if rebuilt else 0.0)
                       for r, mine in enumerate(on_rank))
            if peak <= memory_budget:
                plans.append(Plan(num_stages, m, checkpoint, balance, sim.step_time,
                                  sim.bubble_fraction, peak, name, k))
    return plans
