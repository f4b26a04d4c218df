"""Predicting a schedule's step time, bubble and memory from measured per-stage costs.

The simulator replays a :class:`~gpipe_core.schedule.Schedule` in continuous time: each stage
runs its actions in order, an action starts when the stage is free and its dependency has
arrived (``F(s, m)`` after ``F(s-1, m)`` plus the transfer time; ``B(s, m)`` and ``I(s, m)``
after ``F(s, m)`` and the gradient from stage s+1, its ``B`` or ``I``, plus the transfer time;
``W(s, m)`` after ``I(s, m)`` on the same stage). A re-materialized micro-batch runs its first
forward without autograd and pays a forward with autograd again in its backward (B or I; W
reuses the graph I rebuilt). The result carries the same :class:`TimelineEvent` records the
runtime writes, so a predicted timeline draws exactly like a measured one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .events import TimelineEvent
from .remat import Checkpoint, checkpoint_stop
from .schedule import Schedule
from .stage_profile import StageProfile

__all__ = ["Simulation", "simulate"]


@dataclass
class Simulation:
    """What a schedule would do with the given costs."""

    step_time: float
    bubble_fraction: float  # idle share of all ranks' time over the step
    events: list[TimelineEvent]
    peak_inflight: list[int]  # per rank: most micro-batches between their F and their B/W
    peak_bytes: list[float]  # per rank: the most bytes of those given it held at once (0
    # without sizes): kept activations; with messages, gradients and working bytes, all
    # (a rank is a stage without virtual stages; with them a micro-batch counts per stage)


def simulate(
    schedule: Schedule,
    forward: Sequence[float] | StageProfile,
    backward: Sequence[float] | None = None,
    *,
    backward_input: Sequence[float] | None = None,
    backward_weight: Sequence[float] | None = None,
    transfer: float | Sequence[float] | None = None,
    checkpoint: Checkpoint | None = None,
    recompute: Sequence[float] | None = None,
    forward_no_grad: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    input_bytes: Sequence[float] | None = None,
    output_bytes: Sequence[float] | None = None,
    gradient_bytes: Sequence[float] | None = None,
    working_bytes: Sequence[float] | None = None,
    kept_bytes: Sequence[float] | None = None,
    backward_working_bytes: Sequence[float] | None = None,
    first_backward_working_bytes: Sequence[float] | None = None,
    posted_receives: bool = False,
    inputs_held: bool = False,
    message_cpu: float | Sequence[float] = 0.0,
    per_round: bool = False,
) -> Simulation:
    """Simulate ``schedule`` with per-stage, per-micro-batch forward/backward times; a rank
    runs one action at a time (with virtual stages, several stages' actions in its row's order).

    ``forward`` may be a :class:`~gpipe_core.stage_profile.StageProfile` (what
    :func:`~gpipe_core.profile.profile_stages` measured): its costs, transfer times and
    re-materialization mode are then the defaults of every cost argument and ``checkpoint``;
    an argument given beside it replaces the profile's.

    Backward costs: ``backward[s]`` is a whole backward (B); ``backward_input[s]`` (I) and
    ``backward_weight[s]`` (W) are its two halves in a split schedule. Give ``backward``, or
    both halves (then B costs their sum), or ``backward`` and one half (the other is the rest).
    With only ``backward``, I and W are taken to cost half of it each.
    ``transfer``: seconds from the end of an action to its dependant's earliest start on the
    neighbouring stage, one value for every boundary or one per boundary ``s -> s+1`` (K-1
    values; activations and gradients cross a boundary in the same time; a boundary inside a
    rank, between two of its virtual stages, costs nothing).
    Re-materialized micro-batches (``checkpoint``) run their forward without autograd
    (``forward_no_grad[s]``, default ``forward[s]``) and pay a forward with autograd again
    before their backward, in B or I (``recompute[s]``, default ``forward[s]``).
    ``activation_bytes[s]``: what stage s keeps for one micro-batch's backward without
    re-materialization, from F until B or W; ``input_bytes[s]``: its input, all it keeps when
    re-materialized until B or I (I rebuilds the graph, which W needs: activation bytes again).
    ``kept_bytes[s]``: what a re-materialized micro-batch keeps instead of ``input_bytes[s]``;
    for a selective choice (a :class:`~gpipe_core.remat.Remat`, under which every micro-batch
    is re-materialized as far as the choice says) the kept layers' activations and the inputs
    of the recomputed runs, with ``recompute[s]`` the forward of the recomputed layers only.
    Optional, for a rank's whole tensor memory in a step: ``output_bytes[s]``, the message stage
    s sends downstream (its input gradient, sent upstream, is ``input_bytes[s]``; a rank holds
    the messages it sent to another rank as the transport does: an activation until the
    gradient of its micro-batch, or of a later one, comes back; an input gradient until the
    step ends, as nothing the previous stage sends later in the step shows it was taken);
    ``gradient_bytes[s]``, its parameters' gradients, held from its first B or W on; ``working_bytes[s]``, the most one of its actions
    adds while it runs above what the rank holds for the other micro-batches, this one's input
    included (a re-materialized backward's recomputed activations are in it). Without
    ``working_bytes`` the peak is taken between actions only. ``backward_working_bytes[s]``:
    the most a B (or I) of stage s adds while it runs to what the rank holds just before it
    (that micro-batch's kept bytes included, the activations its gradient answered freed):
    what a plan counts from per-layer costs, where ``working_bytes`` is measured per action.
    ``first_backward_working_bytes[s]``: the same for stage s's first B, which makes its
    parameters' gradients as it goes (default: ``backward_working_bytes[s]`` plus all of
    ``gradient_bytes[s]``, an upper bound). ``posted_receives``: the transport posts each
    link's next receive as soon as the current one arrives (gloo's, :mod:`~gpipe_core.channel`),
    so a rank also holds one message-sized buffer per link it receives on from another rank
    (``input_bytes[s]`` for activations, ``output_bytes[s]`` for gradients) from the step's
    start until that link's last message arrives. ``inputs_held``: the first stage's inputs are
    views of the caller's batch (as the pipelines split it), alive through the whole step: its
    rank holds all M of them (``input_bytes[0]`` each) from the start, and stage 0 keeps
    nothing more for them per micro-batch.

    ``message_cpu``: seconds of each end's own compute a message across boundary ``s -> s+1``
    takes (one value, or one per boundary), where the two stages run on different ranks: a
    transport that copies on the ranks' cores (gloo over loopback: the sender's core writes
    the message, the receiver's reads it) takes it from the stage's work. The sending action
    (an F sending its output, a B or I sending its input's gradient) and the action that takes
    the message (the next stage's F, the previous stage's B or I) each last that much longer;
    ``transfer`` stays the delay on the way.

    ``per_round`` (with a profile): simulate each of the profile's timed rounds with that
    round's own costs (:meth:`~gpipe_core.stage_profile.StageProfile.round`) and return the round
    of median step time (the lower of the two middle ones for an even count). A step lasts as
    long as its slowest path, so where costs vary from round to round the median of the
    rounds' step times is mostly above the step time of the median costs: this predicts the
    median step a pipeline will measure, where the median costs tend to predict one too fast.
    """
    if per_round:
        if not isinstance(forward, StageProfile):
            raise ValueError("per_round=True simulates a profile's rounds: give a StageProfile "
                             "(profile_stages, profile_timeline) as the costs")
        rounds = forward.num_rounds
        if rounds == 0:
            raise ValueError("the profile keeps no per-round samples; use per_round=False")
        runs = sorted((simulate(schedule, forward.round(r), backward,
                                backward_input=backward_input, backward_weight=backward_weight,
                                transfer=transfer, checkpoint=checkpoint, recompute=recompute,
                                forward_no_grad=forward_no_grad,
                                activation_bytes=activation_bytes, input_bytes=input_bytes,
                                output_bytes=output_bytes, gradient_bytes=gradient_bytes,
                                working_bytes=working_bytes, kept_bytes=kept_bytes,
                                backward_working_bytes=backward_working_bytes,
                                first_backward_working_bytes=first_backward_working_bytes,
                                posted_receives=posted_receives, inputs_held=inputs_held,
                                message_cpu=message_cpu)
                       for r in range(rounds)),
                      key=lambda sim: sim.step_time)
        return runs[(rounds - 1) // 2]
    if isinstance(forward, Sequence):
        forward_costs: Sequence[float] = forward
    else:  # a StageProfile
        measured = forward.simulate_kwargs()
        forward_costs = measured["forward"]
        if backward is None and backward_input is None and backward_weight is None:
            backward = measured["backward"]
            backward_input = measured.get("backward_input")
            backward_weight = measured.get("backward_weight")
        transfer = measured["transfer"] if transfer is None else transfer
        recompute = measured["recompute"] if recompute is None else recompute
        forward_no_grad = measured["forward_no_grad"] if forward_no_grad is None else forward_no_grad
        checkpoint = measured["checkpoint"] if checkpoint is None else checkpoint
    transfer = 0.0 if transfer is None else transfer
    checkpoint = "never" if checkpoint is None else checkpoint
    k, m = schedule.num_stages, schedule.num_microbatches
    ranks, placement = schedule.num_ranks, schedule.placement
    for name, values in (("forward", forward_costs), ("backward", backward),
                         ("backward_input", backward_input), ("backward_weight", backward_weight),
                         ("recompute", recompute), ("forward_no_grad", forward_no_grad)):
        if values is not None and len(values) != k:
            raise ValueError(f"{name} has {len(values)} costs for {k} stages; give one per stage")
    for name, values in (("activation_bytes", activation_bytes), ("input_bytes", input_bytes),
                         ("output_bytes", output_bytes), ("gradient_bytes", gradient_bytes),
                         ("working_bytes", working_bytes), ("kept_bytes", kept_bytes),
                         ("backward_working_bytes", backward_working_bytes),
                         ("first_backward_working_bytes", first_backward_working_bytes)):
        if values is not None and len(values) != k:
            raise ValueError(f"{name} has {len(values)} sizes for {k} stages; give one per stage")
    costs = {"F": list(forward_costs), **_backward_costs(backward, backward_input, backward_weight)}
    links = _per_boundary("transfer", transfer, placement)
    copies = _per_boundary("message_cpu", message_cpu, placement)
    # each action's share of its messages: F receives from s-1 and sends to s+1; B (or I)
    # receives from s+1 and sends to s-1; W sends nothing
    messages = [(copies[s - 1] if s > 0 else 0.0) + (copies[s] if s + 1 < k else 0.0)
                for s in range(k)]
    rerun = list(forward_costs) if recompute is None else list(recompute)
    first_pass = list(forward_costs) if forward_no_grad is None else list(forward_no_grad)
    stop = checkpoint_stop(checkpoint, m)
    finish: dict[tuple[int, str, int], float] = {}
    free = [0.0] * ranks
    cursor = [0] * ranks
    events: list[TimelineEvent] = []
    inflight = [0] * ranks
    peak_inflight = [0] * ranks
    memory = [_RankMemory() for _ in range(ranks)]
    sizes = _Sizes(activation_bytes, input_bytes, output_bytes, gradient_bytes, working_bytes,
                   kept_bytes, backward_working_bytes, first_backward_working_bytes,
                   inputs_held and input_bytes is not None and activation_bytes is not None)
    if sizes.inputs_held:
        assert input_bytes is not None
        memory[placement[0]].kept = m * float(input_bytes[0])
    if posted_receives and input_bytes is not None and output_bytes is not None:
        for s in range(k):  # each link this stage receives on from another rank: m messages
            r = placement[s]
            if s > 0 and placement[s - 1] != r:
                memory[r].posted[("F", s)] = (float(input_bytes[s]), m)
            if s + 1 < k and placement[s + 1] != r:
                memory[r].posted[("BI", s)] = (float(output_bytes[s]), m)
    total = sum(len(row) for row in schedule.actions)
    done = 0
    while done < total:
        progressed = False
        for r, row in enumerate(schedule.actions):
            while cursor[r] < len(row):
                action = row[cursor[r]]
                s = action.stage
                ready = _ready_time(action.kind, s, action.mb, k, finish, links)
                if ready is None:
                    break
                start = max(free[r], ready)
                rematerialized = action.mb < stop
                duration = costs[action.kind][s]
                if action.kind == "F" and rematerialized:
                    duration = first_pass[s]
                elif action.kind in "BI" and rematerialized:
                    duration += rerun[s]
                if action.kind != "W":
                    duration += messages[s]
                end = start + duration
                finish[(s, action.kind, action.mb)] = end
                if action.kind == "B":
                    finish[(s, "I", action.mb)] = end  # a B sends the input gradient too
                free[r] = end
                events.append(TimelineEvent(s, str(action), start, end))
                inflight[r] += {"F": 1, "I": 0}.get(action.kind, -1)  # B or W ends it
                peak_inflight[r] = max(peak_inflight[r], inflight[r])
                sends_to_other_rank = (
                    (action.kind == "F" and s + 1 < k and placement[s + 1] != placement[s])
                    or (action.kind in "BI" and s > 0 and placement[s - 1] != placement[s]))
                memory[r].run(action.kind, s, action.mb, rematerialized, sizes,
                              sends_to_other_rank)
                cursor[r] += 1
                done += 1
                progressed = True
        if not progressed:
            schedule.clock()  # raises ScheduleError with the grid
            raise AssertionError("unreachable: a valid schedule always progresses")
    step_time = max(free)
    busy = sum(e.end - e.start for e in events)
    bubble = 1.0 - busy / (step_time * ranks) if step_time > 0 else 0.0
    return Simulation(step_time, bubble, events, peak_inflight, [mem.peak for mem in memory])


def _per_boundary(name: str, value: float | Sequence[float], placement: Sequence[int]
                  ) -> list[float]:
    """One value per boundary ``s -> s+1`` from one number or one per boundary; 0 where both
    stages run on the same rank (nothing leaves the process)."""
    k = len(placement)
    if isinstance(value, (int, float)):
        values = [float(value)] * max(k - 1, 0)
    else:
        values = [float(v) for v in value]
        if len(values) != k - 1:
            raise ValueError(f"{name} has {len(values)} values for {k - 1} boundaries between "
                             f"{k} stages; give one per boundary or a single number")
    return [0.0 if placement[s] == placement[s + 1] else v for s, v in enumerate(values)]


def _ready_time(
    kind: str, s: int, mb: int, k: int, finish: dict[tuple[int, str, int], float],
    links: Sequence[float],
) -> float | None:
    if kind == "F":
        if s == 0:
            return 0.0
        previous = finish.get((s - 1, "F", mb))
        return None if previous is None else previous + links[s - 1]
    if kind == "W":
        return finish.get((s, "I", mb))
    own = finish.get((s, "F", mb))
    if own is None:
        return None
    if s == k - 1:
        return own
    later = finish.get((s + 1, "I", mb))  # the next stage's B or I sent the gradient
    return None if later is None else max(own, later + links[s])


@dataclass
class _Sizes:
    """The per-stage sizes :func:`simulate` was given (``None``: not modelled)."""

    activation: Sequence[float] | None
    input: Sequence[float] | None
    output: Sequence[float] | None
    gradient: Sequence[float] | None
    working: Sequence[float] | None
    selective: Sequence[float] | None = None  # kept when re-materialized, if not the input
    backward_working: Sequence[float] | None = None  # a B or I's own, above all held
    first_backward_working: Sequence[float] | None = None  # a stage's first B, its gradients
    inputs_held: bool = False  # stage 0's inputs: the caller's batch, held apart

    def first_backward(self, s: int) -> float | None:
        """What stage s's first B adds while it runs, the gradients it makes included."""
        if self.first_backward_working is not None:
            return self.first_backward_working[s]
        if self.backward_working is None:
            return None
        return self.backward_working[s] + (self.gradient[s] if self.gradient is not None
                                           else 0.0)

    def kept(self, s: int, rematerialized: bool) -> float:
        """What stage s keeps for one micro-batch from its F until its B (or I, then W)."""
        if self.activation is None:
            return 0.0
        if rematerialized:
            if self.selective is not None:
                kept = self.selective[s]
            else:
                kept = self.input[s] if self.input is not None else 0.0
        else:
            kept = self.activation[s]
        if s == 0 and self.inputs_held and self.input is not None:
            return max(kept - self.input[0], 0.0)
        return kept

    def received(self, s: int) -> float:
        return self.input[s] if self.input is not None else 0.0


@dataclass
class _RankMemory:
    """One rank's tensor bytes as its actions run, and their peak."""

    kept: float = 0.0  # the pending micro-batches' activations (or inputs, re-materialized)
    # messages sent to another rank and still held: activations by (stage, micro-batch), until
    # that micro-batch's gradient (or a later one's) comes back; input gradients, to the end
    sent_activations: dict[tuple[int, int], float] = field(default_factory=dict)
    sent_gradients: float = 0.0
    # receives posted early, by link ((kind, stage) receiving): (bytes, messages still to come)
    posted: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    gradients: float = 0.0  # the gradients of its stages that have run a backward
    stages_with_gradients: set[int] = field(default_factory=set)
    peak: float = 0.0

    @property
    def sent(self) -> float:
        """Message buffers held: sent ones not yet known taken, and receives posted early."""
        return (sum(self.sent_activations.values()) + self.sent_gradients
                + sum(size for size, _ in self.posted.values()))

    def run(self, kind: str, s: int, mb: int, rematerialized: bool, sizes: _Sizes,
            sends_to_other_rank: bool) -> None:
        """Account for one action of stage s on micro-batch mb: its peak while it runs, then
        what it leaves."""
        if kind in "BI":  # its gradient came back: the activations it answers were taken
            for key in [key for key in self.sent_activations if key[0] == s and key[1] <= mb]:
                del self.sent_activations[key]
        link = ("F", s) if kind == "F" else ("BI", s) if kind in "BI" else None
        if link in self.posted:  # a message arrived: the next receive is posted, if one is due
            size, left = self.posted[link]
            if left > 1:
                self.posted[link] = (size, left - 1)
            else:
                del self.posted[link]
        # What this micro-batch holds when the action starts: nothing before its F; after an
        # I, the graph I rebuilt (activation bytes), which W frees.
        held = sizes.kept(s, rematerialized)
        if kind == "F":
            before = 0.0
        elif kind == "W":
            before = sizes.kept(s, False)
        else:
            before = held
        if kind in "BI" and sizes.backward_working is not None:  # everything held, and its work
            working = sizes.backward_working[s]
            if kind == "B" and s not in self.stages_with_gradients:
                first = sizes.first_backward(s)
                working = working if first is None else first
            self.peak = max(self.peak, self.kept + self.sent + self.gradients + working)
        if sizes.working is not None:  # during the action: the others, its input, its work
            self.peak = max(self.peak, self.kept - before + sizes.received(s) + self.sent
                            + self.gradients + sizes.working[s])
        if kind == "F":
            self.kept += held
        elif kind == "I":  # I rebuilt a re-materialized micro-batch's graph; W needs it
            self.kept += sizes.kept(s, False) - held
        else:  # B or W: the micro-batch's state is freed
            self.kept -= before
        if kind in "BW" and sizes.gradient is not None and s not in self.stages_with_gradients:
            self.stages_with_gradients.add(s)
            self.gradients += sizes.gradient[s]
        if sends_to_other_rank and sizes.output is not None:
            # F sends the output downstream; B or I the input gradient, of the input's size.
            if kind == "F":
                self.sent_activations[(s, mb)] = sizes.output[s]
            else:
                self.sent_gradients += sizes.received(s)
        self.peak = max(self.peak, self.kept + self.sent + self.gradients)


def _backward_costs(
    backward: Sequence[float] | None,
    backward_input: Sequence[float] | None,
    backward_weight: Sequence[float] | None,
) -> dict[str, list[float]]:
    """Per-stage costs of B, I and W from whichever of them were given."""
    if backward is None:
        if backward_input is None or backward_weight is None:
            raise ValueError("give backward costs: backward, or backward_input and "
                             "backward_weight (B then costs their sum)")
        inputs, weights = list(backward_input), list(backward_weight)
        return {"B": [i + w for i, w in zip(inputs, weights, strict=True)], "I": inputs,
                "W": weights}
    whole = list(backward)
    if backward_input is not None and backward_weight is not None:
        inputs, weights = list(backward_input), list(backward_weight)
    elif backward_input is not None:
        inputs = list(backward_input)
        weights = [b - i for b, i in zip(whole, inputs, strict=True)]
    elif backward_weight is not None:
        weights = list(backward_weight)
        inputs = [b - w for b, w in zip(whole, weights, strict=True)]
    else:
        inputs = weights = [b / 2 for b in whole]
    return {"B": whole, "I": inputs, "W": weights}
