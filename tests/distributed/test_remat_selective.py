"""Selective re-materialization through DistributedGPipe on 2 gloo ranks: for fill-drain,
1F1B and a zero-bubble schedule (I then W), and two stages per rank (interleaved 1F1B, ZB-V;
float64 only), every choice below gives the plain module's loss
and gradients: float64 with dropout (to 1e-10 against single-process GPipe without
re-materialization), and bf16 autocast bit for bit against the plain module run micro-batch by
micro-batch (the arithmetic of tests/distributed/test_precision.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import gpipe_core as gp
from tests.distributed import test_pipeline as fp64
from tests.distributed import test_precision as bf16
from tests.distributed.launch import spawn

pytestmark = pytest.mark.distributed
SCHEDULES = ("gpipe", "1f1b", "zb_h1")
# balance [3, 5] of test_pipeline.build (Embed, 6 Blocks, Head): per stage, the kept layers
FP64_CHOICES = ([set(), {1, 3}], [{0, 2}, {4}], [{1}, set()], [{0, 1, 2}, {0, 2, 3}])
# two stages per rank (balance [2, 2, 2, 2]), float64 with dropout only
VIRTUAL = ("interleaved_1f1b", "zb_v")
VIRTUAL_CHOICE = [{1}, set(), {0}, {0, 1}]
# balance [4, 3] of test_precision.build
BF16_CHOICES = ([{1}, {0}], [set(), {1, 2}], [{0, 2, 3}, set()])


def run_all(rank: int, world: int) -> list[Any]:
    results = []
    for schedule in SCHEDULES:
        for keep in FP64_CHOICES:
            torch.manual_seed(0)
            pipe = gp.DistributedGPipe(fp64.build(p=0.3), [3, 5], chunks=4, loss_fn=fp64.loss_fn,
                                       seed=77, checkpoint=keep, schedule=schedule)
            assert pipe.layout.checkpoint == str(gp.Remat(keep))
            (x, mask), y = fp64.make_batch(0, n=8)
            loss = pipe.step((x, mask), y)
            results.append((("fp64", schedule, str(keep)), float(loss),
                            {k: p.grad.clone() for k, p in pipe.named_parameters()}))
        for keep in BF16_CHOICES:
            torch.manual_seed(0)
            pipe = gp.DistributedGPipe(copy.deepcopy(bf16.build()), [4, 3], chunks=bf16.CHUNKS,
                                       checkpoint=keep, schedule=schedule, loss_fn=bf16.loss_fn)
            x, y = bf16.batch(0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = pipe.step(x, y)
            results.append((("bf16", schedule, str(keep)), float(loss),
                            {n: p.grad.clone() for n, p in pipe.named_parameters()}))
    for schedule in VIRTUAL:
        torch.manual_seed(0)
        pipe = gp.DistributedGPipe(fp64.build(p=0.3), [2, 2, 2, 2], chunks=4,
                                   loss_fn=fp64.loss_fn, seed=77, checkpoint=VIRTUAL_CHOICE,
                                   schedule=schedule)
        (x, mask), y = fp64.make_batch(0, n=8)
        loss = pipe.step((x, mask), y)
        results.append((("fp64", schedule, str(VIRTUAL_CHOICE)), float(loss),
                        {k: p.grad.clone() for k, p in pipe.named_parameters()}))
    return results


def test_every_schedule_and_choice_equals_the_plain_module(tmp_path: Path) -> None:
    per_rank = spawn(run_all, 2, tmp_path, timeout_s=400.0)
    # float64 with dropout: single-process GPipe, nothing recomputed
    torch.manual_seed(0)
    pipe = gp.GPipe(fp64.build(p=0.3), [2, 6], chunks=4, seed=77, checkpoint="never")
    (x, mask), y = fp64.make_batch(0, n=8)
    out = pipe((x, mask))
    loss = sum(fp64.loss_fn(o, t) for o, t in zip(out.tensor_split(4), y.tensor_split(4),
                                                    strict=True)) / 4
    loss.backward()
    fp64_grads = {n: p.grad for n, p in pipe.named_parameters()}
    # bf16: the plain module under autocast, micro-batch by micro-batch in the schedule's order
    bf16_expected = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        model = bf16.build()
        order = list(range(bf16.CHUNKS))[:: -1 if schedule == "gpipe" else 1]
        ref_loss = bf16.reference(model, *bf16.batch(0), order)
        bf16_expected[schedule] = (ref_loss, {n: p.grad for n, p in model.named_parameters()})
    cases = [case for case, _, _ in per_rank[0]]
    assert len(cases) == len(SCHEDULES) * (len(FP64_CHOICES) + len(BF16_CHOICES)) + len(VIRTUAL)
    for index, case in enumerate(cases):
        kind, schedule, _ = case
        seen = set()
        for results in per_rank:
            got_case, got_loss, grads = results[index]
            assert got_case == case
            for name, grad in grads.items():
                seen.add(name)
                if kind == "fp64":
                    torch.testing.assert_close(grad, fp64_grads[name], rtol=0, atol=fp64.TOL,
                                               msg=f"{case} {name}")
                else:
                    assert torch.equal(grad, bf16_expected[schedule][1][name]), f"{case} {name}"
            if kind == "fp64":
                assert got_loss == pytest.approx(float(loss.detach()), abs=fp64.TOL), case
            else:
                assert got_loss == bf16_expected[schedule][0], case
        assert seen == set(fp64_grads if kind == "fp64" else bf16_expected[schedule][1])
