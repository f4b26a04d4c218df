"""The backward split into I (inputs' gradient) and W (parameters' gradient) equals a fused B.

Every case runs the same stage twice on the same micro-batches, once with B and once with I
then W (in several orders), in float64, and compares the input gradients and every parameter's
``.grad``: with every re-materialization mode, dropout, BatchNorm, tuple payloads, a parameter
used twice, an output that depends on parameters only, and a first stage whose inputs need no
gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from gpipe_core.batchnorm import DeferredBatchNorm
from gpipe_core.split_backward import backward_input
from gpipe_core.stage import Stage
from tests.distributed.test_pipeline import Block  # (x, mask, lengths), with dropout

CPU = torch.device("cpu")
TOL = 1e-12


class Twice(nn.Module):
    """One linear layer applied twice: its parameters get gradients along two paths."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(torch.tanh(self.linear(x)))


class WithQuery(nn.Module):
    """Outputs (x, query): the second output depends on a parameter only."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(width))
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(x), torch.sin(self.query).expand(x.shape[0], -1)


class Norm(nn.Module):
    def __init__(self, width: int, deferred: bool) -> None:
        super().__init__()
        bn = nn.BatchNorm1d(width)
        self.bn = DeferredBatchNorm.convert(bn) if deferred else bn
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.linear(self.bn(x)))


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


def make_stage(layers: list[nn.Module], *, checkpoint: str, last: bool, index: int = 1) -> Stage:
    named = [(str(i), layer.double()) for i, layer in enumerate(layers)]
    return Stage(named, stage_index=index, num_stages=3, first_layer_index=10 * index,
                 device=CPU, checkpoint=checkpoint, seed=5, loss_fn=loss_fn if last else None)


def run_both(
    layers: list[nn.Module],
    inputs: list,  # type: ignore[type-arg]
    *,
    checkpoint: str,
    last: bool = False,
    order: str = "IIWW",
    index: int = 1,
    grad_outputs: Callable[[object], list[Tensor | None]] | None = None,
) -> None:
    """Forward every micro-batch on two copies; B on one, I/W (``order``) on the other."""
    fused = make_stage(copy.deepcopy(layers), checkpoint=checkpoint, last=last, index=index)
    split = make_stage(copy.deepcopy(layers), checkpoint=checkpoint, last=last, index=index)
    m = len(inputs)
    targets = [torch.randn(4, 6, dtype=torch.float64) for _ in range(m)]
    expected_inputs, got_inputs = {}, {}
    for stage in (fused, split):
        stage.begin_step(0, m)
    outputs = {}
    for mb in range(m):
        out = fused.forward(0, mb, inputs[mb], targets[mb] if last else None)
        split.forward(0, mb, inputs[mb], targets[mb] if last else None)
        outputs[mb] = out
    grads = {}
    for mb in range(m):
        if last:
            grads[mb] = None
        elif grad_outputs is not None:
            grads[mb] = grad_outputs(outputs[mb])
        else:
            from gpipe_core.microbatch import flatten

            leaves, _ = flatten(outputs[mb])
            grads[mb] = [torch.randn_like(x) if isinstance(x, Tensor) and x.requires_grad
                         else None for x in leaves]
    for mb in reversed(range(m)):
        expected_inputs[mb] = fused.backward(0, mb, grads[mb])
    # ``order``: a string of I and W, each taking the next micro-batch of its kind.
    next_i = next_w = 0
    for kind in order:
        if kind == "I":
            got_inputs[next_i] = split.backward_input(0, next_i, grads[next_i])
            next_i += 1
        else:
            assert split.backward_weight(0, next_w) is None
            next_w += 1
    assert fused.num_saved == split.num_saved == 0
    for mb in range(m):
        for want, got in zip(expected_inputs[mb], got_inputs[mb], strict=True):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    fused_params = _named_parameters(fused)
    split_params = _named_parameters(split)
    assert fused_params.keys() == split_params.keys()
    for name, param in fused_params.items():
        assert param.grad is not None, name
        torch.testing.assert_close(split_params[name].grad, param.grad, rtol=0, atol=TOL,
                                   msg=name)
    for (_, a), (_, b) in zip(fused.layers, split.layers, strict=True):
        for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers(), strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=0, msg=name)


def _named_parameters(stage: Stage) -> dict[str, Tensor]:
    return {f"{layer_name}.{name}": param for layer_name, layer in stage.layers
            for name, param in layer.named_parameters()}


def leaf(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(True)


MODES = ["always", "except_last", "never"]


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("order", ["IWIW", "IIWW"])
def test_middle_stage_mlp(checkpoint: str, order: str) -> None:
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)]
    run_both(layers, [leaf(4, 6), leaf(4, 6)], checkpoint=checkpoint, order=order)


@pytest.mark.parametrize("checkpoint", MODES)
def test_last_stage_with_loss(checkpoint: str) -> None:
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)]
    run_both(layers, [leaf(4, 6) for _ in range(3)], checkpoint=checkpoint, last=True,
             order="IIIWWW")


@pytest.mark.parametrize("checkpoint", MODES)
def test_first_stage_inputs_without_grad(checkpoint: str) -> None:
    # Nothing to send back: I does nothing, W the whole backward.
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)]
    run_both(layers, [torch.randn(4, 6, dtype=torch.float64) for _ in range(2)],
             checkpoint=checkpoint, index=0)


@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_payload_with_dropout(checkpoint: str) -> None:
    # Dropout masks repeat in the re-materialized forward (rebuilt in I, used again in W).
    def batch() -> tuple[Tensor, Tensor, Tensor]:
        mask = torch.rand(4, 5) > 0.3
        return leaf(4, 5, 6), mask, mask.sum(-1)

    layers = [Block(6, p=0.4), Block(6, p=0.4)]
    run_both(layers, [batch() for _ in range(3)], checkpoint=checkpoint, order="IWIIWW")


@pytest.mark.parametrize("checkpoint", MODES)
def test_parameter_used_twice(checkpoint: str) -> None:
    run_both([Twice(6), nn.Tanh(), Twice(6)], [leaf(4, 6), leaf(4, 6)], checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_output_that_depends_on_parameters_only(checkpoint: str) -> None:
    run_both([WithQuery(6)], [leaf(4, 6), leaf(4, 6)], checkpoint=checkpoint)


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("checkpoint", MODES)
def test_micro_batch_batchnorm(checkpoint: str, deferred: bool) -> None:
    # Running statistics end equal too (compared as buffers): the recompute in I adds nothing.
    run_both([Norm(6, deferred), Norm(6, deferred)], [leaf(4, 6) for _ in range(3)],
             checkpoint=checkpoint, order="IIWIWW")


def test_transformer_block() -> None:
    layer = nn.TransformerEncoderLayer(6, 2, dim_feedforward=12, dropout=0.2, batch_first=True)
    for checkpoint in MODES:
        run_both([copy.deepcopy(layer)], [leaf(4, 5, 6), leaf(4, 5, 6)], checkpoint=checkpoint)


def test_w_before_i_and_twice_are_clear_errors() -> None:
    stage = make_stage([nn.Linear(6, 6)], checkpoint="never", last=False)
    stage.begin_step(0, 1)
    out = stage.forward(0, 0, leaf(4, 6))
    with pytest.raises(RuntimeError, match="backward_input must run first"):
        stage.backward_weight(0, 0)
    stage.backward_input(0, 0, [torch.ones_like(out)])
    with pytest.raises(RuntimeError, match="it already ran"):
        stage.backward_input(0, 0, [torch.ones_like(out)])
    stage.backward_weight(0, 0)
    with pytest.raises(RuntimeError, match="backward_input must run first"):
        stage.backward_weight(0, 0)
    with pytest.raises(RuntimeError, match="no forward state"):
        stage.backward_input(0, 0, [torch.ones_like(out)])


def record_node_runs(out: torch.Tensor) -> list[str]:
    """The names of the autograd nodes of ``out``'s graph as they run, appended in order."""
    runs: list[str] = []

    def count(node):  # type: ignore[no-untyped-def]
        node.register_prehook(lambda _: runs.append(node.name()))
        for child, _ in node.next_functions:
            if child is not None and not hasattr(child, "variable"):
                count(child)

    count(out.grad_fn)
    return runs


def assert_gradients_of_a_fused_sum_backward(model: nn.Module, x: torch.Tensor) -> None:
    """``model``'s parameter gradients equal those of one fused backward of ``model(x).sum()``."""
    reference = copy.deepcopy(model)
    for p in reference.parameters():
        p.grad = None
    reference(x.detach().requires_grad_(True)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL, msg=name)


def test_w_computes_linear_weights_from_what_addmm_saved() -> None:
    # Count autograd nodes run in each pass: I runs the input path once; W runs none, since a
    # linear layer's weight and bias gradients come from its addmm's saved input
    # (gpipe_core.weight_grads): no autograd call walks the graph below a boundary.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(5)]).double()
    x = leaf(3, 4)
    out = model(x)
    runs = record_node_runs(out)
    grads, pending = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    first = list(runs)
    runs.clear()
    pending.run()
    assert grads[0] is not None
    # I: 5 x (tanh, addmm) on the path; the weights' transposes are off it.
    assert sorted(first) == sorted(["TanhBackward0", "AddmmBackward0"] * 5)
    assert runs == []
    assert_gradients_of_a_fused_sum_backward(model, x)


def test_w_computes_convolution_weights_from_what_the_convolution_saved() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, stride=2, groups=2, bias=False),
                          nn.ConvTranspose2d(4, 2, 2, stride=2)).double()
    x = leaf(3, 2, 6, 6)
    out = model(x)
    runs = record_node_runs(out)
    _, pending = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    runs.clear()
    pending.run()
    assert runs == []
    assert_gradients_of_a_fused_sum_backward(model, x)


class Scaled(nn.Module):
    """A matrix parameter used element-wise: a boundary (MulBackward0) W has no formula for."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3, width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def test_w_calls_autograd_at_boundaries_it_has_no_formula_for() -> None:
    # An element-wise product with a matrix parameter: W runs that boundary again through
    # autograd (only it: nothing below); the linear layers around it still need no node.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Scaled(4), nn.Linear(4, 4)).double()
    x = leaf(3, 4)
    out = model(x)
    runs = record_node_runs(out)
    _, pending = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    runs.clear()
    pending.run()
    assert runs == ["MulBackward0"]
    assert_gradients_of_a_fused_sum_backward(model, x)


def test_w_keeps_parameter_hooks_and_layout() -> None:
    # A parameter with a gradient hook gets its gradient through autograd (the hook runs once,
    # as in a fused backward); every .grad has its parameter's strides.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4, bias=False),
                          nn.Conv1d(3, 3, 1)).double()
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(g.shape))
    x = leaf(3, 3, 4)
    out = model(x)
    _, pending = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    pending.run()
    assert calls == [torch.Size([5, 4])]
    for p in model.parameters():
        assert p.grad.stride() == p.stride()
    assert_gradients_of_a_fused_sum_backward(model, x)


@pytest.mark.parametrize("checkpoint", MODES)
def test_convolutions_and_matrix_products(checkpoint: str) -> None:
    # The formulas W uses (weight_grads): addmm (a linear layer, with its bias broadcast), mm
    # (a linear layer without bias, a parameter on the right of x @ P), convolutions with and
    # without bias, strided, grouped, transposed; each against a fused backward.
    torch.manual_seed(0)

    class Right(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.randn(6, 6))

        def forward(self, x: Tensor) -> Tensor:
            return x @ self.p

    class Images(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.Sequential(
                nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2,
                                                                     groups=2, bias=False),
                nn.BatchNorm2d(4), nn.ConvTranspose2d(4, 1, 2, stride=2))

        def forward(self, x: Tensor) -> Tensor:
            images = x.repeat(1, 6).view(x.shape[0], 1, 6, 6)
            return self.convs(images).reshape(x.shape[0], 16)[:, :6]

    layers = [nn.Linear(6, 6, bias=False), nn.Tanh(), Right(), Images(), nn.Linear(6, 6)]
    run_both(layers, [leaf(4, 6), leaf(4, 6)], checkpoint=checkpoint)


def test_vector_only_groups_are_computed_by_i_and_w_skips_them() -> None:
    # A norm's scale and shift reduce over the batch: I computes them on its way (their node
    # is on the input path) and W spends no autograd call on them; the linear layers' weights
    # (matrices) stay in W. The gradients equal a fused backward's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.Tanh(), nn.LayerNorm(4),
                          nn.Linear(4, 4)).double()
    x = leaf(3, 4)
    out = model(x)
    runs = record_node_runs(out)
    _, pending = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    norms = [model[0], model[3]]
    assert all(p.grad is not None for norm in norms for p in norm.parameters())  # after I
    assert all(p.grad is None for p in [model[1].weight, model[4].weight])
    runs.clear()
    pending.run()
    assert runs == []  # no norm again, and the linear layers' weights need no node either
    assert_gradients_of_a_fused_sum_backward(model, x)


class _TwoProducts(torch.autograd.Function):
    """(x @ w, 2 x @ w): one autograd node with two outputs and an edge to a parameter."""

    @staticmethod
    def forward(ctx: object, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(x, w)  # type: ignore[attr-defined]
        y = x @ w
        return y, 2 * y

    @staticmethod
    def backward(ctx: object, g1: Tensor | None, g2: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        g = (g1 if g1 is not None else 0) + (2 * g2 if g2 is not None else 0)
        return g @ w.t(), x.t() @ g


class TwoOutputs(nn.Module):
    def __init__(self, width: int, use_second: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width))
        self.use_second = use_second

    def forward(self, x: Tensor) -> Tensor:
        first, second = _TwoProducts.apply(x, self.w)
        return torch.tanh(first) + (torch.sin(second) if self.use_second else 0)


@pytest.mark.parametrize("use_second", [True, False])
def test_a_boundary_with_two_outputs(use_second: bool) -> None:
    # I keeps the gradient of each output of the boundary (None for one no path uses)
    run_both([TwoOutputs(6, use_second), nn.Tanh(), TwoOutputs(6, use_second)],
             [leaf(4, 6) for _ in range(3)], checkpoint="never", order="IIWIWW")
