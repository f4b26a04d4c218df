"""Virtual stages on real gloo processes: interleaved 1F1B and ZB-V, several stages per rank,
equal the single-process reference (float64, every parameter, 1e-10)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import gpipe_core as gp
from tests.distributed.launch import spawn
from tests.distributed.test_pipeline import (
    TOL,
    build,
    build_tied,
    check_against_reference,
    check_dropout_against_gpipe,
    loss_fn,
    loss_fn_tied,
    make_batch,
    reference,
    run_dropout,
    run_pipeline,
)

pytestmark = pytest.mark.distributed
SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zb_v")


@pytest.mark.parametrize(("world", "balance"), [(2, [2, 2, 2, 2]), (4, [1] * 8)])
def test_virtual_stage_schedules_match_single_process_reference(
    tmp_path: Path, world: int, balance: list[int]
) -> None:
    # Two stages per rank; every re-materialization mode; 1, 3 (uneven over 10 samples: 4+3+3)
    # and 8 micro-batches; the sequence length changes between the two steps.
    steps = 2
    per_rank = spawn(run_pipeline, world, tmp_path, balance, steps, SCHEDULES, (1, 3, 8))
    check_against_reference(per_rank, steps)


@pytest.mark.parametrize(("world", "balance", "chunks"),
                         [(2, [2, 2, 2, 2], (4, 5)), (4, [1] * 8, (8,))])
def test_dualpipe_v_matches_single_process_reference(
    tmp_path: Path, world: int, balance: list[int], chunks: tuple[int, ...]
) -> None:
    # DualPipeV needs M >= 2 x ranks; 5 micro-batches of 10 samples are 2 each.
    steps = 2
    per_rank = spawn(run_pipeline, world, tmp_path, balance, steps, ("dualpipe_v",), chunks)
    check_against_reference(per_rank, steps)


def test_interleaved_with_three_stages_per_rank(tmp_path: Path) -> None:
    steps = 1
    per_rank = spawn(run_pipeline, 2, tmp_path, [1, 1, 2, 2, 1, 1], steps,
                     ("interleaved_1f1b",), (2, 5))
    check_against_reference(per_rank, steps)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropout_masks_equal_single_process_gpipe_with_virtual_stages(
    tmp_path: Path, schedule: str
) -> None:
    per_rank = spawn(run_dropout, 2, tmp_path, [2, 2, 2, 2], schedule, "except_last")
    check_dropout_against_gpipe(per_rank)


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


def init_tied(layer: torch.nn.Module, index: int) -> None:
    """Meta-device initialisation: the tied copy on the last stage starts as zeros (the first
    stage's copy replaces it)."""
    reset = getattr(layer, "reset_parameters", None)
    if callable(reset):
        reset()
    else:
        for param in layer.parameters():
            torch.nn.init.zeros_(param)


def run_tied_virtual(rank: int, world: int, schedule: str, meta: bool) -> Any:
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = build_tied()
    else:
        model = build_tied()
    pipe = gp.DistributedGPipe(model, [1, 1, 2, 1], chunks=2, loss_fn=loss_fn_tied,
                               tied=("0.weight", "4.weight"), schedule=schedule, seed=3,
                               init_fn=init_tied if meta else None)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    params = dict(pipe.named_parameters(remove_duplicate=False))
    start = {k: p.detach().clone() for k, p in params.items()}
    pipe.step(x, x)
    norm = float(pipe.clip_grad_norm_(1e9))
    return start, {k: p.grad.clone() for k, p in params.items()}, norm


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("meta", [False, True])
def test_tied_first_and_last_weight_with_virtual_stages(tmp_path: Path, schedule: str,
                                                        meta: bool) -> None:
    # interleaved: the ends on ranks 0 and 1; zb_v: both on rank 0 (kept equal in place).
    per_rank = spawn(run_tied_virtual, 2, tmp_path, schedule, meta)
    torch.manual_seed(0)
    model = build_tied()
    if meta:
        with torch.device("meta"):
            model = build_tied()
        gp.materialize(model, seed=3, init_fn=init_tied)
        model[4].weight = model[0].weight
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (sum(loss_fn_tied(model(a), a) for a in x.tensor_split(2)) / 2).backward()
    expected = model[0].weight.grad
    total = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    copies = [(start, grads) for start, grads, _ in per_rank]
    for name in ("0.weight", "4.weight"):
        holders = [(s, g) for s, g in copies if name in g]
        assert holders, name
        for start, grads in holders:
            torch.testing.assert_close(start[name], model[0].weight.detach(), rtol=0, atol=0)
            torch.testing.assert_close(grads[name], expected, rtol=0, atol=TOL)
    for _, _, norm in per_rank:
        assert norm == pytest.approx(float(total), abs=1e-9)


def run_data_parallel_virtual(rank: int, world: int, schedule: str) -> Any:
    pipeline_group, data_group = gp.init_process_groups(2)
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), [2, 2, 2, 2], chunks=2, loss_fn=loss_fn,
                               group=pipeline_group, data_parallel_group=data_group,
                               schedule=schedule)
    (x, mask), y = make_batch(0, n=8)
    replica = rank // 2
    half = slice(replica * 4, replica * 4 + 4)
    loss = pipe.step((x[half], mask[half]), y[half])
    return float(loss), {k: p.grad.clone() for k, p in pipe.named_parameters()}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_times_data_parallel_with_virtual_stages(tmp_path: Path, schedule: str) -> None:
    per_rank = spawn(run_data_parallel_virtual, 4, tmp_path, schedule)
    torch.manual_seed(0)
    model = build()
    (x, mask), y = make_batch(0, n=8)
    pieces = list(zip(x.tensor_split(4), mask.tensor_split(4), y.tensor_split(4), strict=False))
    (sum(loss_fn(model((a, b)), c) for a, b, c in pieces) / 4).backward()
    ref = dict(model.named_parameters())
    for _, grads in per_rank:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref[name].grad, rtol=0, atol=TOL)


def run_evaluate_virtual(rank: int, world: int, schedule: str) -> Any:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(copy.deepcopy(build()), [2, 2, 2, 2], chunks=3,
                               loss_fn=loss_fn, schedule=schedule)
    (x, mask), y = make_batch(0)
    loss, out = pipe.evaluate((x, mask) if pipe.is_first else None, y if pipe.is_last else None,
                              return_outputs=True)
    trained = pipe.step((x, mask), y)
    return float(loss), out, float(trained)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forward_only_evaluation_with_virtual_stages(tmp_path: Path, schedule: str) -> None:
    per_rank = spawn(run_evaluate_virtual, 2, tmp_path, schedule)
    torch.manual_seed(0)
    model = build()
    (x, mask), y = make_batch(0)
    with torch.no_grad():
        out = model((x, mask))
    pieces = list(zip(out.tensor_split(3), y.tensor_split(3), strict=False))
    expected = float(sum(loss_fn(o, t) for o, t in pieces) / 3)
    for loss, got, trained in per_rank:
        assert loss == pytest.approx(expected, abs=TOL)
        assert trained == pytest.approx(expected, abs=TOL)
        if got is not None:
            torch.testing.assert_close(got, out, rtol=0, atol=TOL)
    assert sum(got is not None for _, got, _ in per_rank) == 1


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


def run_trace_virtual(rank: int, world: int, root: str) -> Any:
    pipe = gp.DistributedGPipe(build(), [2, 2, 2, 2], chunks=4, loss_fn=loss_fn,
                               schedule="zb_v", record=True)
    (x, mask), y = make_batch(0)
    pipe.step((x, mask), y)
    pipe.trace(f"{root}/timeline.json", f"{root}/timeline.png")
    return [e.action for e in pipe.timeline]


def test_timeline_of_virtual_stages_has_a_row_per_rank(tmp_path: Path) -> None:
    import json

    per_rank = spawn(run_trace_virtual, 2, tmp_path, str(tmp_path))
    schedule = gp.zb_v(4, 4)
    for rank, actions in enumerate(per_rank):  # each rank ran its row, in order
        assert actions == [str(a) for a in schedule.actions[rank]]
    trace = json.loads((tmp_path / "timeline.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0 (stages 0, 3)", 1: "rank 1 (stages 1, 2)"}
    rows = {(e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert rows == {(schedule.placement[a.stage], str(a)) for row in schedule.actions for a in row}
    assert (tmp_path / "timeline.png").stat().st_size > 1000


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
