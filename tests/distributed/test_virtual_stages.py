"""What only virtual stages do, on real gloo processes: several stages per rank placed out of
order (a checkpoint loads into any placement), micro-batch BatchNorm, what a rank holds.

The tests every schedule shares (reference losses and gradients, dropout, data parallel, tied
weights, evaluation, clipping and the timeline) are parametrized over the virtual schedules in
test_pipeline.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import gpipe_core as gp
from tests.distributed.launch import spawn
from tests.distributed.test_pipeline import TOL, build, loss_fn, make_batch, reference

pytestmark = pytest.mark.distributed


def run_layout(rank: int, world: int, schedule: str, directory: str) -> Any:
    with torch.device("meta"):
        model = build()
    pipe = gp.DistributedGPipe(model, [2, 2, 2, 2], chunks=2, loss_fn=loss_fn, seed=5,
                               schedule=schedule)
    assert all(not p.is_meta for p in pipe.parameters())
    (x, mask), y = make_batch(0)
    loss = pipe.step((x, mask), y)
    pipe.save_checkpoint(directory)
    return (pipe.stage_indices, pipe.is_first, pipe.is_last, float(loss),
            {k: v.clone() for k, v in pipe.state_dict().items()},
            {k: p.grad.clone() for k, p in pipe.named_parameters()})


def run_load(rank: int, world: int, schedule: str, balance: list[int], directory: str) -> Any:
    with torch.device("meta"):
        model = build()
    pipe = gp.DistributedGPipe(model, balance, chunks=2, loss_fn=loss_fn, schedule=schedule)
    pipe.load_checkpoint(directory)
    return {k: v.clone() for k, v in pipe.state_dict().items()}


@pytest.mark.parametrize(("schedule", "placement"), [
    ("interleaved_1f1b", [(0, 2), (1, 3)]),  # stage s on rank s mod 2
    ("zb_v", [(0, 3), (1, 2)]),  # a V: the first and last stage on rank 0
])
def test_meta_model_places_non_contiguous_stages_and_checkpoints_load_anywhere(
    tmp_path: Path, schedule: str, placement: list[tuple[int, int]]
) -> None:
    saved = tmp_path / "ckpt"
    per_rank = spawn(run_layout, 2, tmp_path, schedule, str(saved))
    with torch.device("meta"):
        model = build()
    gp.materialize(model, seed=5)
    state = model.state_dict()
    assert [r[0] for r in per_rank] == placement
    assert [r[1:3] for r in per_rank] == ([(True, False), (False, True)]
                                          if schedule == "interleaved_1f1b"
                                          else [(True, True), (False, False)])
    # Original names; each rank holds its stages' layers only, and together all of them.
    assert set(per_rank[0][4]).isdisjoint(per_rank[1][4])
    assert set(per_rank[0][4]) | set(per_rank[1][4]) == set(state)
    last_rank = 1 if schedule == "interleaved_1f1b" else 0  # the rank of stage 3 (the head)
    assert "0.linear.weight" in per_rank[0][4] and "7.linear.weight" in per_rank[last_rank][4]
    for rank_state in (r[4] for r in per_rank):
        for key, value in rank_state.items():
            assert torch.equal(value, state[key]), key
    ref_losses, ref_grads = reference(model, 2, 1)
    for r in per_rank:
        assert r[3] == pytest.approx(ref_losses[0], abs=TOL)
        for key, grad in r[5].items():
            torch.testing.assert_close(grad, ref_grads[key], rtol=0, atol=TOL)
    # The shards (one per rank, several stages each) load into another placement and into
    # one stage per rank, and as a plain state dict.
    other = "zb_v" if schedule == "interleaved_1f1b" else "interleaved_1f1b"
    for target, balance in ((other, [2, 2, 2, 2]), ("gpipe", [5, 3])):
        loaded = spawn(run_load, 2, tmp_path / f"load-{target}", target, balance, str(saved))
        merged = {**loaded[0], **loaded[1]}
        assert set(merged) == set(state)
        for key, value in merged.items():
            assert torch.equal(value, state[key]), key
    plain = gp.load_shards(saved)
    assert all(torch.equal(plain[k], state[k]) for k in state)


def run_wrong_balance(rank: int, world: int) -> str:
    try:
        gp.DistributedGPipe(build(), [2, 2, 2, 2], chunks=2, loss_fn=loss_fn, schedule="1f1b")
    except ValueError as exc:
        return str(exc)
    return ""


def test_one_stage_per_rank_schedule_with_several_stages_says_what_to_do(tmp_path: Path) -> None:
    messages = spawn(run_wrong_balance, 2, tmp_path)
    assert all("runs one stage per rank" in m and "interleaved_1f1b" in m for m in messages)


def build_batchnorm() -> torch.nn.Sequential:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


def bn_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return (torch.randn(12, 4, generator=g, dtype=torch.float64),
            torch.randn(12, 2, generator=g, dtype=torch.float64))


def run_batchnorm(rank: int, world: int, schedule: str, balance: list[int]) -> Any:
    pipe = gp.DistributedGPipe(build_batchnorm(), balance, chunks=3, loss_fn=loss_fn,
                               schedule=schedule, checkpoint="except_last",
                               deferred_batch_norm=True)
    x, y = bn_batch()
    for _ in range(2):  # gradients accumulate; running statistics are committed per step
        loss = pipe.step(x, y)
    return (float(loss), {k: p.grad.clone() for k, p in pipe.named_parameters()},
            {k: b.clone() for k, b in pipe.named_buffers()})


@pytest.mark.parametrize(("schedule", "balance"), [
    ("zb_h1", [3, 4]), ("zb_h2", [3, 4]), ("interleaved_1f1b", [2, 2, 2, 1]),
    ("zb_v", [2, 2, 2, 1]),
])
def test_micro_batch_batchnorm_with_split_and_virtual_schedules(
    tmp_path: Path, schedule: str, balance: list[int]
) -> None:
    # The micro-batch rule (deferred BatchNorm): each micro-batch normalised by its own
    # statistics, running statistics committed once per mini-batch; as single-process GPipe.
    per_rank = spawn(run_batchnorm, 2, tmp_path, schedule, balance)
    reference_pipe = gp.GPipe(build_batchnorm(), [3, 4], chunks=3, deferred_batch_norm=True,
                              checkpoint="never")
    x, y = bn_batch()
    for _ in range(2):
        out = reference_pipe(x)
        loss = sum(loss_fn(o, t) for o, t in zip(out.tensor_split(3), y.tensor_split(3),
                                                   strict=True)) / 3
        loss.backward()
    params = dict(reference_pipe.named_parameters())
    buffers = dict(reference_pipe.named_buffers())
    for got_loss, grads, got_buffers in per_rank:
        assert got_loss == pytest.approx(float(loss), abs=TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, params[name].grad, rtol=0, atol=TOL)
        for name, value in got_buffers.items():
            torch.testing.assert_close(value, buffers[name], rtol=0, atol=TOL)
    assert sum(len(b) for _, _, b in per_rank) == len(buffers)


def run_held(rank: int, world: int, schedule: str, balance: list[int]) -> Any:
    pipe = gp.DistributedGPipe(build(), balance, chunks=8, loss_fn=loss_fn, schedule=schedule,
                               checkpoint="never")
    held: list[int] = []
    for runtime in pipe.runtimes:
        run_action = runtime.run_action

        def counted(action: Any, state: Any, run_action: Any = run_action) -> None:
            run_action(action, state)
            held.append(sum(stage.num_saved for stage in pipe.stages))

        runtime.run_action = counted  # type: ignore[method-assign]
    (x, mask), y = make_batch(0, n=16)
    pipe.step((x, mask), y)
    return max(held)


@pytest.mark.parametrize(("schedule", "balance"), [
    ("1f1b", [4, 4]), ("zb_h1", [4, 4]), ("zb_h2", [4, 4]),
    ("interleaved_1f1b", [2, 2, 2, 2]), ("interleaved_zb", [2, 2, 2, 2]), ("zb_v", [2, 2, 2, 2]),
    ("dualpipe_v", [2, 2, 2, 2]),
])
def test_micro_batches_held_per_rank_match_the_schedules_bound(
    tmp_path: Path, schedule: str, balance: list[int]
) -> None:
    # What a rank really keeps for backward (forward state until B or W, over its stages).
    per_rank = spawn(run_held, 2, tmp_path, schedule, balance)
    expected = gp.schedule.get_schedule(schedule, len(balance), 8, num_ranks=2).peak_held()
    assert per_rank == expected
