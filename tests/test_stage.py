"""Stage as a unit: per-micro-batch state, the step loss, and clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gpipe_core.stage import Stage, StagePosition

CPU = torch.device("cpu")


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).pow(2).mean()


def stage(*, checkpoint: str = "except_last", loss: bool = True) -> Stage:
    layers = [("0", nn.Linear(3, 2)), ("1", nn.Tanh())]
    return Stage(layers, stage_index=1, num_stages=2, first_layer_index=4, device=CPU,
                 checkpoint=checkpoint, seed=0, loss_fn=loss_fn if loss else None)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_state_is_kept_until_backward_and_the_step_loss_sums_micro_batches(checkpoint: str) -> None:
    s = stage(checkpoint=checkpoint)
    s.begin_step(0, 2)
    xs, ys = torch.randn(2, 4, 3).unbind(), torch.randn(2, 4, 2).unbind()
    for mb in range(2):
        s.forward(0, mb, xs[mb], ys[mb])
    assert s.num_saved == 2
    expected = sum(loss_fn(s.layers[1][1](s.layers[0][1](x)), y) for x, y in zip(xs, ys, strict=True))
    step_loss = s.step_loss(0)
    assert step_loss is not None and step_loss.dtype == torch.float64
    assert float(step_loss) == pytest.approx(float(expected.detach()), rel=1e-6)  # type: ignore[union-attr]
    for mb in range(2):
        s.backward(0, mb, None)
    assert s.num_saved == 0
    s.discard(0)
    assert not s.losses


def test_without_loss_fn_there_is_no_step_loss() -> None:
    s = stage(loss=False)
    s.begin_step(0, 1)
    s.forward(0, 0, torch.randn(2, 3))
    assert s.step_loss(0) is None


def test_backward_without_forward_is_a_clear_error() -> None:
    s = stage()
    s.begin_step(0, 1)
    with pytest.raises(RuntimeError, match="no forward state for micro-batch 0 of step 0"):
        s.backward(0, 0, None)


def test_unknown_checkpoint_mode() -> None:
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        stage(checkpoint="sometimes")


def test_stage_position() -> None:
    class Position(StagePosition):
        def __init__(self, index: int, count: int) -> None:
            self.stage_index, self.num_stages = index, count

    assert [(p.is_first, p.is_last) for p in (Position(0, 3), Position(1, 3), Position(2, 3))] \
        == [(True, False), (False, False), (False, True)]
    assert Position(0, 1).is_first and Position(0, 1).is_last
