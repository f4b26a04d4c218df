"""The record of measured per-stage costs (:class:`StageProfile`): what
:func:`~gpipe_core.simulator.simulate` and :func:`~gpipe_core.planner.plan` take, and what
:func:`~gpipe_core.profile.profile_stages` (a replay) and
:func:`~gpipe_core.profile.profile_timeline` (a pipeline's own timeline) measure.

Pure data and the arithmetic from a round's samples to the medians: it knows no stage, no
runtime and no process, so that the simulator and the planner, which only predict, stand below
the profiler that measures.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StageProfile"]


@dataclass
class StageProfile:
    """Measured seconds of one micro-batch's actions, per stage (medians over rounds of the
    mean over a round's micro-batches). ``backward`` is a fused B; in a profile of a schedule
    that splits the backward it is ``backward_input + backward_weight`` (what a fused B of
    that stage would cost is then not measured), and in one of a fused schedule the two halves
    are ``None``. ``recompute``: what re-materialization adds to a backward (B or I);
    ``forward_no_grad``: the forward of a re-materialized micro-batch (without autograd).
    With ``checkpoint="always"`` a forward with autograd never runs: ``forward`` is then the
    one without, and ``backward`` includes the recomputation (``recompute`` 0)."""

    schedule: str
    num_microbatches: int
    checkpoint: str
    forward: list[float]
    backward: list[float]
    forward_no_grad: list[float]
    recompute: list[float]
    backward_input: list[float] | None = None
    backward_weight: list[float] | None = None
    transfer: list[float] = field(default_factory=list)  # seconds per boundary s -> s+1
    rounds: int = 0
    # per stage and action kind ("F", "F_remat", "B", "B_remat", "I", "I_remat", "W"): the
    # round means the medians come from
    samples: list[dict[str, list[float]]] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def num_rounds(self) -> int:
        """Timed rounds whose costs :meth:`round` can give (0 without per-round samples)."""
        counts = {len(values) for stage in self.samples for values in stage.values()}
        if len(counts) > 1:
            raise ValueError(f"the stages' samples hold {sorted(counts)} rounds: per-round costs "
                             "need the same rounds for every stage and action kind")
        return counts.pop() if counts else 0

    def round(self, index: int) -> StageProfile:
        """The profile of timed round ``index`` alone: every stage's costs from that round's
        means (the rounds of all stages ran at the same time), derived as the medians are."""
        rounds = self.num_rounds
        if not 0 <= index < rounds:
            raise ValueError(f"round {index} of a profile with {rounds} timed rounds: give "
                             f"0..{rounds - 1}" if rounds else
                             "this profile keeps no per-round samples (profile_stages and "
                             "profile_timeline record them)")
        one = [{kind: [values[index]] for kind, values in stage.items()} for stage in self.samples]
        return StageProfile.from_rounds(self.schedule, self.num_microbatches, self.checkpoint,
                                        one, list(self.transfer), 1)

    def simulate_kwargs(self) -> dict[str, Any]:
        """The arguments of :func:`~gpipe_core.simulator.simulate` this profile gives."""
        kwargs: dict[str, Any] = {
            "forward": self.forward, "backward": self.backward,
            "forward_no_grad": self.forward_no_grad, "recompute": self.recompute,
            "transfer": self.transfer if self.transfer else 0.0,
            "checkpoint": self.checkpoint,
        }
        if self.backward_input is not None and self.backward_weight is not None:
            kwargs["backward_input"] = self.backward_input
            kwargs["backward_weight"] = self.backward_weight
        return kwargs

    @classmethod
    def combined(cls, kept: StageProfile, rematerialized: StageProfile) -> StageProfile:
        """One profile from two of the same stages, schedule and micro-batches: ``kept``
        measured with ``checkpoint="never"`` (every forward with autograd, its activations
        held, as a layer that keeps them runs in a pipeline) and ``rematerialized`` with
        ``checkpoint="always"`` (every forward without autograd, every backward with its
        rerun). Each kind of action is costed in the memory pattern it runs in; a profile with
        ``"except_last"`` times the forward with autograd on one micro-batch among
        re-materialized ones, where it writes into memory the others just freed (on CPU 7-15%
        cheaper per layer than when every micro-batch's activations are held). The result has
        both forwards, the plain backward and the rerun's cost, as ``except_last``'s has."""
        if (kept.checkpoint, rematerialized.checkpoint) != ("never", "always"):
            raise ValueError(f"combined takes a profile with checkpoint='never' and one with "
                             f"'always'; got {kept.checkpoint!r} and {rematerialized.checkpoint!r}")
        shape = (kept.schedule, kept.num_microbatches, kept.num_stages, kept.num_rounds)
        other = (rematerialized.schedule, rematerialized.num_microbatches,
                 rematerialized.num_stages, rematerialized.num_rounds)
        if shape != other:
            raise ValueError(f"the profiles differ in (schedule, micro-batches, stages, rounds): "
                             f"{shape} and {other}; profile the same stages twice")
        times = [{**{kind: v for kind, v in remat.items() if kind.endswith("_remat")},
                  **{kind: v for kind, v in keep.items() if not kind.endswith("_remat")}}
                 for keep, remat in zip(kept.samples, rematerialized.samples, strict=True)]
        return cls.from_rounds(kept.schedule, kept.num_microbatches, "except_last", times,
                               list(kept.transfer), kept.rounds)

    @classmethod
    def from_rounds(cls, schedule: str, num_microbatches: int, checkpoint: str,
                    times: list[dict[str, list[float]]], transfer: list[float],
                    rounds: int) -> StageProfile:
        """The profile of ``times``: per stage and action kind (``"F"``, ``"F_remat"``,
        ``"B"``, ``"B_remat"``, ``"I"``, ``"I_remat"``, ``"W"``; ``_remat``: a
        re-materialized micro-batch's), each round's mean seconds; the costs are their
        medians."""

        def median(stage: dict[str, list[float]], key: str) -> float | None:
            values = stage.get(key)
            return statistics.median(values) if values else None

        nan = math.nan
        forward, backward, no_grad, recompute = [], [], [], []
        inputs: list[float] = []
        weights: list[float] = []
        split = any("I" in t or "I_remat" in t for t in times)
        for stage in times:
            f, f_remat = median(stage, "F"), median(stage, "F_remat")
            fused = "B" if not split else "I"
            b, b_remat = median(stage, fused), median(stage, fused + "_remat")
            w = median(stage, "W")
            forward.append(_first(f, f_remat, nan))
            no_grad.append(_first(f_remat, f, nan))
            backward_one = _first(b, b_remat, nan)
            if b is not None and b_remat is not None:  # both ran: the difference is the rerun
                recompute.append(b_remat - b)
            elif b_remat is not None:  # every micro-batch re-materialized: B includes the rerun
                recompute.append(0.0)
            else:  # none re-materialized: a rerun would be a forward with autograd
                recompute.append(forward[-1])
            if split:
                inputs.append(backward_one)
                weights.append(_first(w, nan))
                backward.append(backward_one + _first(w, nan))
            else:
                backward.append(backward_one)
        return cls(
            schedule=schedule, num_microbatches=num_microbatches, checkpoint=checkpoint,
            forward=forward, backward=backward, forward_no_grad=no_grad,
            recompute=[max(r, 0.0) for r in recompute],
            backward_input=inputs if split else None, backward_weight=weights if split else None,
            transfer=transfer, rounds=rounds, samples=times)


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)
