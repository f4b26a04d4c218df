"""Transparency: GPipe gives the plain module's outputs and gradients, for every cut."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gpipe_core as gp

TOL = 1e-10
BALANCES = {1: [[6]], 2: [[3, 3], [1, 5]], 3: [[2, 2, 2], [4, 1, 1]], 4: [[1, 2, 2, 1], [3, 1, 1, 1]]}


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8), nn.Softplus()
    ).double()


class Split(nn.Module):
    """Opens a (x, skip) pair, as AmoebaNet's stem does."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x * 2


class Cell(nn.Module):
    """Takes (x, skip) and returns (new, x): the previous output becomes the next skip."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, skip = pair
        return torch.tanh(self.a(x) + self.b(skip)), x


class Join(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0] + pair[1]


def skip_net() -> nn.Sequential:
    return nn.Sequential(Split(), Cell(6), Cell(6), Cell(6), Cell(6), Join()).double()


def assert_same_grads(pipe: nn.Module, ref: nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    names = [name for name, _ in pipe.named_parameters()]
    assert names == list(ref_params)
    for name, param in pipe.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=0, atol=TOL, msg=name)


def run_both(
    build: Any, balance: list[int], chunks: int, checkpoint: str, x: Tensor
) -> tuple[Tensor, Tensor]:
    ref = build()
    model = copy.deepcopy(ref)
    pipe = gp.GPipe(model, balance, chunks=chunks, checkpoint=checkpoint)
    x_ref = x.clone().requires_grad_()
    x_pipe = x.clone().requires_grad_()
    out_ref, out_pipe = ref(x_ref), pipe(x_pipe)
    torch.testing.assert_close(out_pipe, out_ref, rtol=0, atol=TOL)
    (out_ref**2).sum().backward()
    (out_pipe**2).sum().backward()
    assert_same_grads(pipe, ref)
    torch.testing.assert_close(x_pipe.grad, x_ref.grad, rtol=0, atol=TOL)
    assert all(stage.num_saved == 0 for stage in pipe.stages)
    return out_pipe, out_ref


GRID = [
    (balance, chunks, checkpoint)
    for k in (1, 2, 3, 4)
    for balance in BALANCES[k]
    for chunks in (1, 2, 3, 4, 8)
    for checkpoint in ("always", "except_last", "never")
]


@pytest.mark.parametrize(("balance", "chunks", "checkpoint"), GRID)
def test_transparent_mlp(balance: list[int], chunks: int, checkpoint: str) -> None:
    run_both(mlp, balance, chunks, checkpoint, torch.randn(11, 5, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[6], [1, 5], [2, 2, 2], [1, 1, 2, 2]])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_transparent_tuple_skip(balance: list[int], chunks: int, checkpoint: str) -> None:
    run_both(skip_net, balance, chunks, checkpoint, torch.randn(9, 6, dtype=torch.float64))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_batch_smaller_than_chunks(checkpoint: str) -> None:
    run_both(mlp, [2, 2, 2], 8, checkpoint, torch.randn(3, 5, dtype=torch.float64))


class TaggedInput(nn.Module):
    """A layer that reads a non-tensor flag riding along in the tuple and passes it on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, batch: tuple[Tensor, str, Tensor]) -> tuple[Tensor, str, Tensor]:
        x, mode, mask = batch
        y = self.linear(x)
        y = y * mask.unsqueeze(-1) if mode == "masked" else y
        return y, mode, mask


class TakeFirst(nn.Module):
    def forward(self, batch: tuple[Tensor, str, Tensor]) -> Tensor:
        return batch[0]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_non_tensor_passthrough_and_integer_masks(checkpoint: str) -> None:
    ref = nn.Sequential(TaggedInput(), TaggedInput(), TaggedInput(), TakeFirst()).double()
    pipe = gp.GPipe(copy.deepcopy(ref), [1, 2, 1], chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 4, dtype=torch.float64)
    mask = torch.randint(0, 2, (7,))
    out_ref = ref((x, "masked", mask))
    out_pipe = pipe((x, "masked", mask))
    torch.testing.assert_close(out_pipe, out_ref, rtol=0, atol=TOL)
    out_ref.sum().backward()
    out_pipe.sum().backward()
    assert_same_grads(pipe, ref)


def test_tuple_output_and_dict_input() -> None:
    class FromDict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            return self.linear(batch["x"]), batch["y"]

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            return self.linear(pair[0]), pair[1] * 3

    ref = nn.Sequential(FromDict(), Both(), Both()).double()
    pipe = gp.GPipe(copy.deepcopy(ref), [1, 2], chunks=2)
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    y_ref = y.detach().clone().requires_grad_()
    a_ref, b_ref = ref({"x": x, "y": y_ref})
    a, b = pipe({"x": x, "y": y})
    torch.testing.assert_close((a, b), (a_ref, b_ref), rtol=0, atol=TOL)
    (a_ref.sum() + (b_ref**2).sum()).backward()
    (a.sum() + (b**2).sum()).backward()
    assert_same_grads(pipe, ref)
    torch.testing.assert_close(y.grad, y_ref.grad, rtol=0, atol=TOL)


def test_no_grad_forward_keeps_no_state() -> None:
    ref = mlp()
    pipe = gp.GPipe(copy.deepcopy(ref), [3, 3], chunks=4)
    x = torch.randn(8, 5, dtype=torch.float64)
    with torch.no_grad():
        out = pipe(x)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=TOL)
    assert all(stage.num_saved == 0 for stage in pipe.stages)


def test_dropped_output_frees_stage_state() -> None:
    pipe = gp.GPipe(mlp(), [3, 3], chunks=4, checkpoint="never")
    out = pipe(torch.randn(8, 5, dtype=torch.float64))
    assert sum(stage.num_saved for stage in pipe.stages) == 8
    del out
    assert all(stage.num_saved == 0 for stage in pipe.stages)


def test_names_and_state_dict_are_the_plain_modules() -> None:
    ref = skip_net()
    pipe = gp.GPipe(copy.deepcopy(ref), [2, 4], chunks=2)
    assert list(pipe.state_dict()) == list(ref.state_dict())
    pipe.load_state_dict(ref.state_dict())
    assert len(pipe) == len(ref)


def test_several_partitions_on_one_device() -> None:
    run_both(mlp, [2, 2, 2], 4, "except_last", torch.randn(8, 5, dtype=torch.float64))
    pipe = gp.GPipe(mlp(), [2, 2, 2], devices=["cpu", "cpu", "cpu"], chunks=2)
    assert [s.device.type for s in pipe.stages] == ["cpu"] * 3


def test_float32_training_step_matches_closely() -> None:
    ref = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    pipe = gp.GPipe(copy.deepcopy(ref), [2, 3], chunks=4)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        for model, opt in ((ref, opt_ref), (pipe, opt_pipe)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for p, q in zip(pipe.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# --- dropout: the per-layer random streams make results independent of the cut -------------


def dropout_net(p: float = 0.5) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 32), nn.Dropout(p), nn.Linear(32, 32), nn.Dropout(p), nn.Linear(32, 3)
    ).double()


def test_dropout_is_bitwise_equal_across_balances_and_checkpoint_modes() -> None:
    torch.manual_seed(1)
    base = dropout_net()
    x = torch.randn(12, 6, dtype=torch.float64)
    results = []
    balances = [[5], [2, 3], [1, 2, 2], [1, 1, 2, 1]]
    for balance, checkpoint in itertools.product(balances, ["always", "except_last", "never"]):
        pipe = gp.GPipe(copy.deepcopy(base), balance, chunks=4, checkpoint=checkpoint, seed=1234)
        out = pipe(x)
        out.pow(2).sum().backward()
        grads = [p.grad.clone() for p in pipe.parameters()]
        results.append((balance, checkpoint, out.detach(), grads))
    _, _, out0, grads0 = results[0]
    for balance, checkpoint, out, grads in results[1:]:
        assert torch.equal(out, out0), (balance, checkpoint)
        for g, g0 in zip(grads, grads0, strict=True):
            # Gradients accumulate micro-batch by micro-batch in the same order for every
            # balance, so they agree bit for bit.
            assert torch.equal(g, g0), (balance, checkpoint)


def test_dropout_rate_is_the_configured_one() -> None:
    model = nn.Sequential(nn.Identity(), nn.Dropout(0.3), nn.Identity())
    pipe = gp.GPipe(model, [1, 2], chunks=4, checkpoint="always")
    out = pipe(torch.ones(400, 250))
    zero_fraction = (out == 0).double().mean().item()
    assert abs(zero_fraction - 0.3) < 0.01
    # Different micro-batches draw different masks.
    pieces = out.tensor_split(4)
    assert not torch.equal(pieces[0] == 0, pieces[1] == 0)


def test_dropout_masks_differ_between_steps_and_leave_global_rng_alone() -> None:
    pipe = gp.GPipe(dropout_net(), [2, 3], chunks=2)
    x = torch.randn(8, 6, dtype=torch.float64)
    before = torch.get_rng_state()
    a, b = pipe(x), pipe(x)
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(a, b)


def test_eval_mode_dropout_matches_plain_module() -> None:
    ref = dropout_net().eval()
    pipe = gp.GPipe(copy.deepcopy(ref), [2, 3], chunks=3).eval()
    x = torch.randn(9, 6, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), ref(x), rtol=0, atol=TOL)


# --- bad input --------------------------------------------------------------------------------


def test_balance_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"sum\(balance\)=7 does not match len\(module\)=6"):
        gp.GPipe(mlp(), [3, 4])
    with pytest.raises(ValueError, match=r"non-positive or non-integer entries \[0\]"):
        gp.GPipe(mlp(), [6, 0])
    with pytest.raises(ValueError, match="balance is empty"):
        gp.GPipe(mlp(), [])


def test_other_configuration_errors() -> None:
    with pytest.raises(ValueError, match="chunks=0 must be a positive integer"):
        gp.GPipe(mlp(), [3, 3], chunks=0)
    with pytest.raises(ValueError, match=r"len\(devices\)=1 does not match len\(balance\)=2"):
        gp.GPipe(mlp(), [3, 3], devices=["cpu"])
    with pytest.raises(TypeError, match="module must be nn.Sequential, got Linear"):
        gp.GPipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        gp.GPipe(mlp(), [3, 3], checkpoint="sometimes")


def test_layer_returning_non_tensor_is_named() -> None:
    class Bad(nn.Module):
        def forward(self, x: Tensor) -> int:
            return 3

    pipe = gp.GPipe(nn.Sequential(nn.Linear(2, 2), Bad()), [1, 1])
    with pytest.raises(TypeError, match=r"layer 1 \('1'\) returned int"):
        pipe(torch.randn(2, 2))


def test_parameter_shared_across_partitions_is_refused() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with pytest.raises(ValueError, match="shared with 0.weight across partitions 0 and 1"):
        gp.GPipe(model, [2, 1])
    gp.GPipe(model, [3])  # within one partition it is fine


def test_moving_the_pipeline_is_refused() -> None:
    pipe = gp.GPipe(mlp(), [3, 3])
    with pytest.raises(TypeError, match="places its partitions itself"):
        pipe.to("cpu")
    pipe.to(torch.float32)  # dtype conversion is allowed
