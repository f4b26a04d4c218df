"""StageRuntime as a unit: one step over in-process transports, driven by the runtime."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn

from gpipe_core.runtime import StageRuntime, StepCounter, StepState
from gpipe_core.schedule import fill_drain, one_f_one_b, zb_h1, zb_h2
from gpipe_core.stage import Stage
from gpipe_core.transport import LocalTransport, Mailbox

CPU = torch.device("cpu")


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


def runtimes(model: nn.Sequential, *, record: bool = False) -> list[StageRuntime]:
    mailbox: Mailbox = {}
    layers = list(model._modules.items())
    stages = [
        Stage(layers[:1], stage_index=0, num_stages=2, first_layer_index=0, device=CPU,
              checkpoint="except_last", seed=0),
        Stage(layers[1:], stage_index=1, num_stages=2, first_layer_index=1, device=CPU,
              checkpoint="except_last", seed=0, loss_fn=loss_fn),
    ]
    return [StageRuntime(stage, LocalTransport(stage.stage_index, [CPU, CPU], mailbox),
                         record=record) for stage in stages]


@pytest.mark.parametrize("schedule", [fill_drain, one_f_one_b, zb_h1, zb_h2])
def test_a_step_carries_the_loss_back_and_matches_the_plain_model(schedule) -> None:  # type: ignore[no-untyped-def]
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    pieces = list(zip(x.chunk(3), y.chunk(3), strict=True))
    with torch.no_grad():
        expected = sum(float(loss_fn(model(a), b)) for a, b in pieces)
    state = StepState(7, 3, inputs=[a for a, _ in pieces], targets=[b for _, b in pieces],
                      keep_outputs=False)
    pipeline = runtimes(model, record=True)
    for runtime in pipeline:
        runtime.begin_step(state)
    for tick in schedule(2, 3).clock():
        for action in tick:
            pipeline[action.stage].run_action(action, state)
    carried = [runtime.finish_step() for runtime in pipeline]
    assert carried[0] == pytest.approx(expected, rel=1e-12)  # the first stage got the loss
    assert math.isnan(carried[1])  # nothing comes back to the last stage
    assert float(pipeline[1].stage.step_loss(7)) == pytest.approx(expected, rel=1e-12)  # type: ignore[arg-type]
    assert set(state.input_grads) == {0, 1, 2}
    assert [e.action for e in pipeline[0].timeline][:1] == ["0F0"]
    assert all(e.start <= e.ready <= e.end for r in pipeline for e in r.timeline)  # type: ignore[operator]


def test_forward_only_step_keeps_outputs_and_carries_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    state = StepState(-1, 2, backward=False, inputs=list(torch.randn(4, 3).chunk(2)),
                      targets=list(torch.randn(4, 2).chunk(2)))
    pipeline = runtimes(model)
    with torch.no_grad():
        for runtime in pipeline:
            runtime.begin_step(state)
        for action in [a for tick in fill_drain(2, 2).clock() for a in tick if a.kind == "F"]:
            pipeline[action.stage].run_action(action, state)
    assert sorted(state.outputs) == [0, 1]
    assert all(math.isnan(runtime.finish_step()) for runtime in pipeline)


def test_a_later_stage_needs_the_count_from_its_transport() -> None:
    pipeline = runtimes(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)))
    with pytest.raises(NotImplementedError, match="micro-batch count"):
        pipeline[1].begin_step(StepState(0, 0))


def test_step_counter() -> None:
    class Counted(StepCounter):
        _step = 0

    counted = Counted()
    counted.steps_done = 5  # type: ignore[assignment]
    assert counted.steps_done == 5 and counted._step == 5


@pytest.mark.parametrize("schedule", [zb_h1, zb_h2])
def test_split_backward_step_gives_the_plain_models_gradients(schedule) -> None:  # type: ignore[no-untyped-def]
    # I sends the gradient like B; W sends nothing; the carried loss still arrives although
    # W actions run after the last gradient message.
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    reference = copy.deepcopy(model)
    sum(loss_fn(reference(a), b) for a, b in zip(x.chunk(4), y.chunk(4), strict=True)).backward()
    state = StepState(0, 4, inputs=list(x.chunk(4)), targets=list(y.chunk(4)), keep_outputs=False)
    pipeline = runtimes(model, record=True)
    for runtime in pipeline:
        runtime.begin_step(state)
    for tick in schedule(2, 4).clock():
        for action in tick:
            pipeline[action.stage].run_action(action, state)
    carried = [runtime.finish_step() for runtime in pipeline]
    assert not math.isnan(carried[0])
    assert all(r.stage.num_saved == 0 for r in pipeline)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    kinds = {e.action[1] for r in pipeline for e in r.timeline}
    assert kinds == {"F", "I", "W"}
