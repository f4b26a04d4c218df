"""gp.refine: the planner's shortlist re-priced by replaying each plan's stages whole.

The model's cost sits in two Sleep layers (a forward of at least SLEEP_F, a backward of at
least SLEEP_B, whatever the host's load), so that what a replay must find is known: the
balance that puts one Sleep on each stage is the fast one, whatever a plan predicted.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe_core as gp
from gpipe_core.refine import shortlist
from tests.test_profile import SLEEP_B, SLEEP_F, Sleep

M = 2
K = 2
# A sleep's overshoot and the linear layers: far below one sleep per action
SLACK = 1.5


def model_and_batch() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    # a layer with parameters first: a Sleep on the input itself would have no backward
    model = nn.Sequential(nn.Linear(8, 8), Sleep(), Sleep(), nn.Linear(8, 3))
    return model, torch.randn(8, 8), torch.randint(0, 3, (8,))


def fill_drain_step(per_stage_sleeps: list[int]) -> float:
    """The least fill-drain step at K=2, M=2 for stages holding these many Sleep layers: the
    busiest stage's M forwards and M backwards, plus one forward and one backward of the
    other (its part of the fill and the drain)."""
    busy, other = max(per_stage_sleeps), min(per_stage_sleeps)
    return (M * busy + other) * (SLEEP_F + SLEEP_B)


def made_up(balance: list[int], step_time: float, **fields: object) -> gp.Plan:
    """A plan of ``balance`` whose prediction is ``step_time`` (what a search's error gives)."""
    values: dict[str, object] = dict(num_stages=K, num_microbatches=M, checkpoint="never",
                                     balance=balance, step_time=step_time, bubble_fraction=0.0,
                                     peak_bytes=123.0, schedule="gpipe")
    values.update(fields)
    return gp.Plan(**values)  # type: ignore[arg-type]


def test_the_replay_orders_plans_by_their_stages_whole_cost() -> None:
    model, x, y = model_and_batch()
    # The per-layer prediction favours [3, 1] (both Sleeps on stage 0); [2, 2] puts one on each.
    plans = [made_up([3, 1], 0.10), made_up([2, 2], 0.11)]
    refined = gp.refine(plans, model, x, y, loss_fn=nn.functional.cross_entropy, rounds=2)
    assert [p.balance for p in refined] == [[2, 2], [3, 1]]
    assert [p.refined_from for p in refined] == [0.11, 0.10]
    for p, sleeps in zip(refined, ([1, 1], [2, 0]), strict=True):
        least = fill_drain_step(sleeps)
        assert least <= p.step_time <= SLACK * least, (p.balance, p.step_time, least)
        assert p.peak_bytes == 123.0  # the memory stays the planner's
    assert "per-layer costs predicted 0.11 s" in refined[0].describe()


def test_refine_reprices_what_gp_plan_chose() -> None:
    model, x, y = model_and_batch()
    # per-layer costs that miss the Sleeps: the planner's predictions are 10x too fast
    wrong = [0.1 * (SLEEP_F + SLEEP_B)] * 4
    plans = gp.plan(forward=wrong, backward=wrong, activation_bytes=[0.0] * 4,
                    input_bytes=[0.0] * 4, param_bytes=[0.0] * 4, memory_budget=1.0,
                    batch_size=8, stages=[K], microbatches=[M], checkpoints=["never"])
    [best] = gp.refine(plans, model, x, y, loss_fn=nn.functional.cross_entropy, rounds=2)
    assert best.refined_from == plans[0].step_time
    sleeps = [sum(isinstance(layer, Sleep) for layer in model[a:b])
              for a, b in ((0, best.balance[0]), (best.balance[0], 4))]
    least = fill_drain_step(sleeps)
    assert least <= best.step_time <= SLACK * least
    assert best.step_time > 5 * plans[0].step_time


def test_each_boundary_pays_the_transfer_or_the_devices_time_for_its_message() -> None:
    model, x, y = model_and_batch()
    plan = made_up([2, 2], 0.1)
    kwargs = dict(loss_fn=nn.functional.cross_entropy, rounds=1)
    base = gp.refine([plan], model, x, y, **kwargs)[0].step_time  # type: ignore[arg-type]
    # fill-drain crosses the boundary at least twice on its longest path (F, then B)
    latency = 0.05
    sent = gp.refine([plan], model, x, y, transfer=latency, **kwargs)[0].step_time  # type: ignore[arg-type]
    slow = gp.Device("slow_link", memory_bytes=2**30, peak_flops=1e12, link_latency=latency,
                     link_bandwidth=1e12)
    priced = gp.refine([plan], model, x, y, costs=gp.layer_costs(model, x), device=slow,
                       **kwargs)[0].step_time  # type: ignore[arg-type]
    for step in (sent, priced):
        # two separate replays: each sleep may overshoot by a little
        assert step - base >= 2 * latency - 0.2 * (SLEEP_F + SLEEP_B), (base, step)


def test_shortlist_keeps_the_fastest_within_the_margin_each_configuration_once() -> None:
    plans = [made_up([2, 2], 1.0), made_up([2, 2], 1.01), made_up([3, 1], 1.1),
             made_up([1, 3], 1.2), made_up([1, 3], 1.21, checkpoint="always"),
             made_up([3, 1], 1.3, num_microbatches=4)]
    assert [(p.balance, p.step_time) for p in shortlist(plans, within=0.25)] == [
        ([2, 2], 1.0), ([3, 1], 1.1), ([1, 3], 1.2), ([1, 3], 1.21)]
    assert [p.step_time for p in shortlist(plans, top=2)] == [1.0, 1.1]
    assert [p.step_time for p in shortlist(plans, within=0.15)] == [1.0, 1.1]
    assert len(shortlist(plans, top=10, within=None)) == 5
    assert shortlist(list(reversed(plans)), top=1)[0].step_time == 1.0


def test_bad_arguments_say_what_to_give() -> None:
    model, x, y = model_and_batch()
    with pytest.raises(ValueError, match="no plans to refine"):
        gp.refine([], model, x, y)
    with pytest.raises(ValueError, match=r"balance \[2, 3\] covers 5 layers and the module has 4"):
        gp.refine([made_up([2, 3], 1.0)], model, x, y)
    with pytest.raises(ValueError, match="give both"):
        gp.refine([made_up([2, 2], 1.0)], model, x, y, device=gp.DEVICES["h100_80gb"])
    with pytest.raises(ValueError, match="top=0"):
        shortlist([made_up([2, 2], 1.0)], top=0)
    with pytest.raises(ValueError, match="within=-0.1"):
        shortlist([made_up([2, 2], 1.0)], within=-0.1)
