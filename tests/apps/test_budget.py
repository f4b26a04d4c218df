"""A run's length fitted to its time (apps/budget.py): the arithmetic, and the real NMT loop
choosing a length from its measured speed, laying its schedule over it, and rerunning exactly
from the length it chose."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from apps import budget
from apps.config import ConfigError
from apps.nmt import train
from apps.nmt.config import NMTConfig
from tests.apps.test_nmt_train import tiny_args, torchrun


def test_the_steps_that_fit_leave_the_reserve() -> None:
    choice = budget.choose_train_steps(budget_minutes=10, seconds_per_step=0.5, elapsed_s=60,
                                       reserve_s=120, cap=10_000, at_least=35,
                                       timed_steps=(5, 35))
    # 600 - 60 - 120 = 420 s left after step 35, at 0.5 s x SAFETY per step
    assert choice.train_steps == 35 + int(420 / (0.5 * budget.SAFETY))
    assert choice.chosen_by == "measured" and choice.fitted_steps == choice.train_steps
    assert "--train_steps=" + str(choice.train_steps) in choice.explain()


def test_the_cap_and_the_steps_done_bound_the_choice() -> None:
    fast = budget.choose_train_steps(budget_minutes=60, seconds_per_step=0.01, elapsed_s=0,
                                     reserve_s=0, cap=500, at_least=35, timed_steps=(5, 35))
    assert fast.train_steps == 500 and fast.fitted_steps > 500
    assert "capped at 500" in fast.explain()
    late = budget.choose_train_steps(budget_minutes=1, seconds_per_step=1.0, elapsed_s=90,
                                     reserve_s=30, cap=500, at_least=35, timed_steps=(5, 35))
    assert late.train_steps == 35  # out of time already: stop, never undo steps done


def test_a_machine_too_slow_for_the_goal_is_told_the_budget_it_needs() -> None:
    kwargs = dict(budget_minutes=10, elapsed_s=60, reserve_s=120, cap=10_000, at_least=35,
                  timed_steps=(5, 35), goal_steps=1000)
    fast = budget.choose_train_steps(seconds_per_step=0.3, **kwargs)  # 1,330 steps fit
    assert not fast.below_goal and "NOTE" not in fast.explain()
    assert fast.to_json()["below_goal"] is False
    slow = budget.choose_train_steps(seconds_per_step=0.6, **kwargs)  # 683 steps fit
    assert slow.below_goal and slow.train_steps == 35 + int(420 / (0.6 * budget.SAFETY))
    # the budget that gives 1000 steps at 0.6 s: 60 + 120 + 965 x 0.6 x SAFETY seconds
    needed = (60 + 120 + 965 * 0.6 * budget.SAFETY) / 60
    assert slow.minutes_for_goal == pytest.approx(needed)
    assert f"--budget_minutes={math.ceil(needed)} would give 1000 steps" in slow.explain()
    assert slow.to_json()["minutes_for_goal"] == round(needed, 1)
    # no goal stated: nothing to say
    none = budget.choose_train_steps(seconds_per_step=0.6, **{**kwargs, "goal_steps": 0})
    assert not none.below_goal and "NOTE" not in none.explain()


def test_the_decision_falls_inside_warmup() -> None:
    assert budget.decision_step(200) == budget.SKIP_STEPS + budget.TIMED_STEPS
    assert budget.decision_step(20) == 20
    with pytest.raises(ValueError, match="warm-up has only 6 steps"):
        budget.decision_step(6)


def test_a_resumed_length_must_match() -> None:
    with pytest.raises(ConfigError, match="the checkpoint's run has train_steps=300"):
        budget.RunLength(train_steps=200, budget_minutes=0, cap=1000, cap_name="max_steps",
                         warmup_steps=100, saved_steps=300)
    length = budget.RunLength(train_steps=0, budget_minutes=28, cap=1000, cap_name="max_steps",
                              warmup_steps=100, saved_steps=300)
    assert length.decided and length.steps == 300 and not length.due(35)


def test_the_linear_schedule_ends_with_the_run() -> None:
    config = NMTConfig(lr=1e-3, warmup_steps=10, lr_schedule="linear", max_steps=1000)
    assert train.learning_rate(config, 9, 100) == pytest.approx(1e-3)  # end of warm-up
    assert train.learning_rate(config, 99, 100) == pytest.approx(1e-3 / 91)  # the last step
    assert train.learning_rate(config, 54, 100) == pytest.approx(1e-3 * 46 / 91)
    # during warm-up the rate does not depend on the run's length: a budget can be fixed there
    assert all(train.learning_rate(config, s, 100) == train.learning_rate(config, s, 5000)
               for s in range(10))


@pytest.mark.slow
@pytest.mark.distributed
def test_nmt_fits_its_length_to_the_budget_and_reruns_exactly(
    corpus: Path, tmp_path: Path
) -> None:
    common = {"lr_schedule": "linear", "warmup_steps": 20, "log_every": 1}
    fitted = tmp_path / "fitted"
    output = torchrun(tiny_args(corpus, fitted, budget_minutes=1.2, max_steps=100_000, **common))
    summary = json.loads((fitted / "summary.json").read_text())
    chosen = summary["budget"]
    assert chosen["chosen_by"] == "measured", chosen
    assert chosen["timed_steps"] == [5, 20] and chosen["seconds_per_step"] > 0
    steps = chosen["train_steps"]
    assert summary["steps"] == steps and summary["stopped_by"] == f"train_steps={steps}"
    assert f"budget: {steps} steps, from" in output and f"--train_steps={steps}" in output
    records = [json.loads(line) for line in (fitted / "log.jsonl").read_text().splitlines()]
    if steps > 20:  # the schedule spans exactly the chosen steps: its last rate ends it
        assert records[-1]["lr"] == pytest.approx(3e-3 / (steps - 20 + 1))
    # the checkpoint records the length: a rerun with it is the same run, step for step
    assert f"train_steps: {steps}" in (fitted / f"step-{steps:07d}" / "config.yaml").read_text()
    again = tmp_path / "again"
    torchrun(tiny_args(corpus, again, train_steps=steps, max_steps=100_000, **common))
    rerun = [json.loads(line) for line in (again / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["lr"]) for r in rerun] == [
        (r["step"], r["loss"], r["lr"]) for r in records]


def test_amoebanet_s_cosine_spans_the_chosen_steps() -> None:
    import torch
    from timm.scheduler import create_scheduler_v2

    from apps.amoebanet.config import AmoebaNetConfig, scheduler_kwargs

    config = AmoebaNetConfig(epochs=10, warmup_epochs=0.2, lr=2e-3, min_lr=1e-5)
    updates = 100  # per epoch
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)

    def rates(train_steps: int | None) -> list[float]:
        scheduler, _ = create_scheduler_v2(optimizer, **scheduler_kwargs(config, updates,
                                                                          train_steps))
        out = []
        for step in range(train_steps or 1000):
            scheduler.step_update(num_updates=step)
            out.append(optimizer.param_groups[0]["lr"])
        return out

    short, full = rates(340), rates(None)
    assert short[:20] == full[:20]  # warm-up (20 steps) does not depend on the length
    assert short[-1] == pytest.approx(config.min_lr, abs=2e-6)  # annealed at the chosen end
    assert full[339] > 100 * config.min_lr  # where the 10-epoch schedule still runs high


def test_stop_at_step_ends_an_invocation_not_the_run() -> None:
    length = budget.RunLength(train_steps=10, budget_minutes=0, cap=100, cap_name="max_steps",
                              warmup_steps=2, stop_at_step=4)
    assert (length.steps, length.bar_total) == (10, 4)
    assert [length.stop(step) for step in (3, 4, 10)] == ["", "stop_at_step=4", "train_steps=10"]
    assert length.recorded_steps == 10  # the checkpoint records the run's length, not the stop
    beyond = budget.RunLength(train_steps=10, budget_minutes=0, cap=100, cap_name="max_steps",
                              warmup_steps=2, stop_at_step=50)
    assert beyond.bar_total == 10 and beyond.stop(10) == "train_steps=10"


@pytest.mark.slow
@pytest.mark.distributed
def test_nmt_stop_at_step_then_resume_is_the_run_that_never_stopped(
    corpus: Path, tmp_path: Path
) -> None:
    """A linear schedule over 8 steps: stopped at 4 and resumed, every step's loss and learning
    rate equal the straight run's (the stop did not shorten the schedule)."""
    common = {"lr_schedule": "linear", "warmup_steps": 2, "train_steps": 8, "max_steps": 100,
              "log_every": 1}
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    torchrun(tiny_args(corpus, straight, **common))
    output = torchrun(tiny_args(corpus, halves, stop_at_step=4, **common))
    assert "stopped at step 4 of 8 (stop_at_step=4)" in output, output[-2000:]
    assert json.loads((halves / "summary.json").read_text())["stopped_by"] == "stop_at_step=4"
    torchrun(tiny_args(corpus, halves, resume="true", **common))
    records = [[(r["step"], r["loss"], r["lr"]) for r in map(json.loads, lines)]
               for lines in ((d / "log.jsonl").read_text().splitlines()
                             for d in (straight, halves))]
    assert len(records[0]) == 8 and records[1] == records[0]
    assert records[0][-1][2] == pytest.approx(3e-3 / (8 - 2 + 1))  # the schedule's last rate
