"""Measuring the per-stage costs :func:`~gpipe_core.simulator.simulate` and
:func:`~gpipe_core.planner.plan` take, by replaying each rank's own actions.

:func:`profile_stages` cuts an ``nn.Sequential`` by ``balance`` into the same
:class:`~gpipe_core.stage.Stage` objects the pipelines run, captures every message a step
sends (each stage's input and the gradient of its output, per micro-batch) from one step run
stage by stage, and then replays each rank's row of the schedule through the runtime the
pipelines use (:class:`~gpipe_core.runtime.StageRuntime`), over a transport that hands each
receive its captured message at once and drops the sends (a message between two ranks is
packed and unpacked as :class:`~gpipe_core.DistributedGPipe`'s transport does, so those copies
count; the single-process ``GPipe`` makes none). Each action is timed as it runs in
the order the rank runs it: a forward between the backwards of other micro-batches finds the
caches as the pipeline leaves them, re-materialized micro-batches run without autograd and
recompute in their backward, a split backward's I and W each pay what they cost, and the
runtime's own per-action work is inside. What a replay leaves out is the waiting for
neighbours (the simulator's part) and the transfers (give ``transfer``: seconds per boundary,
measured with a ping-pong on your links).

    profile = gp.profile_stages(model, [3, 3], inputs, targets, loss_fn=loss_fn,
                                schedule="1f1b", chunks=8)
    prediction = gp.simulate(gp.get_schedule("1f1b", 2, 8), profile)

One stage per layer (``balance=[1] * len(model)``) profiles every layer; such a profile per M
is what :func:`~gpipe_core.planner.plan` takes as ``profiles``. The module's parameters,
gradients and buffers (BatchNorm's running statistics) are as they were after profiling.
Under ``torchrun``, each rank may replay only its own row (``ranks=[rank]``) at the same
time as the others, so that cores and memory are shared as in the pipeline.

:func:`profile_timeline` takes the other route: the costs of the actions a pipeline really ran
(its timeline over a few steps, every rank's: ``DistributedGPipe.profile()`` gathers them),
each from its input's arrival to its end, so that the waiting is left to the simulator. On a
busy or shared host an action inside a running pipeline can cost more than the same action
replayed back to back (it starts after a wait, beside a neighbour's messages); these are the
costs to predict other schedules of the same pipeline with.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import wire
from .events import TimelineEvent
from .microbatch import flatten, scatter, unflatten
from .partition import split_module
from .remat import check_pipeline_args, checkpoint_stop
from .runtime import StageRuntime, StepState
from .schedule import Action, Schedule, get_schedule
from .stage import Stage
from .stage_profile import StageProfile
from .transport import Grads, Transport

__all__ = ["profile_stages", "profile_timeline"]

# Steps the replay runs under: far from a training run's, so per-layer seeds never repeat one.
_FIRST_STEP = 1 << 40


class _ReplayTransport(Transport):
    """A stage's captured messages: each receive gets its micro-batch's message at once. A
    message between two ranks is unpacked from a fresh copy of its packed buffer, and each
    send to another rank is packed and dropped: the copies the distributed transport makes on
    the compute thread are in the costs, the network is not. Between two stages of one rank
    (virtual stages) messages pass as they are, as they do there."""

    def __init__(self, activations: dict[int, Any], gradients: dict[int, Any], *,
                 device: torch.device, packed_in: tuple[bool, bool],
                 pack_out: tuple[bool, bool]) -> None:
        self.activations = activations
        self.gradients = gradients
        self.device = device
        self.packed_in = packed_in  # (activations, gradients) arrive packed
        self.pack_out = pack_out  # (activations, gradients) leave packed

    def _receive(self, message: Any, packed: bool) -> Any:
        if not packed:
            return message
        buffer = message.clone()  # the distributed transport receives into a new buffer
        payload, _ = wire.unpack(buffer, wire.read_header(buffer))
        return payload

    def _send(self, payload: Any, pack: bool) -> None:
        if pack:
            wire.pack(payload, step=0, num_microbatches=1, device=self.device)

    def send_activation(self, mb: int, payload: Any) -> None:
        self._send(payload, self.pack_out[0])

    def recv_activation(self, mb: int) -> Any:
        return self._receive(self.activations[mb], self.packed_in[0])

    def send_gradient(self, mb: int, grads: Grads, *, carry: float = math.nan) -> None:
        self._send(grads, self.pack_out[1])

    def recv_gradient(self, mb: int) -> Grads:
        return list(self._receive(self.gradients[mb], self.packed_in[1]))

    def carried(self) -> float:
        return math.nan


def profile_stages(
    module: nn.Sequential,
    balance: Sequence[int],
    inputs: Any,
    targets: Any = None,
    *,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    schedule: str | Schedule = "gpipe",
    chunks: int = 1,
    checkpoint: str = "never",
    rounds: int = 5,
    warmup: int = 1,
    ranks: Sequence[int] | None = None,
    transfer: float | Sequence[float] = 0.0,
    num_ranks: int | None = None,
    pack_messages: bool = True,
) -> StageProfile:
    """Time every action of ``schedule`` (a name or a :class:`~gpipe_core.schedule.Schedule`
    for ``len(balance)`` stages and ``chunks`` micro-batches) as each rank runs it, alone.

    ``inputs``/``targets``: one mini-batch, split into ``chunks`` micro-batches as the
    pipelines split it. ``loss_fn(output, target)`` ends the last stage (a micro-batch's
    loss); without it the last stage's output gradient is all ones (the gradient of the sum).
    ``rounds`` timed replays after ``warmup`` untimed ones. ``ranks``: the ranks whose rows
    to replay (default all, one after the other); stages on other ranks get no costs (NaN).
    ``transfer``: seconds per boundary (one number or one per boundary), recorded for the
    simulation. ``num_ranks``: devices for a schedule given by name with virtual stages.
    ``pack_messages=False``: every message passes as between two stages of one rank, unpacked,
    also where the schedule puts the stages on two ranks: per-layer costs for
    :func:`~gpipe_core.planner.plan` with ``costs`` and a ``device``, which prices each
    boundary's messages itself (:meth:`~gpipe_core.devices.Device.message_cpu_seconds`) at the
    boundaries a plan cuts, where a per-layer profile that packs would charge every layer's
    boundary.
    """
    check_pipeline_args(chunks=chunks, checkpoint=checkpoint)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds} and warmup={warmup}: give rounds >= 1, warmup >= 0")
    partitions = split_module(module, balance)
    num_stages = len(partitions)
    micro_inputs = scatter(inputs, chunks)
    m = len(micro_inputs)
    micro_targets = scatter(targets, chunks) if targets is not None else [None] * m
    if isinstance(schedule, Schedule):
        plan = schedule
        if (plan.num_stages, plan.num_microbatches) != (num_stages, m):
            raise ValueError(
                f"the schedule is for {plan.num_stages} stages and {plan.num_microbatches} "
                f"micro-batches; the profile has {num_stages} stages (balance={list(balance)}) "
                f"and {m} micro-batches (chunks={chunks}, batch of {_batch_size(inputs)})")
        name = plan.name
    else:
        plan = get_schedule(schedule, num_stages, m, num_ranks=num_ranks)
        name = schedule
    wanted = list(range(plan.num_ranks)) if ranks is None else list(ranks)
    bad = [r for r in wanted if not 0 <= r < plan.num_ranks]
    if bad:
        raise ValueError(f"ranks {bad} are not ranks of the schedule (0..{plan.num_ranks - 1})")
    links = _links(transfer, num_stages)
    device = _module_device(module)
    stages = []
    first = 0
    for index, partition in enumerate(partitions):
        stages.append(Stage(partition, stage_index=index, num_stages=num_stages,
                            first_layer_index=first, device=device, checkpoint=checkpoint,
                            seed=0, loss_fn=loss_fn if index == num_stages - 1 else None))
        first += len(partition)
    params = [p for p in module.parameters()]
    grads = [p.grad for p in params]  # set aside: the replay's gradients go to new tensors
    buffers = [b.detach().clone() for b in module.buffers()]
    for p in params:
        p.grad = None
    try:
        activations, gradients = _capture(stages, micro_inputs, micro_targets)
        transports = _replay_transports(plan, activations, gradients, device, pack_messages)
        times: list[dict[str, list[float]]] = [{} for _ in range(num_stages)]
        stop = checkpoint_stop(checkpoint, m)
        for round_index in range(warmup + rounds):
            for r in wanted:
                events = _replay(plan, r, stages, transports, gradients[-1], micro_inputs,
                                 micro_targets, _FIRST_STEP + round_index)
                if round_index >= warmup:
                    _add_round(times, events, stop)
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for b, saved in zip(module.buffers(), buffers, strict=True):
                b.copy_(saved)
    return StageProfile.from_rounds(name, m, checkpoint, times, links, rounds)


def _capture(stages: list[Stage], inputs: list[Any], targets: list[Any]
             ) -> tuple[list[dict[int, Any]], list[dict[int, Any]]]:
    """One step stage by stage: what each stage receives, per micro-batch (its input, and
    the gradient of its output)."""
    step = _FIRST_STEP - 1
    m = len(inputs)
    for stage in stages:
        stage.begin_step(step, m)
    activations: list[dict[int, Any]] = [{} for _ in stages]
    gradients: list[dict[int, Any]] = [{} for _ in stages]
    for mb in range(m):
        x = inputs[mb]
        for stage in stages:
            activations[stage.stage_index][mb] = _detached(x)
            x = stage.forward(step, mb, x, targets[mb] if stage.is_last else None)
        grad: Grads | None = None if stages[-1].loss_fn is not None else [
            torch.ones_like(t) if isinstance(t, Tensor) and t.is_floating_point() else None
            for t in flatten(x)[0]]
        if grad is not None:
            gradients[-1][mb] = grad
        for stage in reversed(stages):
            grad = [None if g is None else g.detach() for g in stage.backward(step, mb, grad)]
            if not stage.is_first:
                gradients[stage.stage_index - 1][mb] = grad
    for stage in stages:
        stage.discard(step)
    return activations, gradients


def _replay_transports(plan: Schedule, activations: list[dict[int, Any]],
                       gradients: list[dict[int, Any]], device: torch.device,
                       pack: bool = True) -> list[_ReplayTransport]:
    """One transport per stage; a boundary between two ranks carries packed messages (with
    ``pack``)."""
    num_stages = len(activations)
    crossing = [pack and plan.placement[s] != plan.placement[s + 1]
                for s in range(num_stages - 1)]
    for s in range(num_stages - 1):
        if crossing[s]:
            activations[s + 1] = {mb: _packed(x, device) for mb, x in activations[s + 1].items()}
            gradients[s] = {mb: _packed(g, device) for mb, g in gradients[s].items()}
    return [_ReplayTransport(activations[s], gradients[s], device=device,
                             packed_in=(s > 0 and crossing[s - 1],
                                        s < num_stages - 1 and crossing[s]),
                             pack_out=(s < num_stages - 1 and crossing[s],
                                       s > 0 and crossing[s - 1]))
            for s in range(num_stages)]


def profile_timeline(
    events: Sequence[TimelineEvent],
    schedule: Schedule,
    *,
    checkpoint: str,
    transfer: float | Sequence[float] = 0.0,
) -> StageProfile:
    """A :class:`StageProfile` from the actions a pipeline ran: ``events`` of whole steps of
    ``schedule`` (every stage's, in any order), ``checkpoint`` the re-materialization they ran
    with. An action's cost is ``end - ready`` (its own computation, without the wait for its
    input; ``end - start`` where ``ready`` was not recorded); each step's mean per stage and
    action kind is one round, and the profile holds the medians over the steps.
    """
    check_pipeline_args(chunks=schedule.num_microbatches, checkpoint=checkpoint)
    per_step: dict[int, int] = {}
    for row in schedule.actions:
        for action in row:
            per_step[action.stage] = per_step.get(action.stage, 0) + 1
    by_stage: dict[int, list[tuple[float, str, int, float]]] = {}
    for event in events:
        action = Action.parse(event.action)
        if not 0 <= action.stage < schedule.num_stages:
            raise ValueError(f"event {event.action!r} is of stage {action.stage}; the schedule "
                             f"has stages 0..{schedule.num_stages - 1}")
        if action.mb >= schedule.num_microbatches:
            raise ValueError(f"event {event.action!r} is of micro-batch {action.mb}; the "
                             f"schedule has {schedule.num_microbatches}: give the schedule the "
                             "pipeline ran")
        ready = event.ready if event.ready is not None else event.start
        by_stage.setdefault(action.stage, []).append(
            (event.start, action.kind, action.mb, event.end - ready))
    if not by_stage:
        raise ValueError("the timeline is empty: run steps with record=True (the default) first")
    steps = {s: len(rows) / per_step[s] for s, rows in by_stage.items()}
    if any(n != int(n) for n in steps.values()) or len(set(steps.values())) != 1:
        raise ValueError(f"the timeline holds {steps} steps per stage; give whole steps of every "
                         "stage (clear the timeline between steps of different schedules)")
    rounds = int(next(iter(steps.values())))
    stop = checkpoint_stop(checkpoint, schedule.num_microbatches)
    times: list[dict[str, list[float]]] = [{} for _ in range(schedule.num_stages)]
    for s, rows in by_stage.items():
        rows.sort()
        size = per_step[s]
        for r in range(rounds):
            _add_round(times, [(s, kind, mb, seconds)
                               for _, kind, mb, seconds in rows[r * size:(r + 1) * size]], stop)
    links = _links(transfer, schedule.num_stages)
    return StageProfile.from_rounds(schedule.name, schedule.num_microbatches, checkpoint, times,
                                    links, rounds)


def _add_round(times: list[dict[str, list[float]]], events: list[tuple[int, str, int, float]],
               stop: int) -> None:
    """Add one round's mean seconds per stage and kind (``_remat``: a re-materialized one)."""
    per_kind: dict[tuple[int, str], list[float]] = {}
    for stage_index, kind, mb, seconds in events:
        key = kind + ("_remat" if mb < stop and kind != "W" else "")
        per_kind.setdefault((stage_index, key), []).append(seconds)
    for (stage_index, key), values in per_kind.items():
        times[stage_index].setdefault(key, []).append(statistics.fmean(values))


def _replay(plan: Schedule, rank: int, stages: list[Stage], transports: list[_ReplayTransport],
            last_grads: dict[int, Grads], inputs: list[Any], targets: list[Any],
            step: int) -> list[tuple[int, str, int, float]]:
    """Run rank ``rank``'s row of ``plan``; each action's stage, kind, micro-batch, seconds.
    ``last_grads``: the last stage's output gradients (without a loss function)."""
    state = StepState(step, len(inputs), inputs=list(inputs),
                      targets=list(targets) if stages[-1].loss_fn is not None else [],
                      keep_outputs=False)
    runtimes = {s: StageRuntime(stages[s], transports[s], record=True)
                for s in plan.stages_on(rank)}
    if stages[-1].loss_fn is None and stages[-1].stage_index in runtimes:
        state.output_grads = {mb: list(g) for mb, g in last_grads.items()}
    for runtime in runtimes.values():
        runtime.begin_step(state)
    for action in plan.actions[rank]:
        runtimes[action.stage].run_action(action, state)
    for s in runtimes:
        stages[s].discard(step)
    actions = [(Action.parse(e.action), e.end - e.start)
               for runtime in runtimes.values() for e in runtime.timeline]
    return [(a.stage, a.kind, a.mb, seconds) for a, seconds in actions]


def _packed(payload: Any, device: torch.device) -> Tensor:
    buffer, _ = wire.pack(payload, step=0, num_microbatches=1, device=device)
    return buffer


def _links(transfer: float | Sequence[float], num_stages: int) -> list[float]:
    if isinstance(transfer, (int, float)):
        return [float(transfer)] * (num_stages - 1)
    links = [float(t) for t in transfer]
    if len(links) != num_stages - 1:
        raise ValueError(f"transfer has {len(links)} values for {num_stages - 1} boundaries; "
                         "give one per boundary or a single number")
    return links


def _detached(value: Any) -> Any:
    leaves, spec = flatten(value)
    return unflatten([x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor)
                      else x for x in leaves], spec)


def _module_device(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


def _batch_size(inputs: Any) -> int:
    leaves = [x for x in flatten(inputs)[0] if isinstance(x, Tensor)]
    return int(leaves[0].shape[0]) if leaves else 0
