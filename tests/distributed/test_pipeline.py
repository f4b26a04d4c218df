"""DistributedGPipe on real gloo processes equals the single-process reference."""

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

pytestmark = pytest.mark.distributed
TOL = 1e-10
# Schedules with several stages per rank (virtual stages): tests below run them beside the
# one-stage-per-rank ones; tests of what only they do are in test_virtual_stages.py.
VIRTUAL = ("interleaved_1f1b", "interleaved_zb", "zb_v")


class Block(nn.Module):
    """A residual MLP block passing (x, mask, lengths): floats, bools and integers travel."""

    def __init__(self, width: int, p: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(p)

    def forward(self, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, mask, lengths = batch
        y = x + self.dropout(torch.tanh(self.linear(x))) * mask.unsqueeze(-1)
        return y, mask, lengths + 1


class Embed(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(3, width)

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, mask = batch
        return self.linear(x), mask, mask.sum(-1)


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 2)

    def forward(self, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, mask, lengths = batch
        pooled = (x * mask.unsqueeze(-1)).sum(1) / lengths.unsqueeze(-1).double()
        return self.linear(pooled)


def build(p: float = 0.0, width: int = 8) -> nn.Sequential:
    return nn.Sequential(Embed(width), *[Block(width, p) for _ in range(6)], Head(width)).double()


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


def make_batch(step: int, n: int = 10) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    length = 4 + step  # the sequence length changes between steps
    x = torch.randn(n, length, 3, generator=g, dtype=torch.float64)
    mask = torch.rand(n, length, generator=g) > 0.2
    mask[:, 0] = True
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    return (x, mask), y


def reference(model: nn.Module, chunks: int, steps: int) -> tuple[list[float], dict[str, Tensor]]:
    """The plain module on the same micro-batches; loss = mean of the micro-batch losses."""
    losses = []
    for step in range(steps):
        (x, mask), y = make_batch(step)
        pieces = list(zip(x.tensor_split(chunks), mask.tensor_split(chunks), y.tensor_split(chunks), strict=False))
        pieces = [p for p in pieces if len(p[0])]
        total = sum(loss_fn(model((xm, mm)), ym) for xm, mm, ym in pieces) / len(pieces)
        total.backward()
        losses.append(float(total.detach()))
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def run_pipeline(rank: int, world: int, balance: list[int], steps: int,
                 schedules: tuple[str, ...] = ("gpipe", "1f1b", "1f1b_slack1"),
                 chunk_counts: tuple[int, ...] = (1, 3, 4)) -> list[Any]:
    results = []
    for schedule, checkpoint, chunks in itertools.product(
        schedules, ["always", "except_last", "never"], chunk_counts
    ):
        torch.manual_seed(0)
        model = build()
        pipe = gp.DistributedGPipe(
            copy.deepcopy(model), balance, chunks=chunks, checkpoint=checkpoint,
            schedule=schedule, loss_fn=loss_fn,
        )
        losses = []
        for step in range(steps):
            (x, mask), y = make_batch(step)
            inputs = (x, mask) if pipe.is_first else None
            targets = y if pipe.is_last else None
            losses.append(float(pipe.step(inputs, targets)))
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        results.append(((schedule, checkpoint, chunks), losses, grads))
    return results


FILL_DRAIN_1F1B = ("gpipe", "1f1b", "1f1b_slack1")


@pytest.mark.parametrize(("world", "balance", "schedules", "chunk_counts", "steps"), [
    pytest.param(2, [3, 5], FILL_DRAIN_1F1B, (1, 3, 4), 2, id="gpipe-1f1b-2ranks"),
    pytest.param(4, [2, 2, 2, 2], FILL_DRAIN_1F1B, (1, 3, 4), 2, id="gpipe-1f1b-4ranks"),
    # The backward split into I and W (W deferred); 8 micro-batches fill ZB-H2's 2K-1 warm-up
    # on 4 stages.
    pytest.param(2, [3, 5], ("zb_h1", "zb_h2"), (1, 3, 8), 2, id="zero-bubble-2ranks"),
    pytest.param(4, [2, 2, 2, 2], ("zb_h1", "zb_h2"), (1, 3, 8), 2, id="zero-bubble-4ranks"),
    # Two stages per rank; 3 micro-batches are uneven over 10 samples (4+3+3).
    pytest.param(2, [2, 2, 2, 2], VIRTUAL, (1, 3, 8), 2, id="virtual-2ranks"),
    pytest.param(4, [1] * 8, VIRTUAL, (1, 3, 8), 2, id="virtual-4ranks"),
    # DualPipeV needs M >= 2 x ranks; 5 micro-batches of 10 samples are 2 each.
    pytest.param(2, [2, 2, 2, 2], ("dualpipe_v",), (4, 5), 2, id="dualpipe-v-2ranks"),
    pytest.param(4, [1] * 8, ("dualpipe_v",), (8,), 2, id="dualpipe-v-4ranks"),
    pytest.param(2, [1, 1, 2, 2, 1, 1], ("interleaved_1f1b",), (2, 5), 1,
                 id="three-stages-per-rank"),
])
def test_schedules_match_single_process_reference(
    tmp_path: Path, world: int, balance: list[int], schedules: tuple[str, ...],
    chunk_counts: tuple[int, ...], steps: int,
) -> None:
    # Same losses and every parameter's gradient, with every re-materialization mode; the
    # sequence length changes between the two steps.
    per_rank = spawn(run_pipeline, world, tmp_path, balance, steps, schedules, chunk_counts)
    check_against_reference(per_rank, steps)


def check_against_reference(per_rank: list[Any], steps: int) -> None:
    for case_index in range(len(per_rank[0])):
        case, _, _ = per_rank[0][case_index]
        _, _, chunks = case
        torch.manual_seed(0)
        ref_losses, ref_grads = reference(build(), chunks, steps)
        seen: set[str] = set()
        for rank_results in per_rank:
            got_case, losses, grads = rank_results[case_index]
            assert got_case == case
            assert losses == pytest.approx(ref_losses, abs=TOL), case
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=TOL, msg=f"{case} {name}")
                seen.add(name)
        assert seen == set(ref_grads)  # every parameter lives on exactly one rank


def run_uneven_and_small(rank: int, world: int) -> list[Any]:
    out = []
    for n in (7, 2):  # 7 over 4 micro-batches is uneven; 2 samples give only 2 micro-batches
        torch.manual_seed(0)
        pipe = gp.DistributedGPipe(build(), [4, 4], chunks=4, loss_fn=loss_fn)
        (x, mask), y = make_batch(0, n=n)
        loss = pipe.step((x, mask), y)
        out.append((float(loss), {k: p.grad.clone() for k, p in pipe.named_parameters()}))
    return out


def test_uneven_and_small_batches(tmp_path: Path) -> None:
    per_rank = spawn(run_uneven_and_small, 2, tmp_path)
    for index, n in enumerate((7, 2)):
        torch.manual_seed(0)
        model = build()
        (x, mask), y = make_batch(0, n=n)
        chunks = min(4, n)
        pieces = list(zip(x.tensor_split(chunks), mask.tensor_split(chunks), y.tensor_split(chunks), strict=False))
        total = sum(loss_fn(model((a, b)), c) for a, b, c in pieces) / chunks
        total.backward()
        for loss, grads in (r[index] for r in per_rank):
            assert loss == pytest.approx(total.item(), abs=TOL)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad,
                                           rtol=0, atol=TOL)


def run_dropout(rank: int, world: int, balance: list[int], schedule: str = "gpipe",
                checkpoint: str = "always") -> Any:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(p=0.3), balance, chunks=4, loss_fn=loss_fn, seed=77,
                               checkpoint=checkpoint, schedule=schedule)
    (x, mask), y = make_batch(0, n=8)
    before = torch.get_rng_state()
    loss = pipe.step((x, mask), y)
    assert torch.equal(torch.get_rng_state(), before)  # dropout drew from its own streams
    return float(loss), {k: p.grad.clone() for k, p in pipe.named_parameters()}


@pytest.mark.parametrize(("schedule", "checkpoint", "balance"), [
    ("gpipe", "always", [3, 5]), ("zb_h1", "always", [3, 5]), ("zb_h2", "except_last", [3, 5]),
    *[(schedule, "except_last", [2, 2, 2, 2]) for schedule in VIRTUAL],
])
def test_dropout_masks_equal_single_process_gpipe(tmp_path: Path, schedule: str,
                                                  checkpoint: str, balance: list[int]) -> None:
    per_rank = spawn(run_dropout, 2, tmp_path, balance, schedule, checkpoint)
    check_dropout_against_gpipe(per_rank)


def check_dropout_against_gpipe(per_rank: list[Any]) -> None:
    """Every rank's loss and gradients (``run_dropout``) equal single-process GPipe's."""
    torch.manual_seed(0)
    pipe = gp.GPipe(build(p=0.3), [2, 6], chunks=4, seed=77, checkpoint="never")
    (x, mask), y = make_batch(0, n=8)
    out = pipe((x, mask))
    # Equal micro-batches: the mean of micro-batch losses is the mean over the batch.
    loss = sum(loss_fn(o, t) for o, t in zip(out.tensor_split(4), y.tensor_split(4), strict=False)) / 4
    loss.backward()
    grads = dict(pipe.named_parameters())
    for got_loss, got in per_rank:
        assert got_loss == pytest.approx(float(loss), abs=TOL)
        for name, grad in got.items():
            torch.testing.assert_close(grad, grads[name].grad, rtol=0, atol=TOL)


def run_meta(rank: int, world: int) -> Any:
    with torch.device("meta"):
        model = build()
    pipe = gp.DistributedGPipe(model, [4, 4], chunks=2, loss_fn=loss_fn, seed=5)
    assert all(not p.is_meta for p in pipe.parameters())
    (x, mask), y = make_batch(0)
    pipe.step((x, mask), y)
    return {k: v.clone() for k, v in pipe.state_dict().items()}, {
        k: p.grad.clone() for k, p in pipe.named_parameters()
    }


def test_meta_model_materializes_only_the_local_partition(tmp_path: Path) -> None:
    per_rank = spawn(run_meta, 2, tmp_path)
    with torch.device("meta"):
        model = build()
    gp.materialize(model, seed=5)
    state = model.state_dict()
    assert set(per_rank[0][0]).isdisjoint(per_rank[1][0])
    assert set(per_rank[0][0]) | set(per_rank[1][0]) == set(state)
    for rank_state, _ in per_rank:
        for key, value in rank_state.items():
            assert torch.equal(value, state[key]), key
    _, ref_grads = reference(model, 2, 1)
    for _, grads in per_rank:
        for key, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[key], rtol=0, atol=TOL)


def run_data_parallel(rank: int, world: int, schedule: str, balance: list[int]) -> Any:
    pipeline_group, data_group = gp.init_process_groups(2)
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), balance, chunks=2, loss_fn=loss_fn, group=pipeline_group,
                               data_parallel_group=data_group, schedule=schedule)
    (x, mask), y = make_batch(0, n=8)
    replica = rank // 2
    half = slice(replica * 4, replica * 4 + 4)  # each replica takes half of the mini-batch
    loss = pipe.step((x[half], mask[half]), y[half])
    return float(loss), {k: p.grad.clone() for k, p in pipe.named_parameters()}


@pytest.mark.parametrize(("schedule", "balance"), [
    ("gpipe", [4, 4]), *[(schedule, [2, 2, 2, 2]) for schedule in VIRTUAL]])
def test_pipeline_times_data_parallel(tmp_path: Path, schedule: str, balance: list[int]) -> None:
    per_rank = spawn(run_data_parallel, 4, tmp_path, schedule, balance)
    torch.manual_seed(0)
    model = build()
    (x, mask), y = make_batch(0, n=8)
    # Reference: 2 replicas x 2 micro-batches = the full batch in 4 equal pieces, averaged.
    pieces = list(zip(x.tensor_split(4), mask.tensor_split(4), y.tensor_split(4), strict=False))
    (sum(loss_fn(model((a, b)), c) for a, b, c in pieces) / 4).backward()
    ref = dict(model.named_parameters())
    for _, grads in per_rank:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref[name].grad, rtol=0, atol=TOL)


def run_checkpoint_save(rank: int, world: int, directory: str, balance: list[int]) -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build()
    pipe = gp.DistributedGPipe(model, balance, chunks=2, loss_fn=loss_fn, seed=11)
    pipe.save_checkpoint(directory)


def run_checkpoint_load(rank: int, world: int, directory: str, balance: list[int]) -> Any:
    with torch.device("meta"):
        model = build()
    pipe = gp.DistributedGPipe(model, balance, chunks=2, loss_fn=loss_fn, seed=999)
    pipe.load_checkpoint(directory)
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def test_checkpoint_from_two_ranks_loads_into_four_gpipe_and_plain(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    spawn(run_checkpoint_save, 2, tmp_path / "save", directory, [4, 4])
    loaded = spawn(run_checkpoint_load, 4, tmp_path / "load", directory, [2, 2, 2, 2])
    with torch.device("meta"):
        expected = build()
    gp.materialize(expected, seed=11)
    state = expected.state_dict()
    merged: dict[str, Tensor] = {}
    for part in loaded:
        merged.update(part)
    assert set(merged) == set(state)
    for key in state:
        assert torch.equal(merged[key], state[key])
    plain = build()
    plain.load_state_dict(gp.load_shards(directory))
    pipe = gp.GPipe(build(), [3, 5], chunks=2)
    pipe.load_state_dict(gp.load_shards(directory))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, state[key]) and torch.equal(pipe.state_dict()[key], state[key])


def run_checkpoint_load_reporting(rank: int, world: int, directory: str,
                                  balance: list[int]) -> Any:
    try:
        return run_checkpoint_load(rank, world, directory, balance)
    except gp.CheckpointCorruptError as error:
        return str(error)


def test_checkpoint_with_the_same_balance_reads_only_the_stages_own_shard(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ckpt"
    spawn(run_checkpoint_save, 2, tmp_path / "save", str(directory), [4, 4])
    other = directory / "shard-001-of-002.pt"
    other.write_bytes(other.read_bytes()[:-8])  # damage the second stage's shard
    first, second = spawn(run_checkpoint_load_reporting, 2, tmp_path / "load", str(directory),
                          [4, 4])
    with torch.device("meta"):
        expected = build()
    state = gp.materialize(expected, seed=11).state_dict()
    assert isinstance(first, dict) and set(first) < set(state)  # never opened shard 1
    for key, value in first.items():
        assert torch.equal(value, state[key])
    assert isinstance(second, str) and f"checkpoint file {other} is damaged" in second


def run_clip_and_trace(rank: int, world: int, root: str, schedule: str,
                       balance: list[int]) -> Any:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), balance, chunks=4, loss_fn=loss_fn, record=True,
                               schedule=schedule)
    (x, mask), y = make_batch(0)
    pipe.step((x, mask), y)
    norm = pipe.clip_grad_norm_(1e-3)
    pipe.trace(f"{root}/trace.json", f"{root}/timeline.png")
    return (float(norm), {k: p.grad.clone() for k, p in pipe.named_parameters()},
            [e.action for e in pipe.timeline])


@pytest.mark.parametrize(("schedule", "balance", "row_names"), [
    ("gpipe", [4, 4], None),
    ("zb_v", [2, 2, 2, 2], {0: "rank 0 (stages 0, 3)", 1: "rank 1 (stages 1, 2)"}),
])
def test_global_grad_clipping_and_timeline(tmp_path: Path, schedule: str, balance: list[int],
                                           row_names: dict[int, str] | None) -> None:
    per_rank = spawn(run_clip_and_trace, 2, tmp_path, str(tmp_path), schedule, balance)
    torch.manual_seed(0)
    model = build()
    _, ref = reference(model, 4, 1)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    for norm, grads, _ in per_rank:
        assert norm == pytest.approx(float(total), rel=1e-9)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad,
                                       rtol=0, atol=1e-12)
    import json

    expected = gp.schedule.get_schedule(schedule, len(balance), 4, num_ranks=2)
    for rank, (_, _, actions) in enumerate(per_rank):  # each rank ran its row, in order
        assert actions == [str(a) for a in expected.actions[rank]]
    trace = json.loads((tmp_path / "trace.json").read_text())
    rows = {(e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert rows == {(expected.placement[a.stage], str(a)) for row in expected.actions for a in row}
    if schedule == "gpipe":
        assert {name for _, name in rows} == {f"{s}{k}{m}" for s in range(2) for k in "FB"
                                              for m in range(4)}
    if row_names is not None:
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
        assert names == row_names
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def run_two_steps_clearing_between(rank: int, world: int) -> tuple[list[str], list[str]]:
    pipe = gp.DistributedGPipe(build(), [2, 2, 2, 2], chunks=4, loss_fn=loss_fn, record=True,
                               schedule="zb_v")
    (x, mask), y = make_batch(0)
    pipe.step((x, mask), y)
    first = [e.action for e in pipe.timeline]
    pipe.timeline.clear()
    assert pipe.timeline == []
    pipe.zero_grad()
    pipe.step((x, mask), y)
    return first, [e.action for e in pipe.timeline]


def test_clearing_the_timeline_of_a_rank_with_two_stages_forgets_both(tmp_path: Path) -> None:
    # pipe.timeline merges a rank's stages; its clear() must reach each stage's own timeline
    # (it once cleared a merged copy only, so a second step's timeline held the first's too)
    expected = gp.schedule.get_schedule("zb_v", 4, 4, num_ranks=2)
    for rank, (first, second) in enumerate(spawn(run_two_steps_clearing_between, 2, tmp_path)):
        assert first == second == [str(a) for a in expected.actions[rank]]


def run_profile(rank: int, world: int, schedule: str, checkpoint: str) -> Any:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), [4, 4], chunks=4, loss_fn=loss_fn, record=True,
                               schedule=schedule, checkpoint=checkpoint)
    (x, mask), y = make_batch(0)
    pipe.step((x, mask), y)  # warm-up, left out
    pipe.timeline.clear()
    for step in range(1, 3):
        (x, mask), y = make_batch(step)
        pipe.zero_grad()
        pipe.step((x, mask), y)
    own = [(e.action, e.end - (e.ready if e.ready is not None else e.start))
           for e in pipe.timeline]
    return pipe.profile(transfer=1e-4), own


@pytest.mark.parametrize(("schedule", "checkpoint"), [("1f1b", "except_last"),
                                                      ("zb_h1", "never")])
def test_a_pipeline_profiles_its_own_steps(tmp_path: Path, schedule: str,
                                           checkpoint: str) -> None:
    per_rank = spawn(run_profile, 2, tmp_path, schedule, checkpoint)
    (first, own0), (second, own1) = per_rank
    assert first == second  # every rank gets the gathered profile
    assert first.rounds == 2 and first.num_microbatches == 4 and first.transfer == [1e-4]
    assert all(0 < c < 10 for c in first.forward + first.backward)
    # Each stage's samples are the means of the costs its own rank recorded, step by step.
    for stage, own in enumerate((own0, own1)):
        forwards = [seconds for action, seconds in own if action[1] == "F"
                    and (checkpoint == "never" or int(action[2:]) == 3)]
        per_step = len(forwards) // 2
        assert first.samples[stage]["F"] == pytest.approx(
            [sum(forwards[:per_step]) / per_step, sum(forwards[per_step:]) / per_step])
    assert (first.backward_weight is not None) == (schedule == "zb_h1")
    prediction = gp.simulate(gp.get_schedule("gpipe", 2, 4), first)
    assert prediction.step_time > 0


class Tied(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()


def build_tied() -> nn.Sequential:
    first = nn.Linear(4, 4, bias=False)
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), Tied(first.weight)).double()


def loss_fn_tied(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


def init_tied(layer: torch.nn.Module, index: int) -> None:
    """Meta-device initialisation: the tied copy on the last stage starts as zeros (the first
    stage's copy replaces it)."""
    reset = getattr(layer, "reset_parameters", None)
    if callable(reset):
        reset()
    else:
        for param in layer.parameters():
            torch.nn.init.zeros_(param)


def run_tied(rank: int, world: int, schedule: str, balance: list[int], meta: bool) -> Any:
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = build_tied()
    else:
        model = build_tied()
    pipe = gp.DistributedGPipe(model, balance, chunks=2, loss_fn=loss_fn_tied,
                               tied=("0.weight", "4.weight"), schedule=schedule, seed=3,
                               init_fn=init_tied if meta else None)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    params = dict(pipe.named_parameters(remove_duplicate=False))
    start = {k: p.detach().clone() for k, p in params.items()}
    pipe.step(x, x)
    norm = float(pipe.clip_grad_norm_(1e9))
    return start, {k: p.grad.clone() for k, p in params.items()}, norm


@pytest.mark.parametrize(("schedule", "balance"), [
    ("gpipe", [2, 3]), *[(schedule, [1, 1, 2, 1]) for schedule in VIRTUAL]])
@pytest.mark.parametrize("meta", [False, True])
def test_tied_first_and_last_weight(tmp_path: Path, schedule: str, balance: list[int],
                                    meta: bool) -> None:
    # gpipe and interleaved: the ends on ranks 0 and 1; zb_v: both on rank 0 (kept equal in
    # place).
    per_rank = spawn(run_tied, 2, tmp_path, schedule, balance, meta)
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


def run_failing(rank: int, world: int) -> None:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), [2, 2, 4], chunks=2, loss_fn=loss_fn, timeout_s=20)
    (x, mask), y = make_batch(0)
    if rank == 1:
        raise ValueError("boom on purpose")
    pipe.step((x, mask), y)


def test_a_failing_rank_stops_the_others_with_its_name(tmp_path: Path) -> None:
    import time

    start = time.monotonic()
    results = spawn(run_failing, 3, tmp_path, timeout_s=90, expect_failure=True)
    elapsed = time.monotonic() - start
    assert all(code != 0 for code, _ in results)
    assert "boom on purpose" in results[1][1]
    for rank in (0, 2):
        assert "PipelineFailure" in results[rank][1]
        assert "rank 1" in results[rank][1]
    assert elapsed < 60


def run_dying(rank: int, world: int) -> None:
    import os

    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), [4, 4], chunks=2, loss_fn=loss_fn, timeout_s=20)
    (x, mask), y = make_batch(0)
    pipe.step((x, mask), y)
    if rank == 1:
        os._exit(7)  # dies without a word, as a killed process would
    pipe.step((x, mask), y)


def test_a_dead_rank_is_named_by_the_survivor(tmp_path: Path) -> None:
    import time

    start = time.monotonic()
    results = spawn(run_dying, 2, tmp_path, timeout_s=90, expect_failure=True)
    assert results[1][0] == 7
    assert results[0][0] != 0
    assert "PipelineFailure" in results[0][1] and "peer rank 1 (stage 1)" in results[0][1]
    assert time.monotonic() - start < 60


def run_evaluate(rank: int, world: int, schedule: str, balance: list[int]) -> Any:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(p=0.2), balance, chunks=3, loss_fn=loss_fn,
                               schedule=schedule)
    (x, mask), y = make_batch(0)
    pipe.eval()
    loss, out = pipe.evaluate((x, mask) if pipe.is_first else None, y if pipe.is_last else None,
                              return_outputs=True)
    pipe.train()
    pipe.step((x, mask), y)  # training and evaluation interleave freely
    pipe.eval()
    loss_again, _ = pipe.evaluate((x, mask), y)  # no optimizer step: the same loss
    return float(loss), out, float(loss_again), pipe.steps_done


@pytest.mark.parametrize(("schedule", "balance", "last_rank"), [
    ("1f1b", [4, 4], 1), ("interleaved_1f1b", [2, 2, 2, 2], 1),
    ("interleaved_zb", [2, 2, 2, 2], 1), ("zb_v", [2, 2, 2, 2], 0)])
def test_evaluate_is_a_forward_only_pass(tmp_path: Path, schedule: str, balance: list[int],
                                         last_rank: int) -> None:
    per_rank = spawn(run_evaluate, 2, tmp_path, schedule, balance)
    torch.manual_seed(0)
    model = build(p=0.2).eval()
    (x, mask), y = make_batch(0)
    with torch.no_grad():
        out = model((x, mask))
        expected = sum(loss_fn(o, t) for o, t in zip(out.tensor_split(3), y.tensor_split(3),
                                                      strict=True)) / 3
    for rank, (loss, outputs, loss_again, steps) in enumerate(per_rank):
        assert loss == pytest.approx(float(expected), abs=TOL)
        assert loss_again == pytest.approx(float(expected), abs=TOL)
        assert steps == 1
        if rank == last_rank:  # the outputs live on the rank of the last stage only
            torch.testing.assert_close(outputs, out, rtol=0, atol=TOL)
        else:
            assert outputs is None


def run_out_of_step(rank: int, world: int) -> None:
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), [4, 4], chunks=2, loss_fn=loss_fn, timeout_s=20)
    (x, mask), y = make_batch(0)
    pipe.step((x, mask), y)
    if rank == 0:
        pipe.evaluate((x, mask), y)  # rank 1 trains instead: the ranks' calls disagree
    else:
        pipe.step((x, mask), y)


def test_ranks_out_of_step_are_told_so(tmp_path: Path) -> None:
    results = spawn(run_out_of_step, 2, tmp_path, timeout_s=90, expect_failure=True)
    assert all(code != 0 for code, _ in results)
    assert "StepMismatch" in results[1][1] and "same number of times" in results[1][1]
    assert "PipelineFailure" in results[0][1] and "rank 1" in results[0][1]
