"""``gp.tune``: the planner's shortlist timed in the ranks, fastest first, the same on every rank;
a wrong prediction is overruled by the measurement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_core as gp
from tests.distributed.launch import spawn
from tests.test_profile import SLEEP_B, SLEEP_F, Sleep

pytestmark = pytest.mark.distributed


def build() -> nn.Sequential:
    torch.manual_seed(0)
    # four equal layers, each a small linear one whose forward and backward take at least
    # SLEEP_F and SLEEP_B (a known least cost)
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), Sleep()) for _ in range(4)))


def plan(balance: list[int], predicted: float) -> gp.Plan:
    return gp.Plan(num_stages=2, num_microbatches=4, checkpoint="never", balance=balance,
                   step_time=predicted, bubble_fraction=0.0, peak_bytes=0.0, schedule="1f1b")


def tune_in_ranks(rank: int, world: int) -> Any:
    torch.set_num_threads(1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    # [3, 1] puts 3 of the 4 equal layers on rank 0: its step takes at least 4 x 3 + 1 layers'
    # forward and backward, [2, 2]'s 4 x 2 + 2. The prediction says the opposite; the
    # measurement must overrule it.
    plans = [plan([3, 1], 1.0), plan([2, 2], 1.1), plan([1, 3], 1.5)]
    tuned = gp.tune(plans, build, x, y, loss_fn=nn.functional.mse_loss, within=0.2,
                    rounds=3, warmup=1, timeout_s=60)
    try:
        gp.tune([gp.Plan(num_stages=4, num_microbatches=4, checkpoint="never",
                         balance=[1, 1, 1, 1], step_time=1.0, bubble_fraction=0.0,
                         peak_bytes=0.0, schedule="1f1b")],
                build, x, y, loss_fn=nn.functional.mse_loss)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return [(t.plan.balance, t.seconds, t.samples) for t in tuned], error


def test_tune_times_the_shortlist_and_overrules_a_wrong_prediction(tmp_path: Path) -> None:
    zero, one = spawn(tune_in_ranks, 2, tmp_path, timeout_s=120)
    assert zero == one  # every rank gets the same list
    tuned, error = zero
    # [1, 3] is predicted 50% slower than the fastest: outside within=0.2, not timed
    assert [balance for balance, _, _ in tuned] == [[2, 2], [3, 1]]
    (_, fast, samples), (_, slow, _) = tuned
    assert len(samples) == 3
    # the least cost of [2, 2]: rank 1's 4 forwards and 4 backwards of 2 layers, plus rank 0's
    # first forward before it and last backward after it
    assert fast >= (4 * 2 + 2) * (SLEEP_F + SLEEP_B)
    assert slow > fast
    assert error.endswith("is for 4 ranks, but the group has 2: plan with stages=[2]"), error


def test_shortlist_keeps_the_plans_predicted_near_the_fastest() -> None:
    plans = [plan([2, 2], 1.3), plan([3, 1], 1.0), plan([1, 3], 1.15), plan([2, 2], 1.2)]
    assert [p.step_time for p in gp.shortlist(plans, within=0.2)] == [1.0, 1.15, 1.2]
    assert [p.step_time for p in gp.shortlist(plans, within=0.5, candidates=2)] == [1.0, 1.15]
    assert [p.step_time for p in gp.shortlist(plans, within=0.0)] == [1.0]
    with pytest.raises(ValueError, match="candidates=0 must be at least 1"):
        gp.shortlist(plans, candidates=0)
    with pytest.raises(ValueError, match=r"within=-0.1 must be a fraction >= 0"):
        gp.shortlist(plans, within=-0.1)
    with pytest.raises(ValueError, match="no plans to choose from"):
        gp.shortlist([])
