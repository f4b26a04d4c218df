"""A checkpoint records its pipeline's layout; ``DistributedGPipe.from_checkpoint`` rebuilds the
pipeline from it (same ranks: training continues exactly; other ranks: stages joined or split
anew), old checkpoints load with the split given, and a split that cannot be reused is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import gpipe_core as gp
from tests.distributed.launch import spawn
from tests.distributed.test_pipeline import build, loss_fn, make_batch

pytestmark = pytest.mark.distributed
TOL = 1e-10
DROPOUT = 0.2  # the random streams must continue where the saved pipeline left them


def train(pipe: gp.DistributedGPipe, steps: range) -> list[float]:
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)  # no state: only weights matter
    losses = []
    for step in steps:
        (x, mask), y = make_batch(step)
        optimizer.zero_grad()
        losses.append(float(pipe.step((x, mask) if pipe.is_first else None,
                                      y if pipe.is_last else None)))
        optimizer.step()
    return losses


def evaluate(pipe: gp.DistributedGPipe) -> tuple[float, Any]:
    (x, mask), y = make_batch(7)
    pipe.eval()
    loss, outputs = pipe.evaluate((x, mask), y, return_outputs=True)
    pipe.train()
    return float(loss), outputs


def save_and_continue(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train 3 steps, save, train 2 more; also save a virtual-stage pipeline."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build(DROPOUT)
    pipe = gp.DistributedGPipe(model, [3, 5], chunks=3, schedule="1f1b", loss_fn=loss_fn,
                               seed=5)
    train(pipe, range(3))
    pipe.save_checkpoint(f"{root}/ckpt")
    losses = train(pipe, range(3, 5))
    result = {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()},
              "eval": evaluate(pipe)}
    with torch.device("meta"):
        model = build()
    virtual = gp.DistributedGPipe(model, [2, 2, 2, 2], chunks=4, schedule="interleaved_1f1b",
                                  loss_fn=loss_fn, seed=6)
    virtual.save_checkpoint(f"{root}/virtual")
    return result


def reload(rank: int, world: int, root: str) -> dict[str, Any]:
    """from_checkpoint on the same 2 ranks: the layout's pipeline, the weights, the streams."""
    with torch.device("meta"):
        model = build(DROPOUT)
    pipe = gp.DistributedGPipe.from_checkpoint(f"{root}/ckpt", model, loss_fn=loss_fn)
    result: dict[str, Any] = {
        "built": (pipe.balance, pipe.schedule_name, pipe.chunks, pipe.seed, pipe.steps_done),
        "losses": train(pipe, range(3, 5)),
        "state": {k: v.clone() for k, v in pipe.state_dict().items()},
        "eval": evaluate(pipe),
    }
    with torch.device("meta"):
        model = build()
    try:
        gp.DistributedGPipe.from_checkpoint(f"{root}/old", model, loss_fn=loss_fn)
        result["old_error"] = "no error"
    except ValueError as error:
        result["old_error"] = str(error)
    with torch.device("meta"):
        model = build()
    old = gp.DistributedGPipe.from_checkpoint(f"{root}/old", model, balance=[3, 5], chunks=3,
                                              loss_fn=loss_fn)
    result["old_state"] = {k: v.clone() for k, v in old.state_dict().items()}
    # 4 virtual stages (2 per rank) joined into one stage per rank, as decoding needs
    with torch.device("meta"):
        model = build()
    joined = gp.DistributedGPipe.from_checkpoint(f"{root}/virtual", model, num_stages=2,
                                                 schedule="gpipe", loss_fn=loss_fn)
    result["joined"] = (joined.balance, evaluate(joined)[0])
    try:
        gp.DistributedGPipe.from_checkpoint(f"{root}/ckpt", model[:-1], loss_fn=loss_fn)
        result["wrong_module"] = "no error"
    except ValueError as error:
        result["wrong_module"] = str(error)
    return result


def other_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """from_checkpoint of the 2-rank checkpoint on 3 ranks: an error, then split anew."""
    result: dict[str, Any] = {}
    with torch.device("meta"):
        model = build(DROPOUT)
    try:
        gp.DistributedGPipe.from_checkpoint(f"{root}/ckpt", model, loss_fn=loss_fn)
        result["error"] = "no error"
    except ValueError as error:
        result["error"] = str(error)
    pipe = gp.DistributedGPipe.from_checkpoint(f"{root}/ckpt", model, loss_fn=loss_fn,
                                               resplit=gp.balance_by_params)
    result["balance"] = pipe.balance
    result["eval"] = evaluate(pipe)[0]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("from_checkpoint")
    saved = spawn(save_and_continue, 2, root / "a", str(root))
    shutil.copytree(root / "ckpt", root / "old")  # as written before layouts were recorded
    index = json.loads((root / "old" / "index.json").read_text())
    del index["pipeline"]
    (root / "old" / "index.json").write_text(json.dumps(index))
    reloaded = spawn(reload, 2, root / "b", str(root))
    return {"root": root, "saved": saved, "reloaded": reloaded}


def merged(per_rank: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for result in per_rank:
        state.update(result[key])
    return state


def plain_loss(directory: Path, chunks: int) -> float:
    """The evaluation loss of the checkpoint's weights in the plain module."""
    model = build()
    model.load_state_dict(gp.load_shards(directory))
    model.eval()
    (x, mask), y = make_batch(7)
    with torch.no_grad():
        return float(sum(loss_fn(model((a, b)), c) for a, b, c in zip(
            x.tensor_split(chunks), mask.tensor_split(chunks), y.tensor_split(chunks),
            strict=True)) / chunks)


def test_the_index_records_split_placement_schedule_and_chunks(runs: dict[str, Any]) -> None:
    layout = gp.read_layout(runs["root"] / "ckpt")
    assert layout is not None
    assert (layout.balance, layout.placement, layout.num_ranks) == ((3, 5), (0, 1), 2)
    assert (layout.schedule, layout.chunks, layout.checkpoint) == ("1f1b", 3, "except_last")
    assert (layout.seed, layout.steps_done) == (5, 3)
    virtual = gp.read_layout(runs["root"] / "virtual")
    assert virtual is not None and virtual.placement == (0, 1, 0, 1)
    assert virtual.schedule == "interleaved_1f1b" and virtual.stages_per_rank == 2
    assert gp.read_layout(runs["root"] / "old") is None


def test_a_pipeline_from_its_checkpoint_continues_training_exactly(runs: dict[str, Any]) -> None:
    saved, reloaded = runs["saved"], runs["reloaded"]
    for result in reloaded:
        assert result["built"] == ([3, 5], "1f1b", 3, 5, 3)
    assert [r["losses"] for r in reloaded] == [s["losses"] for s in saved]  # dropout included
    want = merged(saved, "state")
    got = merged(reloaded, "state")
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert reloaded[1]["eval"][0] == saved[1]["eval"][0]
    assert torch.equal(reloaded[1]["eval"][1], saved[1]["eval"][1])


def test_an_old_checkpoint_names_the_fix_and_loads_with_the_split_given(
        runs: dict[str, Any]) -> None:
    for result in runs["reloaded"]:
        error = result["old_error"]
        assert "written before index.json recorded the pipeline's stage split" in error, error
        assert "pass balance= with 2 entries that sum to 8" in error
        assert "resplit=gp.balance_by_params" in error
    state = merged(runs["reloaded"], "old_state")
    expected = gp.load_shards(runs["root"] / "ckpt")
    assert set(state) == set(expected)
    assert all(torch.equal(state[key], expected[key]) for key in expected)


def test_virtual_stages_join_into_one_stage_per_rank(runs: dict[str, Any]) -> None:
    for balance, loss in (result["joined"] for result in runs["reloaded"]):
        assert balance == [4, 4]
        assert loss == pytest.approx(plain_loss(runs["root"] / "virtual", chunks=4), rel=0, abs=TOL)


def test_another_number_of_ranks_names_the_split_and_splits_anew_when_asked(
        runs: dict[str, Any], tmp_path: Path) -> None:
    per_rank = spawn(other_ranks, 3, tmp_path, str(runs["root"]))
    for result in per_rank:
        error = result["error"]
        assert "records 2 stages on 2 ranks (balance [3, 5], schedule '1f1b')" in error, error
        assert "pipeline of 3 ranks needs 3 stages" in error
        assert "pass balance= with 3 entries that sum to 8" in error
        assert "or launch 2 ranks" in error
        assert len(result["balance"]) == 3 and sum(result["balance"]) == 8
    assert per_rank[0]["eval"] == pytest.approx(plain_loss(runs["root"] / "ckpt", chunks=3),
                                                rel=0, abs=TOL)


def test_a_module_of_another_size_is_refused(runs: dict[str, Any]) -> None:
    for result in runs["reloaded"]:
        assert "holds a model of 8 layers (balance [3, 5]), but module has 7" in result[
            "wrong_module"]
