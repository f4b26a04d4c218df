"""Choosing among the planner's best plans by timing them in the ranks.

:func:`~gpipe_core.plan` prices plans from profiles and a device model; where its best plans are
predicted within a few percent of each other, the order among them is within the profile's
error (on a shared CPU host a schedule's measured step stood 0.9-1.4 times its prediction,
differently per schedule). :func:`tune` settles it the way a user would: it builds each
shortlisted plan's :class:`~gpipe_core.DistributedGPipe` in the ranks that will train, steps
each a few times in rounds (every plan once per round, the order rotating, so that a host whose
speed drifts slows them alike) and returns them fastest first, the same list on every rank.
No optimizer steps and the gradients are cleared after: the models ``build`` made
are left as built, and dropped.

Call it on every rank of the pipeline's group, after the process group is up::

    plans = gp.plan(costs, device=..., batch_size=B, stages=[K], schedule=[...])
    best = gp.tune(plans, build_model, inputs, targets, loss_fn=loss_fn)[0].plan
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .distributed import DistributedGPipe
from .failure import collectives
from .planner import Plan


@dataclass(frozen=True)
class TunedPlan:
    """A plan and its measured step: the median over rounds of the slowest rank's seconds."""

    plan: Plan
    seconds: float
    samples: list[float]  # one step per round, seconds (the slowest rank's)


def shortlist(plans: Sequence[Plan], *, candidates: int = 4, within: float = 0.2) -> list[Plan]:
    """The plans predicted within ``within`` (a fraction) of the fastest, at most
    ``candidates`` of them, fastest first."""
    if candidates < 1:
        raise ValueError(f"candidates={candidates} must be at least 1")
    if not math.isfinite(within) or within < 0:
        raise ValueError(f"within={within} must be a fraction >= 0 (0.2: predicted within 20% "
                         f"of the fastest plan)")
    if not plans:
        raise ValueError("no plans to choose from: pass gp.plan(...)'s list")
    ranked = sorted(plans, key=lambda p: p.step_time)
    limit = ranked[0].step_time * (1 + within)
    return [p for p in ranked if p.step_time <= limit][:candidates]


def tune(
    plans: Sequence[Plan],
    build: Callable[[], nn.Sequential],
    inputs: Any,
    targets: Any,
    *,
    loss_fn: Callable[..., torch.Tensor],
    candidates: int = 4,
    within: float = 0.2,
    rounds: int = 5,
    warmup: int = 2,
    group: Any = None,
    **pipeline_options: Any,
) -> list[TunedPlan]:
    """Time the :func:`shortlist` of ``plans`` in these ranks; every plan measured, fastest first.

    ``build()`` returns the whole model (the same on every rank; each pipeline keeps its own
    stages of a fresh copy). ``inputs`` are read on the first rank and ``targets`` on the last,
    as by :meth:`DistributedGPipe.step`. Each plan runs ``warmup`` steps, then ``rounds`` rounds
    of one step of every plan; a step's seconds are its slowest rank's, from a barrier.
    ``pipeline_options`` go to every :class:`DistributedGPipe` (``precision``, ``seed``, ...).
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds} must be at least 1 and warmup={warmup} at least 0")
    chosen = shortlist(plans, candidates=candidates, within=within)
    ranks = dist.get_world_size(group)
    for p in chosen:
        if p.num_ranks != ranks:
            raise ValueError(f"plan {p.describe()} is for {p.num_ranks} ranks, but the group "
                             f"has {ranks}: plan with stages=[{ranks}]")
    with collectives("gp.tune: building the shortlisted pipelines"):
        pipes = [DistributedGPipe(build(), p.balance, chunks=p.num_microbatches,
                                  schedule=p.schedule, checkpoint=p.checkpoint, loss_fn=loss_fn,
                                  group=group, **pipeline_options) for p in chosen]
    seconds = torch.zeros(len(pipes), rounds, dtype=torch.float64)
    with collectives("gp.tune: timing the shortlisted pipelines"):
        for pipe in pipes:
            for _ in range(warmup):
                _step(pipe, inputs, targets)
        for r in range(rounds):
            for i in _rotated(len(pipes), r):
                dist.barrier(group)
                start = time.perf_counter()
                _step(pipes[i], inputs, targets)
                seconds[i, r] = time.perf_counter() - start
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
        for pipe in pipes:
            pipe.zero_grad(set_to_none=True)
    tuned = [TunedPlan(p, statistics.median(row.tolist()), row.tolist())
             for p, row in zip(chosen, seconds, strict=True)]
    return sorted(tuned, key=lambda t: t.seconds)


def _rotated(n: int, start: int) -> list[int]:
    """0..n-1 starting at ``start`` (mod n): round r begins with a different plan."""
    return [(start + i) % n for i in range(n)]


def _step(pipe: DistributedGPipe, inputs: Any, targets: Any) -> None:
    pipe.zero_grad(set_to_none=True)
    pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None)
