"""Mixed precision through GPipe: a re-materialized forward is recomputed in the autocast its
first forward ran in, so loss and every gradient equal the plain module run micro-batch by
micro-batch under the same autocast, in every checkpoint mode.

Why the comparisons are exact: the reference below does what the pipeline does, in the same
order: each micro-batch's forward under autocast (bf16 matrix products of bf16-cast weights),
the loss on the gathered float32 output, then each micro-batch's backward separately, the last
micro-batch first, so every parameter's float32 ``.grad`` accumulates the same bf16-rounded
terms in the same order. A recomputed forward repeats the first one's operations on the same
values (the same casts, the same kernels), so nothing rounds differently: bitwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import gpipe_core as gp
from gpipe_core.precision import AutocastState, LossScaler

MODES = ("never", "except_last", "always")


class Residual(nn.Module):
    """LayerNorm -> Linear -> GELU -> Dropout, added to the stream (kept in float32 by the add)."""

    def __init__(self, width: int, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.dropout(nn.functional.gelu(self.linear(self.norm(x))))


def build(p: float = 0.0, width: int = 32) -> nn.Sequential:
    # Layer 3 is a bare Linear: under autocast its bf16 output crosses the cut of [4, 3], so
    # the second stage receives a bf16 input, as a pipeline cut after a projection does.
    return nn.Sequential(nn.Linear(16, width), Residual(width, p), Residual(width, p),
                         nn.Linear(width, width), Residual(width, p), Residual(width, p),
                         nn.Linear(width, 4))


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return ((out.float() - target) ** 2).mean()


def batch(n: int = 12) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    return torch.autocast("cpu", dtype=dtype)


def reference(model: nn.Module, x: Tensor, y: Tensor, chunks: int,
              forward_context: Callable[[], contextlib.AbstractContextManager[None]]) -> Tensor:
    """The plain module, micro-batch by micro-batch, in the pipeline's order of arithmetic."""
    outputs = []
    for mb, x_mb in enumerate(x.tensor_split(chunks)):
        torch.manual_seed(1000 + mb)  # dropout: the same masks in both runs (see below)
        with forward_context():
            outputs.append(model(x_mb))
    gathered = torch.cat([o.detach() for o in outputs]).requires_grad_()
    loss = loss_fn(gathered, y)
    loss.backward()
    for output, grad in reversed(list(zip(outputs, gathered.grad.split(
            [len(o) for o in outputs]), strict=True))):
        output.backward(grad)
    return loss.detach()


def pipeline(model: nn.Sequential, x: Tensor, y: Tensor, *, chunks: int, checkpoint: str,
             precision: str = "fp32",
             forward_context: Callable[[], contextlib.AbstractContextManager[None]]
             = contextlib.nullcontext) -> Tensor:
    pipe = gp.GPipe(model, [4, 3], chunks=chunks, checkpoint=checkpoint, precision=precision)
    with forward_context():
        out = pipe(x)
    loss = loss_fn(out, y)
    loss.backward()
    return loss.detach()


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 4])
def test_autocast_around_the_forward_is_exact_in_every_checkpoint_mode(
        dtype: torch.dtype, checkpoint: str, chunks: int) -> None:
    # The pattern PyTorch documents: autocast around the forward, backward outside it.
    x, y = batch()
    model = build()
    plain = build()
    plain.load_state_dict(model.state_dict())
    expected = reference(plain, x, y, chunks, lambda: autocast(dtype))
    got = pipeline(model, x, y, chunks=chunks, checkpoint=checkpoint,
                   forward_context=lambda: autocast(dtype))
    assert torch.equal(got, expected)
    for name, grad in grads(plain).items():
        assert dict(model.named_parameters())[name].grad.dtype == torch.float32
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad,
                                   rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.parametrize("checkpoint", MODES)
def test_the_precision_policy_equals_autocast_around_each_micro_batch(
        precision: str, dtype: torch.dtype, checkpoint: str) -> None:
    x, y = batch()
    model, plain = build(), build()
    plain.load_state_dict(model.state_dict())
    expected = reference(plain, x, y, 3, lambda: autocast(dtype))
    got = pipeline(model, x, y, chunks=3, checkpoint=checkpoint, precision=precision)
    assert torch.equal(got, expected)
    for name, grad in grads(plain).items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad,
                                   rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("checkpoint", MODES)
def test_every_recomputed_layer_sees_the_dtype_its_forward_saw(checkpoint: str) -> None:
    # Fails without the fix: the recomputation ran in float32 (or crashed on a bf16 input).
    model = build()
    seen: list[tuple[str, torch.dtype, bool]] = []
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(
                lambda _m, _i, out, name=name: seen.append(
                    (name, out.dtype, torch.is_grad_enabled())))
    x, y = batch()
    pipeline(model, x, y, chunks=4, checkpoint=checkpoint,
             forward_context=lambda: autocast(torch.bfloat16))
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    recomputed = {"never": 0, "except_last": 3, "always": 4}[checkpoint]
    assert len(seen) == linears * (4 + recomputed)  # every forward, and every recomputation
    assert {dtype for _, dtype, _ in seen} == {torch.bfloat16}


def test_dropout_under_autocast_recomputes_the_same_masks() -> None:
    # The per-layer random streams and the autocast state are restored together: with dropout
    # on, "always" and "never" give the same loss and gradients bitwise.
    x, y = batch()
    results = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        model = build(p=0.3)
        pipe = gp.GPipe(model, [4, 3], chunks=3, checkpoint=checkpoint, seed=11,
                        precision="bf16")
        loss = loss_fn(pipe(x), y)
        loss.backward()
        results.append((loss.detach(), grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_evaluation_runs_in_the_policys_dtype() -> None:
    model = build()
    pipe = gp.GPipe(model, [4, 3], chunks=2, precision="bf16")
    with torch.no_grad():
        out = pipe(batch()[0])
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        assert gp.GPipe(build(), [4, 3], chunks=2)(batch()[0]).dtype == torch.float32


def test_grad_scaler_works_through_the_pipeline_in_fp16() -> None:
    # GPipe is a module: torch.amp.GradScaler scales, unscales and skips as for any module.
    x, y = batch()
    model, plain = build(), build()
    plain.load_state_dict(model.state_dict())
    pipe = gp.GPipe(model, [4, 3], chunks=3, checkpoint="except_last", precision="fp16")
    runs = []
    for module, forward in ((pipe, lambda m, x: m(x)),
                            (plain, lambda m, x: torch.cat([m(p) for p in x.tensor_split(3)]))):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            with autocast(torch.float16):
                out = forward(module, x)
            loss = loss_fn(out, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(float(loss.detach()))
        runs.append((losses, scaler.get_scale()))
    (losses_pipe, scale_pipe), (losses_plain, scale_plain) = runs
    assert scale_pipe == scale_plain
    assert losses_pipe == pytest.approx(losses_plain, rel=8 * torch.finfo(torch.float16).eps)


def test_autocast_state_round_trips_and_precision_is_checked() -> None:
    cpu = torch.device("cpu")
    assert not AutocastState.current(cpu).enabled
    with autocast(torch.bfloat16):
        inside = AutocastState.current(cpu)
    assert inside.enabled and inside == AutocastState.current(cpu, "bf16")
    with inside.applied(cpu):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match=r"precision='bf32' is not one of \['fp32', 'bf16', 'fp16'\]"):
        gp.GPipe(build(), [4, 3], precision="bf32")


def test_loss_scaler_follows_grad_scaler_rules() -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([8.0, 16.0, 24.0])
    assert scaler.unscale_([p], group=None, device=torch.device("cpu"))
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 16.0  # doubled after growth_interval finite steps
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert not scaler.unscale_([p], group=None, device=torch.device("cpu"))
    scaler.update(False)
    assert scaler.scale == 8.0 and scaler.steps_skipped == 1
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaler(backoff_factor=2.0)

