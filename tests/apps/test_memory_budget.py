"""``memory_budget_mb``: the apps plan their re-materialization with gp.plan (per-stage kept
layers included) to fit a per-rank budget, refuse one nothing fits, and run the choice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from apps.config import ConfigError
from apps.planning import MiB, _counted, budget_plan, measured_profile


def nmt_tiny():  # type: ignore[no-untyped-def]
    from apps.nmt.config import load_nmt_config
    from apps.nmt.plan import app_model

    return app_model(load_nmt_config(["--config=tiny"]))


def peaks(model, chunks: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {mode: budget_plan(model, budget_mb=1e12, num_stages=2, chunks=chunks,
                              schedule="gpipe", checkpoints=[mode]).peak_bytes / MiB
            for mode in ("never", "always")}


def test_a_budget_between_always_and_never_gets_kept_layers_that_fit() -> None:
    model = nmt_tiny()
    peak = peaks(model, 4)
    assert peak["always"] < peak["never"]
    budget = (peak["always"] + peak["never"]) / 2
    best = budget_plan(model, budget_mb=budget, num_stages=2, chunks=4, schedule="gpipe")
    assert best.checkpoint.startswith("keep:") and best.peak_bytes / MiB <= budget
    always = budget_plan(model, budget_mb=budget, num_stages=2, chunks=4, schedule="gpipe",
                         checkpoints=["always"])
    assert best.step_time < always.step_time
    # a budget everything fits: nothing is recomputed ("never", or every layer kept: a tie)
    roomy = budget_plan(model, budget_mb=2 * peak["never"], num_stages=2, chunks=4,
                        schedule="gpipe")
    never = budget_plan(model, budget_mb=2 * peak["never"], num_stages=2, chunks=4,
                        schedule="gpipe", checkpoints=["never"])
    assert roomy.step_time == pytest.approx(never.step_time)
    assert roomy.peak_bytes <= never.peak_bytes  # (keeping every layer: without the output)


def test_a_budget_nothing_fits_names_the_smallest_peak_and_the_fix() -> None:
    model = nmt_tiny()
    smallest = peaks(model, 4)["always"]
    with pytest.raises(ConfigError) as error:
        budget_plan(model, budget_mb=smallest / 2, num_stages=2, chunks=4, schedule="gpipe")
    text = str(error.value)
    assert text.startswith(f"memory_budget_mb={smallest / 2:g} fits no plan")
    assert f"smallest feasible per-rank peak is {smallest:.1f} MiB" in text
    assert "give memory_budget_mb >=" in text


def test_the_loss_is_counted_with_the_last_layer() -> None:
    """The NMT's loss saves log-probabilities over the vocabulary per micro-batch in flight:
    its stage holds them, so the plan counts them with the last layer."""
    model = nmt_tiny()
    with_loss = _counted(model, model.depth, torch.float32)
    model.loss = None
    alone = _counted(model, model.depth, torch.float32)
    assert len(with_loss) == len(alone)
    assert with_loss.saved_bytes[:-1] == alone.saved_bytes[:-1]
    assert with_loss.saved_bytes[-1] > alone.saved_bytes[-1]
    assert with_loss.forward_ops[-1] > alone.forward_ops[-1]  # its operators (no matmul)


def test_measured_seconds_choose_and_counted_bytes_fit() -> None:
    """A profile of the model on this CPU (what the train scripts plan with, on rank 0): one
    measured forward, forward without autograd and backward per layer; with it, each mode's
    peak is the counted one at the same balance, and the selective choice fits its budget."""
    model = nmt_tiny()
    profile = measured_profile(model, 4, seed=0, device=torch.device("cpu"), rounds=2)
    layers = len(_counted(model, model.depth, torch.float32))
    assert profile.num_microbatches == 4 and profile.checkpoint == "except_last"
    for values in (profile.forward, profile.forward_no_grad, profile.backward):
        assert len(values) == layers and all(v > 0 for v in values)
    counted = budget_plan(model, budget_mb=1e12, num_stages=2, chunks=4, schedule="gpipe",
                          checkpoints=["always"])
    timed = budget_plan(model, budget_mb=1e12, num_stages=2, chunks=4, schedule="gpipe",
                        checkpoints=["always"], balance=counted.balance, profiles=[profile])
    assert timed.peak_bytes == counted.peak_bytes and timed.step_time != counted.step_time
    peak = peaks(model, 4)
    budget = (peak["always"] + peak["never"]) / 2
    best = budget_plan(model, budget_mb=budget, num_stages=2, chunks=4, schedule="gpipe",
                       profiles=[profile])
    assert best.peak_bytes / MiB <= budget


@pytest.mark.slow
@pytest.mark.distributed
def test_amoebanet_trains_with_the_planned_choice(shards: Path, tmp_path: Path) -> None:
    from apps.amoebanet.config import load_train_config
    from apps.amoebanet.plan import app_model
    from tests.apps.test_amoebanet_train import tiny_args, torchrun

    args = tiny_args(shards, tmp_path / "run", stop_at_step=2)
    config = load_train_config(args)
    output, budget = train_at_a_halfway_budget(torchrun, args, app_model(config), config.chunks)
    assert_chose_within(output, budget)
    assert "test top-1" in output or "stopped" in output or "stop_at_step" in output, output[-2000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_nmt_trains_with_the_planned_choice(corpus: Path, tmp_path: Path) -> None:
    from apps.nmt.config import load_nmt_config
    from apps.nmt.plan import app_model
    from tests.apps.test_nmt_train import tiny_args, torchrun

    args = tiny_args(corpus, tmp_path / "run", max_steps=2)
    config = load_nmt_config(args)
    output, budget = train_at_a_halfway_budget(torchrun, args, app_model(config), config.chunks)
    assert_chose_within(output, budget)
    assert "trained 2 steps" in output, output[-2000:]


def train_at_a_halfway_budget(torchrun, args: list[str], model,  # type: ignore[no-untyped-def]
                              chunks: int) -> tuple[str, float]:
    """A train run under ``torchrun`` at the budget halfway between the ``always`` and ``never``
    peaks (which ``always`` fits and ``never`` does not): its output and the budget."""
    peak = peaks(model, chunks)
    budget = round((peak["always"] + peak["never"]) / 2, 3)
    return torchrun([*args, f"--memory_budget_mb={budget}"]), budget


def assert_chose_within(output: str, budget: float) -> None:
    """Rank 0 timed each layer and chose with those seconds (which vary between runs): the
    choice is logged, and every rank's predicted peak fits the budget (to the log's 0.1 MiB)."""
    chose = re.search(r"gp.plan chose checkpoint=(.+?) balance=\[[\d, ]+\] .*predicted "
                      r"per-rank peak \[([\d., ]+)\] MiB", output)
    assert chose is not None, output[-2000:]
    assert all(float(p) <= budget + 0.05 for p in chose.group(2).split(", "))
    assert f"checkpoint {chose.group(1)}, " in output  # the run's first line: what it runs
