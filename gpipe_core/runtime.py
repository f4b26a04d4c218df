"""Walking a stage's action list over a transport: the one place that runs a scheduled action.

For every action of the schedule the runtime fetches what the stage needs (the user's
micro-batch on the first stage, a neighbour's message elsewhere), runs the stage, and hands the
result on (to the next stage, or to the step's results on the last). The same code serves the
single-process :class:`~gpipe_core.GPipe` (all stages, actions in clock order) and the
multi-process :class:`~gpipe_core.DistributedGPipe` (one stage, its own action list).

A step over any transport::

    runtime.begin_step(state)   # learn the micro-batch count (stages after the first), tell
                                # the transport and the stage
    runtime.run(actions, state) # the stage's actions; its last gradient message carries the
                                # step's loss (last stage) or the loss it received (others)
    runtime.finish_step()       # every send has left; returns the value carried back (or NaN)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .events import TimelineEvent
from .schedule import Action
from .stage import Stage
from .transport import Transport

__all__ = ["StepState", "StageRuntime", "StepCounter", "TimelineEvent"]


@dataclass
class StepState:
    """Inputs and results of one step, shared by the stages that run in this process."""

    step: int
    num_microbatches: int  # 0: not known yet, learnt from the previous stage's first message
    backward: bool = True  # gradients flow back in this step
    inputs: list[Any] = field(default_factory=list)  # per micro-batch, read by the first stage
    targets: list[Any] = field(default_factory=list)  # per micro-batch, read by the last stage
    outputs: dict[int, Any] = field(default_factory=dict)  # last stage's output per micro-batch
    keep_outputs: bool = True  # the last stage keeps its outputs (GPipe returns them)
    output_grads: dict[int, list[Tensor | None]] = field(default_factory=dict)  # given to last
    input_grads: dict[int, list[Tensor | None]] = field(default_factory=dict)  # first's result


class StepCounter:
    """``steps_done`` of a pipeline module that counts its steps in ``_step``."""

    _step: int

    @property
    def steps_done(self) -> int:
        """Steps run so far; part of every layer's random seed, so restore it when resuming."""
        return self._step

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self._step = int(value)


class StageRuntime:
    """Executes actions of one :class:`Stage`, communicating through one :class:`Transport`."""

    def __init__(self, stage: Stage, transport: Transport, *, record: bool = False) -> None:
        self.stage = stage
        self.transport = transport
        self.record = record
        self.timeline: list[TimelineEvent] = []
        # B or I actions (those that send a gradient) left in the current step; the last one
        # carries a value back.
        self._backwards_left = 0

    def begin_step(self, state: StepState) -> None:
        """Start ``state.step``; a zero ``state.num_microbatches`` is learnt from the previous
        stage's first activation (:class:`~gpipe_core.transport.StepMismatch` if it is at
        another step)."""
        if not state.num_microbatches:
            state.num_microbatches = self.transport.recv_step(state.step)
        self.transport.begin_step(state.step, state.num_microbatches, backward=state.backward)
        self.stage.begin_step(state.step, state.num_microbatches)
        self._backwards_left = state.num_microbatches if state.backward else 0

    def finish_step(self) -> float:
        """Wait until every message of the step has left; return the value its last gradient
        message carried back (the step's loss), NaN if none did."""
        self.transport.finish()
        return self.transport.carried()

    def run(self, actions: Iterable[Action], state: StepState) -> None:
        for action in actions:
            self.run_action(action, state)

    def run_action(self, action: Action, state: StepState) -> None:
        stage = self.stage
        start = time.perf_counter() if self.record else 0.0
        mb = action.mb
        if action.kind == "F":
            inputs = state.inputs[mb] if stage.is_first else self.transport.recv_activation(mb)
            targets = state.targets[mb] if stage.is_last and state.targets else None
            ready = time.perf_counter() if self.record else 0.0
            outputs = stage.forward(state.step, mb, inputs, targets)
            if stage.is_last:
                if state.keep_outputs:
                    state.outputs[mb] = outputs
            else:
                self.transport.send_activation(mb, outputs)
        elif action.kind == "W":  # the parameters' gradient: nothing to receive or send
            ready = start
            stage.backward_weight(state.step, mb)
        else:  # B or I: receive the output gradient, send the input gradient
            if stage.is_last:
                grads = None if stage.loss_fn is not None else state.output_grads.pop(mb)
            else:
                grads = self.transport.recv_gradient(mb)
            ready = time.perf_counter() if self.record else 0.0
            if action.kind == "B":
                input_grads = stage.backward(state.step, mb, grads)
            else:
                input_grads = stage.backward_input(state.step, mb, grads)
            self._backwards_left -= 1  # gradient messages left; the last one carries
            if stage.is_first:
                state.input_grads[mb] = input_grads
            else:
                carry = self._carry(state.step) if self._backwards_left == 0 else math.nan
                self.transport.send_gradient(mb, input_grads, carry=carry)
        if self.record:
            self.timeline.append(
                TimelineEvent(stage.stage_index, str(action), start, time.perf_counter(), ready)
            )

    def _carry(self, step: int) -> float:
        """What the step's last gradient message takes back: the step's loss."""
        if self.stage.is_last:
            loss = self.stage.step_loss(step)
            return math.nan if loss is None else float(loss)
        return self.transport.carried()
