"""Pricing the planner's shortlist by replaying each plan's stages whole.

:func:`~gpipe_core.planner.plan` prices a configuration by summing per-layer costs over each
stage. A search over many candidates (schedules, M, balances) then favours the one whose
per-layer errors flatter it most, and per-layer costs are not additive: a small stage that
shares a rank with another runs between that stage's actions and finds its caches as they left
them (measured on the NMT app: a one-layer stage 1.16-1.23x its layer's profile). :func:`refine`
takes the plans that are close to the fastest, replays each one's own stages through the
runtime (:func:`~gpipe_core.profile.profile_stages` at the plan's balance, schedule, M,
re-materialization and ranks: each action as that rank runs it, the messages between ranks
packed as the distributed transport packs them) and simulates those costs; the plans come back
fastest first by that simulation.

    plans = gp.plan(costs, device=device, profiles=per_layer, batch_size=64, stages=[2],
                    schedule="all")
    best = gp.refine(plans, model, inputs, targets, loss_fn=loss_fn, costs=costs,
                     device=device)[0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor, nn

from .costs import LayerCosts
from .devices import Device
from .microbatch import flatten
from .planner import Plan
from .profile import profile_side_by_side
from .schedule import get_schedule
from .simulator import simulate

__all__ = ["refine", "shortlist"]

TOP = 4  # plans replayed by default
WITHIN = 0.25  # and only those predicted within this fraction of the fastest


def shortlist(plans: Sequence[Plan], *, top: int = TOP, within: float | None = WITHIN
              ) -> list[Plan]:
    """The plans :func:`refine` replays: the ``top`` fastest (by ``step_time``) of those
    predicted within ``within`` (a fraction) of the fastest, each configuration once (plans
    that differ only in their predictions count once); ``within=None``: no margin."""
    if top < 1:
        raise ValueError(f"top={top}: replay at least one plan (top >= 1)")
    if within is not None and within < 0:
        raise ValueError(f"within={within} must be a fraction >= 0 (or None: no margin)")
    ordered = sorted(plans, key=lambda p: (p.step_time, p.peak_bytes))
    if not ordered:
        return []
    limit = float("inf") if within is None else ordered[0].step_time * (1 + within)
    chosen: list[Plan] = []
    seen: set[tuple[Any, ...]] = set()
    for p in ordered:
        key = _configuration(p)
        if p.step_time > limit or len(chosen) == top:
            break
        if key not in seen:
            seen.add(key)
            chosen.append(p)
    return chosen


def refine(
    plans: Sequence[Plan],
    module: nn.Sequential,
    inputs: Any,
    targets: Any = None,
    *,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    costs: LayerCosts | None = None,
    device: Device | None = None,
    transfer: float = 0.0,
    top: int = TOP,
    within: float | None = WITHIN,
    rounds: int = 5,
    warmup: int = 1,
    per_round: bool = False,
    concurrent: bool = False,
) -> list[Plan]:
    """The :func:`shortlist` of ``plans``, each re-priced by replaying its own stages, fastest
    first.

    ``module``, ``inputs`` (one mini-batch), ``targets`` and ``loss_fn`` as for
    :func:`~gpipe_core.profile.profile_stages`; the plans' replays take turns
    (:func:`~gpipe_core.profile.profile_side_by_side`: ``rounds`` timed rounds after
    ``warmup``, each replaying every plan once), so that a host whose speed drifts slows them
    alike (on a shared 2-core host one replay's simulated step moved by up to 30% from one
    replay to the next); :func:`~gpipe_core.simulator.simulate` turns the costs into the step
    time (``per_round``: the round of median step time, as there; ``concurrent``: each
    plan's ranks replayed at once, on threads, as there). Each boundary's
    transfer is ``transfer`` seconds, plus with ``costs`` (counted on ``meta``, as for
    :func:`~gpipe_core.planner.plan`) and ``device`` the device's time for the boundary's
    message. The messages' compute on the ranks is in the replay (packed and unpacked where a
    boundary crosses ranks), so nothing is added for it. A returned plan's ``step_time`` and
    ``bubble_fraction`` are the replay's; ``refined_from`` keeps the per-layer prediction;
    its memory is the planner's (a replay measures time only).
    """
    candidates = shortlist(plans, top=top, within=within)
    if not candidates:
        raise ValueError("no plans to refine: give gp.plan's list (it raises NoPlanFits "
                         "when nothing fits)")
    if (costs is None) != (device is None):
        raise ValueError("costs and device price the boundaries' messages together: give both "
                         "(as for gp.plan) or neither (then each boundary costs `transfer`)")
    layers = len(module)
    batch = _batch_size(inputs)
    whole = costs.scaled(batch) if costs is not None and batch else None
    if costs is not None and len(costs) != layers:
        raise ValueError(f"costs count {len(costs)} layers and the module has {layers}: count "
                         "the module the plans are for")
    configurations = []
    for p in candidates:
        if sum(p.balance) != layers:
            raise ValueError(f"the plan's balance {p.balance} covers {sum(p.balance)} layers "
                             f"and the module has {layers}: refine the plans of this module")
        m = p.num_microbatches
        bounds = [sum(p.balance[:s + 1]) for s in range(len(p.balance) - 1)]
        links = [transfer + (device.transfer_seconds(whole.output_bytes[b - 1] / m)
                             if whole is not None and device is not None else 0.0)
                 for b in bounds]
        configurations.append(dict(balance=p.balance, schedule=p.schedule, chunks=m,
                                   checkpoint=p.checkpoint, transfer=links,
                                   num_ranks=p.num_ranks))
    profiles = profile_side_by_side(module, configurations, inputs, targets, loss_fn=loss_fn,
                                    rounds=rounds, warmup=warmup, concurrent=concurrent)
    refined = []
    for p, profile in zip(candidates, profiles, strict=True):
        actions = get_schedule(p.schedule, p.num_stages, p.num_microbatches,
                               num_ranks=p.num_ranks)
        sim = simulate(actions, profile, per_round=per_round)
        refined.append(replace(p, step_time=sim.step_time, bubble_fraction=sim.bubble_fraction,
                               refined_from=p.step_time))
    return sorted(refined, key=lambda p: (p.step_time, p.peak_bytes))


def _configuration(p: Plan) -> tuple[Any, ...]:
    return (p.schedule, p.num_stages, p.num_ranks, p.num_microbatches, p.checkpoint,
            tuple(p.balance))


def _batch_size(inputs: Any) -> int:
    leaves = [x for x in flatten(inputs)[0] if isinstance(x, Tensor)]
    return int(leaves[0].shape[0]) if leaves else 0
