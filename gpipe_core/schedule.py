"""Schedules as data: for every stage, the ordered forward/backward actions it runs.

An action prints as ``"1F3"`` (stage 1, forward, micro-batch 3) and parses back, so a schedule
diffs as text and can be drawn. The same :class:`Schedule` drives the runtime, the simulator and
the timeline.

Kinds of action (the backward may be split in two, as in zero-bubble schedules)::

    F  forward
    B  backward: the gradient of the stage's input (sent to the previous stage) and of its
       parameters, in one pass
    I  backward to the input only: the gradient the previous stage waits for
    W  backward to the parameters only (needs the stage's own I of the micro-batch, nothing
       from other stages): it can wait, filling what would be a bubble

Every stage runs, for every micro-batch, F and then either B, or I and later W.

Fill-drain (GPipe) for K=3 stages and M=4 micro-batches, one column per clock step
(``draw(gpipe(3, 4))``)::

    step     0    1    2    3    4    5    6    7    8    9    10   11
    stage 0  0F0  0F1  0F2  0F3  .    .    .    .    0B3  0B2  0B1  0B0
    stage 1  .    1F0  1F1  1F2  1F3  .    .    1B3  1B2  1B1  1B0  .
    stage 2  .    .    2F0  2F1  2F2  2F3  2B3  2B2  2B1  2B0  .    .

Legend: K = num_stages, M = num_microbatches, s = stage index, m = micro-batch index.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Schedule", "ScheduleError", "gpipe", "one_f_one_b", "zb_h1", "zb_h2",
           "get_schedule"]

Kind = Literal["F", "B", "I", "W"]
BACKWARD_KINDS = ("B", "I", "W")
_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage ``stage`` runs ``kind`` (F, B, I or W) on micro-batch ``mb``."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected e.g. '1F3', '0B2', '1I3' or '1W3'"
            )
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
            backward = [i for i, kind in enumerate(kinds) if kind != "F"]
            if backward and "F" in kinds[backward[0] :]:
                return False
        return True

    @property
    def splits_backward(self) -> bool:
        """True when some backward runs as I and W (the stage must keep state until W)."""
        return any(a.kind == "W" for row in self.actions for a in row)

    def peak_held(self) -> list[int]:
        """Per stage: the most micro-batches held at once, between their F and their B or W
        (what activation memory scales with, without re-materialization)."""
        peaks = []
        for stage_actions in self.actions:
            held = peak = 0
            for action in stage_actions:
                held += 1 if action.kind == "F" else -1 if action.kind in "BW" else 0
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def clock(self) -> list[list[Action]]:
        """Simulate the schedule in unit-time steps; return the actions that run at each step.

        A stage runs its next action as soon as its dependencies finished in an earlier step:
        ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` and ``I(s, m)`` need ``F(s, m)`` and the
        gradient from stage s+1 (its ``B(s+1, m)`` or ``I(s+1, m)``); ``W(s, m)`` needs
        ``I(s, m)``.
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
                done.update(_provides(action))
                cursor[action.stage] += 1
            steps.append(ready)
        return steps


def _dependencies(action: Action, num_stages: int) -> list[tuple[int, str, int]]:
    """What ``action`` waits for; ``(s, "I", m)`` stands for "stage s sent m's gradient"."""
    s, m = action.stage, action.mb
    if action.kind == "F":
        return [(s - 1, "F", m)] if s > 0 else []
    if action.kind == "W":
        return [(s, "I", m)]
    deps = [(s, "F", m)]
    if s < num_stages - 1:
        deps.append((s + 1, "I", m))
    return deps


def _provides(action: Action) -> list[tuple[int, str, int]]:
    """What finishing ``action`` makes available: a B also sends the input gradient."""
    s, m = action.stage, action.mb
    if action.kind == "B":
        return [(s, "B", m), (s, "I", m)]
    return [(s, action.kind, m)]


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

    Every stage must run, for every micro-batch, F exactly once and then either B exactly once
    or I and W exactly once each, in the order F, I, W. Neighbouring stages must process
    micro-batches in the same order: forwards, and the actions that send a gradient (B or I);
    point-to-point messages are matched in order, so a mismatch would deliver the wrong
    micro-batch.
    """
    k, m = schedule.num_stages, schedule.num_microbatches
    if k < 1 or m < 1:
        raise ScheduleError(f"num_stages={k} and num_microbatches={m} must both be >= 1")
    if len(schedule.actions) != k:
        raise ScheduleError(f"schedule has {len(schedule.actions)} stage rows for num_stages={k}")
    for stage, stage_actions in enumerate(schedule.actions):
        seen: list[tuple[str, int]] = [(a.kind, a.mb) for a in stage_actions]
        wrong_stage = [str(a) for a in stage_actions if a.stage != stage]
        if wrong_stage:
            raise ScheduleError(f"row of stage {stage} holds actions of other stages: {wrong_stage}")
        split = {mb for kind, mb in seen if kind in "IW"}
        expected = {("F", mb) for mb in range(m)}
        expected |= {(kind, mb) for mb in range(m) for kind in ("IW" if mb in split else "B")}
        duplicates = sorted({f"{stage}{kind}{mb}" for kind, mb in seen if seen.count((kind, mb)) > 1})
        missing = sorted(f"{stage}{kind}{mb}" for kind, mb in expected - set(seen))
        extra = sorted(f"{stage}{kind}{mb}" for kind, mb in set(seen) - expected)
        if duplicates or missing or extra:
            raise ScheduleError(
                f"stage {stage} of schedule {schedule.name!r} is incomplete: "
                f"missing {missing}, duplicated {duplicates}, out of range or both B and I/W "
                f"{extra}\nstage {stage}: {' '.join(str(a) for a in stage_actions)}"
            )
        for mb in range(m):
            order = ["F", "I", "W"] if mb in split else ["F", "B"]
            for before, after in itertools.pairwise(order):
                if seen.index((after, mb)) < seen.index((before, mb)):
                    raise ScheduleError(
                        f"stage {stage} runs {stage}{after}{mb} before {stage}{before}{mb}"
                    )
    for stage in range(k - 1):
        for label, kinds in (("forwards", "F"), ("gradient sends (B or I)", "BI")):
            here = [a.mb for a in schedule.actions[stage] if a.kind in kinds]
            there = [a.mb for a in schedule.actions[stage + 1] if a.kind in kinds]
            if here != there:
                raise ScheduleError(
                    f"stages {stage} and {stage + 1} run {label} on micro-batches in different "
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


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with the backward
    split into I and W, and W postponed to fill the bubbles; at most K micro-batches held.

    Stage s warms up with 1F1B's K-1-s forwards, then repeats ``F I W``; its first s rounds
    leave W out (``F I``), so stage s defers s weight gradients, which fill the drain: each
    stage holds at most K micro-batches (between F and W), 1F1B's peak on its first stage.
    With F = I = W = 1 unit and M >= K, every stage idles K-1 units per step, a third of
    1F1B's 3(K-1).
    ``zb_h1(3, 4)`` in unit time (``draw``)::

        step     0    1    2    3    4    5    6    7    8    9    10   11   12   13
        stage 0  0F0  0F1  0F2  .    .    0I0  0W0  0F3  0I1  0W1  0I2  0W2  0I3  0W3
        stage 1  .    1F0  1F1  .    1I0  1F2  1I1  1W0  1F3  1I2  1W1  1I3  1W2  1W3
        stage 2  .    .    2F0  2I0  2F1  2I1  2F2  2I2  2W0  2F3  2I3  2W1  2W2  2W3
    """
    _check_sizes(num_stages, num_microbatches)
    k, m = num_stages, num_microbatches
    rows = []
    for s in range(k):
        warmup = min(k - 1 - s, m)
        row = [Action(s, "F", mb) for mb in range(warmup)]
        next_f, next_i, next_w = warmup, 0, 0
        while next_f < m:  # steady state: F I W, without W in the first s rounds
            row += [Action(s, "F", next_f), Action(s, "I", next_i)]
            next_f, next_i = next_f + 1, next_i + 1
            if next_i > s:
                row.append(Action(s, "W", next_w))
                next_w += 1
        while next_i < m:  # drain: I W
            row += [Action(s, "I", next_i), Action(s, "W", next_w)]
            next_i, next_w = next_i + 1, next_w + 1
        row += [Action(s, "W", mb) for mb in range(next_w, m)]  # the deferred ones
        rows.append(tuple(row))
    return Schedule("zb_h1", k, m, tuple(rows))


def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al., 2023): no bubble inside any stage's span, at most 2K-1 micro-batches
    held per stage (about twice ZB-H1's K).

    Built like the paper's heuristic: in unit time (F = I = W = 1), every stage at every step
    runs the first ready action of: the I of its oldest micro-batch whose gradient arrived; the
    next F if fewer than 2K-1 micro-batches are held (between F and W); its oldest pending W.
    Stage s thus warms up with 2(K-1-s)+1 forwards, which fill the wait for its first gradient,
    and finishes with its deferred W's, which fill the drain: for M >= 2K-1 stage s works
    without a gap from unit step s to 3M+s (a parallelogram). With a synchronous step the last
    stage still starts K-1 units late, so in unit time the step lasts 3M+K-1 as with ZB-H1;
    ZB-H2 is faster when W costs less than F (ZB-H1's bubble then grows, ZB-H2's stays 0), and
    the first stage finishes K-1 units early. ``zb_h2(2, 4)``::

        step     0    1    2    3    4    5    6    7    8    9    10   11   12
        stage 0  0F0  0F1  0F2  0I0  0W0  0I1  0F3  0I2  0W1  0W2  0I3  0W3  .
        stage 1  .    1F0  1I0  1F1  1I1  1F2  1I2  1W0  1F3  1I3  1W1  1W2  1W3
    """
    _check_sizes(num_stages, num_microbatches)
    k, m = num_stages, num_microbatches
    limit = 2 * k - 1
    rows: list[list[Action]] = [[] for _ in range(k)]
    next_f, next_i, next_w = [0] * k, [0] * k, [0] * k
    finished: dict[tuple[int, str, int], int] = {}  # unit step each action finished at
    never = 1 << 62
    time = 0
    while any(w < m for w in next_w):
        for s in range(k):
            gradient_arrived = s == k - 1 or finished.get((s + 1, "I", next_i[s]), never) <= time
            input_arrived = s == 0 or finished.get((s - 1, "F", next_f[s]), never) <= time
            if next_i[s] < next_f[s] and gradient_arrived:
                kind, mb = "I", next_i[s]
                next_i[s] += 1
            elif next_f[s] < m and next_f[s] - next_w[s] < limit and input_arrived:
                kind, mb = "F", next_f[s]
                next_f[s] += 1
            elif next_w[s] < next_i[s]:
                kind, mb = "W", next_w[s]
                next_w[s] += 1
            else:
                continue
            rows[s].append(Action(s, kind, mb))  # type: ignore[arg-type]
            finished[(s, kind, mb)] = time + 1
        time += 1
    return Schedule("zb_h2", k, m, tuple(tuple(row) for row in rows))


_SLACK_RE = re.compile(r"^1f1b_slack(\d+)$")
_SCHEDULES = {"gpipe": gpipe, "fill_drain": gpipe, "1f1b": one_f_one_b, "one_f_one_b": one_f_one_b,
              "zb_h1": zb_h1, "zb_h2": zb_h2}


def get_schedule(name: str | Schedule, num_stages: int, num_microbatches: int) -> Schedule:
    """Build a schedule by name (``"gpipe"``, ``"1f1b"``, ``"1f1b_slackN"``, ``"zb_h1"``,
    ``"zb_h2"``), or check a given one's sizes."""
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
