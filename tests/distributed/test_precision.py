"""Mixed precision through DistributedGPipe on real gloo ranks: bf16 autocast around ``step``
and the ``precision`` policy equal the plain module run micro-batch by micro-batch under the
same autocast, for every schedule and checkpoint mode; fp16 loss scaling skips a step on every
rank at once and otherwise follows ``torch.amp.GradScaler`` step for step.

Exactness. The reference does the pipeline's arithmetic in the pipeline's order: each
micro-batch's forward under autocast, its loss over M, its whole backward, the micro-batches in
the order the last stage runs them, so every float32 ``.grad`` accumulates the same
bf16-rounded terms in the same order; results are compared bitwise, for the split backward (I
then W) too: W's own weight products (:mod:`gpipe_core.weight_grads`) use autograd's formulas
on the bf16 operands autocast saved, and undo autocast's cast of the weight as autograd does
(sum a broadcast bias in the incoming dtype, then cast back to the parameter's). The tests run
on one thread (conftest), as the ranks do: another thread count may reduce in another order.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gpipe_core as gp
from tests.distributed.launch import spawn
from tests.test_precision import build, loss_fn

pytestmark = pytest.mark.distributed
SCHEDULES = {  # schedule -> balance on 2 ranks
    "gpipe": [4, 3], "1f1b": [4, 3], "zb_h1": [4, 3], "zb_h2": [4, 3],
    "interleaved_1f1b": [2, 2, 1, 2], "interleaved_zb": [2, 2, 1, 2], "zb_v": [2, 2, 1, 2],
    "dualpipe_v": [2, 2, 1, 2],
}
CHUNKS = 4


def batch(step: int, n: int = 12) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def reference(model: nn.Module, x: Tensor, y: Tensor, order: list[int], *,
              dtype: torch.dtype = torch.bfloat16,
              scaler: torch.amp.GradScaler | None = None) -> float:
    """The plain module as the pipeline computes it: each micro-batch's loss over M under
    autocast (scaled by ``scaler``), backpropagated whole, the micro-batches in ``order``."""
    pieces = list(zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS), strict=True))
    losses = {}
    for mb in range(CHUNKS):
        with torch.autocast("cpu", dtype=dtype):
            losses[mb] = loss_fn(model(pieces[mb][0]), pieces[mb][1]) * (1.0 / CHUNKS)
    for mb in order:
        (scaler.scale(losses[mb]) if scaler is not None else losses[mb]).backward()
    return float(sum(losses[mb].detach().double() for mb in range(CHUNKS)))


def run_bf16(rank: int, world: int) -> list[Any]:
    results = []
    for schedule, checkpoint, how in itertools.product(
            SCHEDULES, ("always", "except_last", "never"), ("autocast", "policy")):
        torch.manual_seed(0)
        pipe = gp.DistributedGPipe(
            copy.deepcopy(build()), SCHEDULES[schedule], chunks=CHUNKS, checkpoint=checkpoint,
            schedule=schedule, loss_fn=loss_fn,
            precision="bf16" if how == "policy" else "fp32")
        x, y = batch(0)
        if how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = pipe.step(x, y)
        else:
            loss = pipe.step(x, y)
        results.append(((schedule, checkpoint, how), float(loss),
                        {n: p.grad.clone() for n, p in pipe.named_parameters()}))
    return results


def test_bf16_every_schedule_and_mode_equals_the_plain_module(tmp_path: Path) -> None:
    per_rank = spawn(run_bf16, 2, tmp_path, timeout_s=400.0)
    expected: dict[str, tuple[float, dict[str, Tensor]]] = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        model = build()
        order = list(range(CHUNKS))[:: -1 if schedule == "gpipe" else 1]
        loss = reference(model, *batch(0), order)
        expected[schedule] = (loss, {n: p.grad for n, p in model.named_parameters()})
    for case_index, (case, _, _) in enumerate(per_rank[0]):
        schedule = case[0]
        ref_loss, ref_grads = expected[schedule]
        seen = set()
        for results in per_rank:
            got_case, loss, grads = results[case_index]
            assert got_case == case
            assert loss == ref_loss, case  # the loss sums the same float32 values in float64
            for name, grad in grads.items():
                seen.add(name)
                assert torch.equal(grad, ref_grads[name]), f"{case} {name}"
        assert seen == set(ref_grads)


POISONED = "5.linear.bias"  # a parameter of the second stage (rank 1) only
POISON_STEP = 1
STEPS = 5


def poison_hook(flag: dict[str, bool]) -> Any:
    return lambda grad: grad * float("inf") if flag["on"] else grad


def run_fp16(rank: int, world: int, schedule: str) -> dict[str, Any]:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(
        build(), [4, 3], chunks=CHUNKS, checkpoint="except_last", schedule=schedule,
        loss_fn=loss_fn, precision="fp16",
        loss_scaler=gp.LossScaler(init_scale=2.0**10, growth_interval=2))
    flag = {"on": False}
    params = dict(pipe.named_parameters())
    if POISONED in params:
        params[POISONED].register_hook(poison_hook(flag))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    losses, scales, skipped = [], [], []
    for step in range(STEPS):
        flag["on"] = step == POISON_STEP
        scales.append(pipe.loss_scaler.scale)
        losses.append(float(pipe.step(*batch(step))))
        skipped.append(pipe.step_skipped)
        pipe.clip_grad_norm_(1e6)  # a collective on (unscaled) gradients, or none at all
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "scales": scales, "skipped": skipped,
            "final_scale": pipe.loss_scaler.scale,
            "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fp16_skips_a_poisoned_step_on_every_rank_as_grad_scaler_does(
        tmp_path: Path, schedule: str) -> None:
    per_rank = spawn(run_fp16, 2, tmp_path, schedule)
    # The plain module with torch.amp.GradScaler, the same poisoned step and the same order.
    torch.manual_seed(0)
    model = build()
    flag = {"on": False}
    dict(model.named_parameters())[POISONED].register_hook(poison_hook(flag))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    order = list(range(CHUNKS))[:: -1 if schedule == "gpipe" else 1]
    losses, scales = [], []
    for step in range(STEPS):
        flag["on"] = step == POISON_STEP
        scales.append(scaler.get_scale())
        losses.append(reference(model, *batch(step), order, dtype=torch.float16,
                                scaler=scaler))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    for rank, got in enumerate(per_rank):
        assert got["skipped"] == [s == POISON_STEP for s in range(STEPS)], rank
        assert got["scales"] == scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**10], rank
        assert got["final_scale"] == scaler.get_scale()
        assert got["losses"] == losses, rank
        for name, value in got["params"].items():
            assert torch.equal(value, dict(model.named_parameters())[name].detach()), name
