"""Schedules as data: for every stage, the ordered forward/backward actions it runs.

An action prints as ``"1F3"`` (stage 1, forward, micro-batch 3) and parses back, so a schedule
diffs as text and can be drawn. The same :class:`Schedule` drives the runtime, the simulator and
the timeline.

Fill-drain (GPipe) for K=3 stages and M=4 micro-batches, one column per clock step
(``draw(gpipe(3, 4))``)::

    step     0    1    2    3    4    5    6    7    8    9    10   11
    stage 0  0F0  0F1  0F2  0F3  .    .    .    .    0B3  0B2  0B1  0B0
    stage 1  .    1F0  1F1  1F2  1F3  .    .    1B3  1B2  1B1  1B0  .
    stage 2  .    .    2F0  2F1  2F2  2F3  2B3  2B2  2B1  2B0  .    .

Legend: K = num_stages, M = num_microbatches, s = stage index, m = micro-batch index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Schedule", "ScheduleError", "gpipe", "one_f_one_b", "get_schedule"]

Kind = Literal["F", "B"]
_ACTION_RE = re.compile(r"^(\d+)([FB])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage ``stage`` runs forward (F) or backward (B) on micro-batch ``mb``."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F3' or '0B2'")
        stage, kind, mb = match.groups()
        return cls(int(stage), kind, int(mb))  # type: ignore[arg-type]


class ScheduleError(ValueError):
    """A schedule that is incomplete, inconsistent or deadlocks; the message draws the grid."""


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered action lists for ``num_stages`` stages and ``num_microbatches``."""

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        return "\n".join(" ".join(str(a) for a in stage) for stage in self.actions)

    @classmethod
    def from_text(cls, text: str, *, name: str = "custom") -> Schedule:
        """Parse one line per stage of space-separated actions (the inverse of ``str``)."""
        rows = [line.split() for line in text.strip().splitlines() if line.strip()]
        actions = tuple(tuple(Action.parse(a) for a in row) for row in rows)
        mbs = {a.mb for row in actions for a in row}
        return cls(name, len(actions), (max(mbs) + 1) if mbs else 0, actions)

    @property
    def forward_then_backward(self) -> bool:
        """True when every stage runs all of its forwards before any backward (fill-drain)."""
        for stage_actions in self.actions:
            kinds = [a.kind for a in stage_actions]
            if "B" in kinds and "F" in kinds[kinds.index("B") :]:
                return False
        return True

    def clock(self) -> list[list[Action]]:
        """Simulate the schedule in unit-time steps; return the actions that run at each step.

        A stage runs its next action as soon as its dependencies finished in an earlier step:
        ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` needs ``F(s, m)`` and ``B(s+1, m)``.
        Raises :class:`ScheduleError` (with the grid so far) when no stage can move.
        """
        validate_structure(self)
        done: set[tuple[int, str, int]] = set()
        cursor = [0] * self.num_stages
        steps: list[list[Action]] = []
        total = sum(len(a) for a in self.actions)
        while sum(cursor) < total:
            ready = []
            for stage, stage_actions in enumerate(self.actions):
                if cursor[stage] < len(stage_actions):
                    action = stage_actions[cursor[stage]]
                    if all(dep in done for dep in _dependencies(action, self.num_stages)):
                        ready.append(action)
            if not ready:
                blocked = {
                    s: self.actions[s][cursor[s]]
                    for s in range(self.num_stages)
                    if cursor[s] < len(self.actions[s])
                }
                raise ScheduleError(
                    f"schedule {self.name!r} deadlocks at step {len(steps)}: every stage waits "
                    "for an action that never runs (blocked actions marked with !)\n"
                    + draw(self, steps, blocked=blocked)
                )
            for action in ready:
                done.add((action.stage, action.kind, action.mb))
                cursor[action.stage] += 1
            steps.append(ready)
        return steps


def _dependencies(action: Action, num_stages: int) -> list[tuple[int, str, int]]:
    s, m = action.stage, action.mb
    if action.kind == "F":
        return [(s - 1, "F", m)] if s > 0 else []
    deps = [(s, "F", m)]
    if s < num_stages - 1:
        deps.append((s + 1, "B", m))
    return deps


def draw(
    schedule: Schedule,
    steps: list[list[Action]] | None = None,
    *,
    blocked: dict[int, Action] | None = None,
) -> str:
    """Draw the step x stage grid; ``blocked`` actions are appended marked with ``!``."""
    if steps is None:
        steps = schedule.clock()
    blocked = blocked or {}
    width = max([len(str(a)) for row in schedule.actions for a in row] + [3])
    columns = len(steps) + (1 if blocked else 0)
    lines = ["step     " + " ".join(f"{i:<{width + 1}}" for i in range(columns)).rstrip()]
    for stage in range(schedule.num_stages):
        cells = []
        for step in steps:
            here = [a for a in step if a.stage == stage]
            cells.append(str(here[0]) if here else ".")
        if blocked:
            cells.append(f"{blocked[stage]}!" if stage in blocked else ".")
        lines.append(f"stage {stage:<2} " + " ".join(f"{c:<{width + 1}}" for c in cells).rstrip())
    return "\n".join(lines)


def validate_structure(schedule: Schedule) -> None:
    """Check completeness and message order; raise :class:`ScheduleError` naming the problem.

    Every stage must run F and B exactly once for every micro-batch, F(m) before B(m), and
    neighbouring stages must process micro-batches in the same order (point-to-point messages
    are matched in order, so a mismatch would deliver the wrong micro-batch).
    """
    k, m = schedule.num_stages, schedule.num_microbatches
    if k < 1 or m < 1:
        raise ScheduleError(f"num_stages={k} and num_microbatches={m} must both be >= 1")
    if len(schedule.actions) != k:
        raise ScheduleError(f"schedule has {len(schedule.actions)} stage rows for num_stages={k}")
    expected = {(kind, mb) for kind in "FB" for mb in range(m)}
    for stage, stage_actions in enumerate(schedule.actions):
        seen = [(a.kind, a.mb) for a in stage_actions]
        wrong_stage = [str(a) for a in stage_actions if a.stage != stage]
        if wrong_stage:
            raise ScheduleError(f"row of stage {stage} holds actions of other stages: {wrong_stage}")
        duplicates = sorted({f"{stage}{kind}{mb}" for kind, mb in seen if seen.count((kind, mb)) > 1})
        missing = sorted(f"{stage}{kind}{mb}" for kind, mb in expected - set(seen))
        extra = sorted(f"{stage}{kind}{mb}" for kind, mb in set(seen) - expected)
        if duplicates or missing or extra:
            raise ScheduleError(
                f"stage {stage} of schedule {schedule.name!r} is incomplete: "
                f"missing {missing}, duplicated {duplicates}, out of range {extra}\n"
                f"stage {stage}: {' '.join(str(a) for a in stage_actions)}"
            )
        for mb in range(m):
            if seen.index(("B", mb)) < seen.index(("F", mb)):
                raise ScheduleError(f"stage {stage} runs {stage}B{mb} before {stage}F{mb}")
    for stage in range(k - 1):
        for kind in "FB":
            here = [a.mb for a in schedule.actions[stage] if a.kind == kind]
            there = [a.mb for a in schedule.actions[stage + 1] if a.kind == kind]
            if here != there:
                raise ScheduleError(
                    f"stages {stage} and {stage + 1} run {kind} on micro-batches in different "
                    f"orders ({here} vs {there}); messages between neighbours are matched in order"
                )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete and deadlock-free."""
    schedule.clock()


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain: every stage runs F on all micro-batches, then B in reverse order.

    Backward runs the last micro-batch first: it is the one whose forward just finished, so its
    activations are still in memory when re-materialization spares it (``except_last``).
    """
    _check_sizes(num_stages, num_microbatches)
    actions = tuple(
        tuple(Action(s, "F", m) for m in range(num_microbatches))
        + tuple(Action(s, "B", m) for m in reversed(range(num_microbatches)))
        for s in range(num_stages)
    )
    return Schedule("gpipe", num_stages, num_microbatches, actions)


def one_f_one_b(num_stages: int, num_microbatches: int, *, slack: int = 0) -> Schedule:
    """1F1B (PipeDream-flush): warm up with K-1-s forwards, then alternate F and B, then drain.

    Same bubble as fill-drain but stage s holds at most K-s micro-batches' activations at once
    (K-s+slack on every stage but the last with ``slack``).

    In the steady state each stage's next backward waits on the message the next stage sends
    when it finishes its own backward, so every message's latency is paid once per micro-batch
    (fill-drain pays it only while filling and draining). ``slack`` extra warm-up forwards on
    every stage but the last hide it: the gradient a stage waits for is then one forward older.
    Each costs one more micro-batch's activations on those stages.
    """
    _check_sizes(num_stages, num_microbatches)
    if slack < 0:
        raise ValueError(f"slack={slack} must be >= 0 (extra warm-up forwards per stage)")
    rows = []
    for s in range(num_stages):
        extra = slack if s < num_stages - 1 else 0
        warmup = min(num_stages - 1 - s + extra, num_microbatches)
        row = [Action(s, "F", m) for m in range(warmup)]
        next_f, next_b = warmup, 0
        while next_f < num_microbatches:
            row.append(Action(s, "F", next_f))
            next_f += 1
            row.append(Action(s, "B", next_b))
            next_b += 1
        row.extend(Action(s, "B", m) for m in range(next_b, num_microbatches))
        rows.append(tuple(row))
    name = "1f1b" if slack == 0 else f"1f1b_slack{slack}"
    return Schedule(name, num_stages, num_microbatches, tuple(rows))


_SLACK_RE = re.compile(r"^1f1b_slack(\d+)$")
_SCHEDULES = {"gpipe": gpipe, "fill_drain": gpipe, "1f1b": one_f_one_b, "one_f_one_b": one_f_one_b}


def get_schedule(name: str | Schedule, num_stages: int, num_microbatches: int) -> Schedule:
    """Build a schedule by name (``"gpipe"`` or ``"1f1b"``), or check a given one's sizes."""
    if isinstance(name, Schedule):
        if (name.num_stages, name.num_microbatches) != (num_stages, num_microbatches):
            raise ScheduleError(
                f"schedule {name.name!r} is for {name.num_stages} stages x "
                f"{name.num_microbatches} micro-batches, but the pipeline runs {num_stages} x "
                f"{num_microbatches}"
            )
        validate(name)
        return name
    slack = _SLACK_RE.match(name)
    if slack is not None:
        return one_f_one_b(num_stages, num_microbatches, slack=int(slack.group(1)))
    try:
        factory = _SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {sorted(_SCHEDULES)} or '1f1b_slackN' "
            "(1F1B with N extra warm-up forwards)"
        ) from None
    return factory(num_stages, num_microbatches)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_stages={num_stages} and num_microbatches={num_microbatches} must both be >= 1"
        )
