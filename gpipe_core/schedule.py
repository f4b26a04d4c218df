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
(``draw(fill_drain(3, 4))``)::

    step     0    1    2    3    4    5    6    7    8    9    10   11
    stage 0  0F0  0F1  0F2  0F3  .    .    .    .    0B3  0B2  0B1  0B0
    stage 1  .    1F0  1F1  1F2  1F3  .    .    1B3  1B2  1B1  1B0  .
    stage 2  .    .    2F0  2F1  2F2  2F3  2B3  2B2  2B1  2B0  .    .

Legend: K = num_stages, M = num_microbatches, s = stage index, m = micro-batch index.

Virtual stages: a rank may hold several stages (model chunks). A schedule then has one row per
rank, each row the rank's actions over all of its stages in order, and a ``placement``: the rank
of every stage. Interleaved 1F1B puts stage s on rank s mod R (``interleaved_1f1b``); ZB-V
(``zb_v``, and DeepSeek's ``dualpipe_v`` on the same placement) folds the pipeline into a V,
stage s and stage 2R-1-s on rank s. Without virtual stages the placement is the identity and a
row is a stage's.
"""


from __future__ import annotations

import itertools
import re
import warnings
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Schedule", "ScheduleError", "fill_drain", "one_f_one_b", "zb_h1", "zb_h2",
           "interleaved_1f1b", "interleaved_zb", "zb_v", "dualpipe_v", "get_schedule",
           "SCHEDULE_NAMES",
           "check_in_order_matching"]

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
    """Per-rank ordered action lists for ``num_stages`` stages and ``num_microbatches``.

    ``placement[s]`` is the rank that runs stage s; empty means stage s on rank s (one stage per
    rank: then ``actions[s]`` is stage s's row).
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.placement:
            object.__setattr__(self, "placement", tuple(range(self.num_stages)))

    def __str__(self) -> str:
        return "\n".join(" ".join(str(a) for a in row) for row in self.actions)

    @classmethod
    def from_text(cls, text: str, *, name: str = "custom") -> Schedule:
        """Parse one line per rank of space-separated actions (the inverse of ``str``); a
        stage runs on the rank whose line holds its actions."""
        rows = [line.split() for line in text.strip().splitlines() if line.strip()]
        actions = tuple(tuple(Action.parse(a) for a in row) for row in rows)
        mbs = {a.mb for row in actions for a in row}
        ranks: dict[int, set[int]] = {}
        for rank, row in enumerate(actions):
            for action in row:
                ranks.setdefault(action.stage, set()).add(rank)
        num_stages = max(ranks, default=-1) + 1
        split = sorted(s for s, where in ranks.items() if len(where) > 1)
        if split:
            raise ScheduleError(f"stages {split} have actions on more than one rank's line")
        missing = [s for s in range(num_stages) if s not in ranks]
        if missing:
            raise ScheduleError(f"stages {missing} have no actions")
        placement = tuple(next(iter(ranks[s])) for s in range(num_stages))
        return cls(name, num_stages, (max(mbs) + 1) if mbs else 0, actions, placement)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def virtual(self) -> bool:
        """True when some rank runs more than one stage."""
        return self.num_ranks != self.num_stages

    def stages_on(self, rank: int) -> list[int]:
        """The stages that ``rank`` runs, in pipeline order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    @property
    def forward_then_backward(self) -> bool:
        """True when every rank runs all of its forwards before any backward (fill-drain)."""
        for row in self.actions:
            kinds = [a.kind for a in row]
            backward = [i for i, kind in enumerate(kinds) if kind != "F"]
            if backward and "F" in kinds[backward[0] :]:
                return False
        return True

    @property
    def splits_backward(self) -> bool:
        """True when some backward runs as I and W (the stage must keep state until W)."""
        return any(a.kind == "W" for row in self.actions for a in row)

    def peak_held(self) -> list[int]:
        """Per rank: the most micro-batches held at once, between their F and their B or W
        (what activation memory scales with, without re-materialization); with virtual stages
        a micro-batch counts once per stage that holds it."""
        peaks = []
        for row in self.actions:
            held = peak = 0
            for action in row:
                held += 1 if action.kind == "F" else -1 if action.kind in "BW" else 0
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def clock(self) -> list[list[Action]]:
        """Simulate the schedule in unit-time steps; return the actions that run at each step.

        A rank runs its next action as soon as its dependencies finished in an earlier step:
        ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` and ``I(s, m)`` need ``F(s, m)`` and the
        gradient from stage s+1 (its ``B(s+1, m)`` or ``I(s+1, m)``); ``W(s, m)`` needs
        ``I(s, m)``.
        Raises :class:`ScheduleError` (with the grid so far) when no rank can move.
        """
        validate_structure(self)
        done: set[tuple[int, str, int]] = set()
        cursor = [0] * self.num_ranks
        steps: list[list[Action]] = []
        total = sum(len(a) for a in self.actions)
        while sum(cursor) < total:
            ready = []
            for rank, row in enumerate(self.actions):
                if cursor[rank] < len(row):
                    action = row[cursor[rank]]
                    if all(dep in done for dep in _dependencies(action, self.num_stages)):
                        ready.append((rank, action))
            if not ready:
                blocked = {r: row[cursor[r]] for r, row in enumerate(self.actions)
                           if cursor[r] < len(row)}
                who = "rank" if self.virtual else "stage"
                raise ScheduleError(
                    f"schedule {self.name!r} deadlocks at step {len(steps)}: every {who} waits "
                    "for an action that never runs (blocked actions marked with !)\n"
                    + draw(self, steps, blocked=blocked)
                )
            for rank, action in ready:
                done.update(_provides(action))
                cursor[rank] += 1
            steps.append([action for _, action in ready])
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
    """Draw the step x rank grid (a row per stage without virtual stages); ``blocked``
    actions (per row) are appended marked with ``!``."""
    if steps is None:
        steps = schedule.clock()
    blocked = blocked or {}
    width = max([len(str(a)) for row in schedule.actions for a in row] + [3])
    columns = len(steps) + (1 if blocked else 0)
    label = "rank " if schedule.virtual else "stage"
    lines = ["step     " + " ".join(f"{i:<{width + 1}}" for i in range(columns)).rstrip()]
    for row in range(schedule.num_ranks):
        cells = []
        for step in steps:
            here = [a for a in step if schedule.placement[a.stage] == row]
            cells.append(str(here[0]) if here else ".")
        if blocked:
            cells.append(f"{blocked[row]}!" if row in blocked else ".")
        lines.append(f"{label} {row:<2} " + " ".join(f"{c:<{width + 1}}" for c in cells).rstrip())
    return "\n".join(lines)


def validate_structure(schedule: Schedule) -> None:
    """Check completeness and message order; raise :class:`ScheduleError` naming the problem.

    Every stage must run, for every micro-batch, F exactly once and then either B exactly once
    or I and W exactly once each, in the order F, I, W, all on the rank ``placement`` gives it.
    Neighbouring stages must process micro-batches in the same order: forwards, and the actions
    that send a gradient (B or I); point-to-point messages are matched in order, so a mismatch
    would deliver the wrong micro-batch.
    """
    k, m = schedule.num_stages, schedule.num_microbatches
    if k < 1 or m < 1:
        raise ScheduleError(f"num_stages={k} and num_microbatches={m} must both be >= 1")
    placement = schedule.placement
    if len(placement) != k:
        raise ScheduleError(f"placement {list(placement)} names {len(placement)} stages for "
                            f"num_stages={k}")
    if sorted(set(placement)) != list(range(schedule.num_ranks)):
        raise ScheduleError(
            f"schedule has {schedule.num_ranks} rank rows but placement {list(placement)} puts "
            f"stages on ranks {sorted(set(placement))}; every row must run at least one stage"
        )
    rows: list[list[Action]] = [[] for _ in range(k)]
    for rank, row in enumerate(schedule.actions):
        misplaced = [str(a) for a in row if not 0 <= a.stage < k or placement[a.stage] != rank]
        if misplaced:
            who = f"rank {rank}" if schedule.virtual else f"stage {rank}"
            raise ScheduleError(f"row of {who} holds actions of stages it does not run: "
                                f"{misplaced}")
        for action in row:
            rows[action.stage].append(action)
    for stage, stage_actions in enumerate(rows):
        seen: list[tuple[str, int]] = [(a.kind, a.mb) for a in stage_actions]
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
            here = [a.mb for a in rows[stage] if a.kind in kinds]
            there = [a.mb for a in rows[stage + 1] if a.kind in kinds]
            if here != there:
                raise ScheduleError(
                    f"stages {stage} and {stage + 1} run {label} on micro-batches in different "
                    f"orders ({here} vs {there}); messages between neighbours are matched in order"
                )


def check_in_order_matching(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every rank receives the messages of every other
    rank in the order that rank sends them: what a backend that ignores tags (NCCL) needs when
    two boundaries between the same two ranks (virtual stages) share their connection. A rank
    sends at its action (F: the activation on; B or I: the gradient back) and receives when an
    action needs the message."""
    placement, last = schedule.placement, schedule.num_stages - 1
    sent: dict[tuple[int, int], list[str]] = {}
    received: dict[tuple[int, int], list[str]] = {}
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a.kind == "W":  # nothing to send or receive
                continue
            s = a.stage
            before, after = (s - 1, s + 1) if a.kind == "F" else (s + 1, s - 1)
            if 0 <= before <= last and placement[before] != rank:
                message = f"{'activation' if a.kind == 'F' else 'gradient'} {before}->{s} of {a.mb}"
                received.setdefault((placement[before], rank), []).append(message)
            if 0 <= after <= last and placement[after] != rank:
                message = f"{'activation' if a.kind == 'F' else 'gradient'} {s}->{after} of {a.mb}"
                sent.setdefault((rank, placement[after]), []).append(message)
    for pair in sorted(set(sent) | set(received)):
        out, into = sent.get(pair, []), received.get(pair, [])
        if out != into:
            first = next(i for i, (x, y) in enumerate(zip(out + [""], into + [""], strict=False))
                         if x != y)
            raise ScheduleError(
                f"schedule {schedule.name!r}: rank {pair[0]} sends rank {pair[1]} message "
                f"{first} as {out[first] if first < len(out) else 'nothing'!r}, but rank "
                f"{pair[1]} expects {into[first] if first < len(into) else 'nothing'!r}; a "
                "backend that matches messages in order (NCCL) needs the same order on both "
                "sides: use gloo, or a schedule with one stage per rank"
            )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete and deadlock-free."""
    schedule.clock()


def fill_drain(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain (GPipe's schedule, ``"gpipe"``): every stage runs F on all micro-batches, then B in reverse order.

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


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """Deprecated: the old name of :func:`fill_drain` (it warns, then builds the same schedule).

    As ``gp.gpipe`` it stood where ``import gpipe_core.gpipe`` looked for a module, the one of
    ``gp.GPipe`` (now ``gpipe_core.pipe``), and hid it.
    """
    warnings.warn("gp.gpipe (gpipe_core.schedule.gpipe) is deprecated: call gp.fill_drain, "
                  "the same fill-drain schedule", DeprecationWarning, stacklevel=2)
    return fill_drain(num_stages, num_microbatches)


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


def interleaved_1f1b(num_stages: int, num_microbatches: int, *, num_ranks: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", 2021): ``num_stages = V * num_ranks`` stages, stage s on rank
    s mod R, so every rank holds V non-contiguous chunks of 1/V of a plain stage's layers.

    The micro-batches go in rounds of P = M // (M // R) (at least R; the first M mod rounds
    rounds take one more): a rank runs the forwards of a round on its chunks in pipeline order,
    chunk by chunk, and the backwards in reverse chunk order. Rank r warms up with
    2(R-1-r) + (V-1)P forwards, then alternates F and B, then drains. The bubble shrinks about
    V times against 1F1B's (in units of a chunk's F + B: R-1 per rank instead of V(R-1)); rank
    r holds at most 2(R-1-r) + (V-1)P + 1 chunk micro-batches (each 1/V of a stage's).
    ``interleaved_1f1b(4, 4, num_ranks=2)``::

        step     0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17
        rank  0  0F0  0F1  2F0  2F1  0F2  2B0  0F3  2B1  2F2  0B0  2F3  0B1  .    2B2  .    2B3  0B2  0B3
        rank  1  .    1F0  1F1  3F0  3B0  3F1  3B1  1F2  1B0  1F3  1B1  3F2  3B2  3F3  3B3  1B2  1B3  .
    """
    _check_sizes(num_stages, num_microbatches)
    if num_ranks < 1 or num_stages % num_ranks:
        raise ValueError(f"interleaved 1F1B needs num_stages={num_stages} to be a multiple of "
                         f"num_ranks={num_ranks} (V chunks per rank)")
    k, m, v = num_ranks, num_microbatches, num_stages // num_ranks
    rounds = max(1, m // k)
    sizes = [m // rounds + (1 if i < m % rounds else 0) for i in range(rounds)]
    rows = []
    for r in range(k):
        forwards: list[tuple[int, int]] = []
        backwards: list[tuple[int, int]] = []
        start = 0
        for size in sizes:
            batch = range(start, start + size)
            forwards += [(chunk * k + r, mb) for chunk in range(v) for mb in batch]
            backwards += [(chunk * k + r, mb) for chunk in reversed(range(v)) for mb in batch]
            start += size
        total = m * v
        warmup = min(2 * (k - 1 - r) + (v - 1) * sizes[0], total)
        row = [Action(stage, "F", mb) for stage, mb in forwards[:warmup]]
        for i in range(warmup, total):
            row += [Action(forwards[i][0], "F", forwards[i][1]),
                    Action(backwards[i - warmup][0], "B", backwards[i - warmup][1])]
        row += [Action(stage, "B", mb) for stage, mb in backwards[total - warmup :]]
        rows.append(tuple(row))
    placement = tuple(s % k for s in range(num_stages))
    return Schedule("interleaved_1f1b", num_stages, m, tuple(rows), placement)


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): R = K/2 ranks,
    each holding two chunks in a V: stage s and stage K-1-s on rank s, so the first and the
    last stage share rank 0 and the turn of the V stays on rank R-1 (no message there).
    Backward split into I and W, as in ZB-H1/H2.

    For M >= 2R each rank opens with a fixed order (:func:`_zb_v_opening`): its first chunk's
    forwards run ahead, then the two chunks alternate blocks of F, I and W of one micro-batch,
    each W right after its I (the loss stage's W never waits behind another stage's I); the
    drain after the last forward follows the greedy rule below with the earlier chunk's I
    first. Its step takes as long as the ZB-V of torch.distributed.pipelining
    (``ScheduleZBVZeroBubble``) in the simulator at R = 2-4, M = 2R-16, for unit and uneven
    costs alike (the order is the same at R = 2; ``tests/test_schedule.py``). For M < 2R, and
    as it was for every M before 2026-12-06: a stated greedy rule in unit time (F = I = W = 1
    per chunk): every rank at every step runs the first ready action of: an I of its later
    chunk, then of its earlier one (the oldest micro-batch whose gradient arrived); a forward,
    later chunk first, while it holds fewer than 2R chunk micro-batches (R whole micro-batches:
    1F1B's peak on its first stage); its oldest pending W. That rule kept the same memory and
    unit-time length but put an I of the first chunk before the W of the last, so the first
    rank waited twice per cycle on the others where costs are uneven (a heavy loss stage:
    3-9% slower than torch's order in the simulator, 9% measured on the NMT app).
    For M >= 2R a step lasts 6M + R - 1 units for 6M units of work per rank: an idle R-1 units
    per rank where 1F1B on the same 2R stages' layers idles 6(R-1) (checked for R <= 8 in the
    tests); a rank holds at most 2R chunk micro-batches. ``zb_v(4, 4)`` (two ranks)::

        step     0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17   18   19   20   21   22   23   24
        rank  0  0F0  0F1  0F2  3F0  3I0  3W0  3F1  3I1  3W1  0F3  0I0  0W0  3F2  3I2  3W2  0I1  0W1  3F3  3I3  3W3  0I2  0W2  0I3  0W3  .
        rank  1  .    1F0  2F0  1F1  2F1  2I0  2W0  1F2  1I0  1W0  2F2  2I1  2W1  1F3  1I1  1W1  2F3  2I2  2W2  1I2  2I3  1I3  1W2  2W3  1W3
    """
    _check_sizes(num_stages, num_microbatches)
    if num_stages % 2:
        raise ValueError(f"ZB-V needs an even num_stages={num_stages}: two chunks per rank")
    n, k = num_stages, num_stages // 2
    placement = tuple(s if s < k else n - 1 - s for s in range(n))
    m = num_microbatches
    opening = [_zb_v_opening(r, k, m) for r in range(k)] if m >= 2 * k else None
    return _greedy_zero_bubble("zb_v", m, placement, [2 * k] * k, opening)


def _zb_v_opening(r: int, k: int, m: int) -> list[Action]:
    """Rank r's actions in ZB-V up to its last forward (M >= 2R), chunk d = stage r (down the
    V) and u = stage 2R-1-r (up): 2(R-r)-1 forwards of d; r pairs F_u F_d; R-r blocks F_u
    I_u W_u; then, while d has forwards left, F_d I_d W_d and F_u I_u W_u in turn (the W
    right after its I, so a micro-batch's memory goes as soon as it can); then I_d W_d and
    F_u I_u W_u in turn until u's last forward. The I's and W's after it follow the greedy
    rule (:func:`_greedy_zero_bubble`)."""
    d, u = r, 2 * k - 1 - r
    row: list[Action] = []
    nxt = {(d, "F"): 0, (u, "F"): 0, (d, "I"): 0, (u, "I"): 0}

    def add(stage: int, kind: str) -> None:
        if kind == "W":  # right after its I
            row.append(Action(stage, "W", nxt[(stage, "I")] - 1))
            return
        row.append(Action(stage, kind, nxt[(stage, kind)]))  # type: ignore[arg-type]
        nxt[(stage, kind)] += 1

    def block(stage: int, kinds: str) -> None:
        for kind in kinds:
            add(stage, kind)

    block(d, "F" * (2 * (k - r) - 1))
    for _ in range(r):
        block(u, "F")
        block(d, "F")
    for _ in range(k - r):
        block(u, "FIW")
    while nxt[(d, "F")] < m:
        block(d, "FIW")
        block(u, "FIW")
    while nxt[(u, "F")] < m:
        block(d, "IW")
        block(u, "FIW")
    return row


def interleaved_zb(num_stages: int, num_microbatches: int, *, num_ranks: int) -> Schedule:
    """Interleaved zero bubble: interleaved 1F1B's placement (stage s on rank s mod R) and
    per-rank memory, with the backward split into I and W and the W's filling the bubbles, by
    ZB-V's greedy rule (:func:`zb_v`): I first (later stage first), then a forward while the
    rank holds fewer chunk micro-batches than :func:`interleaved_1f1b` at most does, then the
    oldest W. The counterpart of torch's ``ScheduleInterleavedZeroBubble``.
    """
    _check_sizes(num_stages, num_microbatches)
    if num_ranks < 1 or num_stages % num_ranks:
        raise ValueError(f"interleaved zero bubble needs num_stages={num_stages} to be a "
                         f"multiple of num_ranks={num_ranks} (V chunks per rank)")
    limits = interleaved_1f1b(num_stages, num_microbatches, num_ranks=num_ranks).peak_held()
    placement = tuple(s % num_ranks for s in range(num_stages))
    return _greedy_zero_bubble("interleaved_zb", num_microbatches, placement, limits)


def _greedy_zero_bubble(name: str, m: int, placement: tuple[int, ...],
                        limits: list[int], opening: list[list[Action]] | None = None
                        ) -> Schedule:
    """A split-backward schedule built in unit time (F = I = W = 1 per stage): every rank at
    every step runs the first ready action of: an I (its later stages first, each its oldest
    micro-batch whose gradient arrived); a forward (later stages first) while it holds fewer
    than ``limits[rank]`` micro-batches between F and W; its oldest pending W. With
    ``opening``, a rank first runs its opening's actions in that order (each when ready),
    and the rule only after them, its I's then earlier stage first."""
    n, k = len(placement), len(limits)
    opened = [0] * k
    mine = [sorted((s for s in range(n) if placement[s] == r), reverse=True) for r in range(k)]
    rows: list[list[Action]] = [[] for _ in range(k)]
    next_ = {kind: [0] * n for kind in "FIW"}
    held = [0] * k
    finished: dict[tuple[int, str, int], int] = {}
    never = 1 << 62
    time = 0

    def gradient_arrived(s: int) -> bool:
        after = (s, "F") if s == n - 1 else (s + 1, "I")
        return finished.get((*after, next_["I"][s]), never) <= time

    def input_arrived(s: int) -> bool:
        return s == 0 or finished.get((s - 1, "F", next_["F"][s]), never) <= time

    while any(w < m for w in next_["W"]):
        for r in range(k):
            if opening is not None and opened[r] < len(opening[r]):
                action = opening[r][opened[r]]
                s = action.stage
                assert action.mb == next_[action.kind][s], action
                due = {"F": input_arrived(s), "I": gradient_arrived(s),
                       "W": next_["W"][s] < next_["I"][s]
                       and finished[(s, "I", next_["W"][s])] <= time}[action.kind]
                if not due:
                    continue
                opened[r] += 1
                ready = [(action.kind, s)]
            else:
                # after an opening (the drain): the earlier stage's I first, whose gradient
                # has the longer way still to go
                order = mine[r] if opening is None else mine[r][::-1]
                ready = [("I", s) for s in order
                         if next_["I"][s] < next_["F"][s] and gradient_arrived(s)]
                ready += [("F", s) for s in mine[r]
                          if next_["F"][s] < m and held[r] < limits[r] and input_arrived(s)]
                weights = [s for s in mine[r] if next_["W"][s] < next_["I"][s]]
                weights.sort(key=lambda s: finished[(s, "I", next_["W"][s])])
                ready += [("W", s) for s in weights]
            if not ready:
                continue
            kind, s = ready[0]
            mb = next_[kind][s]
            next_[kind][s] += 1
            held[r] += 1 if kind == "F" else -1 if kind == "W" else 0
            rows[r].append(Action(s, kind, mb))  # type: ignore[arg-type]
            finished[(s, kind, mb)] = time + 1
        time += 1
    return Schedule(name, n, m, tuple(tuple(row) for row in rows), placement)


def dualpipe_v(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, and its DualPipe
    repository): the V-shaped half of DualPipe, on ZB-V's placement (stage s and K-1-s on rank
    s, R = K/2 ranks). Needs M >= 2R.

    Rank r runs, with chunk 0 = stage r and chunk 1 = stage K-1-r: 2(R-1-r) forwards of chunk
    0; r+1 pairs F0 F1; R-1-r rounds of I1 W1 F1; then the main phase, M-2R+r+1 rounds of
    F0 B1 F1 B0 (in DualPipe each pair F0 B1 and F1 B0 runs overlapped, to hide expert-parallel
    all-to-all behind computation; one thread per rank has nothing to overlap with, so here
    they run one after the other); R-1-r rounds of B1 F1 B0; r+1 rounds of B1 B0, whose second
    half splits the backward into I (W queued); R-1-r rounds of W I0; and the r+1 queued W's.
    Its step takes about as long as ZB-V's, with one more chunk micro-batch held (2R+1).
    """
    _check_sizes(num_stages, num_microbatches)
    if num_stages % 2:
        raise ValueError(f"DualPipeV needs an even num_stages={num_stages}: two chunks per rank")
    n, m = num_stages, num_microbatches
    k = n // 2
    if m < 2 * k:
        raise ValueError(f"DualPipeV needs at least 2 x ranks = {2 * k} micro-batches, got {m}; "
                         "use more chunks, or zb_v")
    rows = [_dualpipe_v_row(r, k, m) for r in range(k)]
    placement = tuple(s if s < k else n - 1 - s for s in range(n))
    return Schedule("dualpipe_v", n, m, tuple(rows), placement)


def _dualpipe_v_row(r: int, k: int, m: int) -> tuple[Action, ...]:
    """Rank r's actions in DualPipeV over k ranks and m micro-batches (see :func:`dualpipe_v`)."""
    chunk = (r, 2 * k - 1 - r)
    next_f, next_b = [0, 0], [0, 0]
    row: list[Action] = []
    queued: list[tuple[int, int]] = []  # (stage, micro-batch) of I's whose W waits

    def forward(c: int) -> None:
        row.append(Action(chunk[c], "F", next_f[c]))
        next_f[c] += 1

    def backward(c: int, split: bool = False) -> None:
        row.append(Action(chunk[c], "I" if split else "B", next_b[c]))
        if split:
            queued.append((chunk[c], next_b[c]))
        next_b[c] += 1

    def weight() -> None:
        stage, mb = queued.pop(0)
        row.append(Action(stage, "W", mb))

    for _ in range(2 * (k - 1 - r)):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(k - 1 - r):
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * k + r + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(k - 1 - r):
        backward(1)
        forward(1)
        backward(0)
    split = False
    for i in range(r + 1):  # the second half splits (from chunk 1's or chunk 0's turn)
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(0, split)
    for _ in range(k - 1 - r):
        weight()
        backward(0, split=True)
    while queued:
        weight()
    return tuple(row)


_SLACK_RE = re.compile(r"^1f1b_slack(\d+)$")
_SCHEDULES = {"gpipe": fill_drain, "fill_drain": fill_drain, "1f1b": one_f_one_b,
              "one_f_one_b": one_f_one_b, "zb_h1": zb_h1, "zb_h2": zb_h2}
_VIRTUAL = ("interleaved_1f1b", "interleaved_zb", "zb_v", "dualpipe_v")  # several per rank
SCHEDULE_NAMES = (*sorted(_SCHEDULES), *_VIRTUAL, "1f1b_slackN")


def get_schedule(name: str | Schedule, num_stages: int, num_microbatches: int, *,
                 num_ranks: int | None = None) -> Schedule:
    """Build a schedule by name (``"gpipe"``, ``"1f1b"``, ``"1f1b_slackN"``, ``"zb_h1"``,
    ``"zb_h2"``, and with several stages per rank ``"interleaved_1f1b"``,
    ``"interleaved_zb"``, ``"zb_v"`` or ``"dualpipe_v"``), or
    check a given one's sizes. ``num_ranks`` defaults to one rank per stage."""
    ranks = num_stages if num_ranks is None else num_ranks
    if isinstance(name, Schedule):
        if (name.num_stages, name.num_microbatches, name.num_ranks) != (
                num_stages, num_microbatches, ranks):
            raise ScheduleError(
                f"schedule {name.name!r} is for {name.num_stages} stages x "
                f"{name.num_microbatches} micro-batches on {name.num_ranks} ranks, but the "
                f"pipeline runs {num_stages} x {num_microbatches} on {ranks}"
            )
        validate(name)
        return name
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_stages, num_microbatches, num_ranks=ranks)
    if name == "interleaved_zb":
        return interleaved_zb(num_stages, num_microbatches, num_ranks=ranks)
    if name in ("zb_v", "dualpipe_v"):
        if num_stages != 2 * ranks:
            raise ValueError(f"{name} runs two stages per rank: give {2 * ranks} stages for "
                             f"{ranks} ranks (len(balance)), not {num_stages}")
        return (zb_v if name == "zb_v" else dualpipe_v)(num_stages, num_microbatches)
    slack = _SLACK_RE.match(name)
    factory = _SCHEDULES.get(name)
    if slack is None and factory is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULE_NAMES)} "
                         "('1f1b_slackN': 1F1B with N extra warm-up forwards)")
    if num_stages != ranks:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank, but there are {num_stages} stages for "
            f"{ranks} ranks; give len(balance) == {ranks}, or a schedule with several stages "
            f"per rank: {list(_VIRTUAL)}"
        )
    if slack is not None:
        return one_f_one_b(num_stages, num_microbatches, slack=int(slack.group(1)))
    assert factory is not None
    return factory(num_stages, num_microbatches)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_stages={num_stages} and num_microbatches={num_microbatches} must both be >= 1"
        )
