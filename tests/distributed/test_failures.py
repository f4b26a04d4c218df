"""Failures outside step(): collectives that fail within the bound naming the rank; checkpoints
that every rank writes into one verified index."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import gpipe_core as gp
from tests.distributed.launch import spawn

pytestmark = pytest.mark.distributed

PG_TIMEOUT_S = 3.0  # the process group's (and so every collective's) bound in these tests


def run_hung_rank(rank: int, world: int, hang_s: float) -> Any:
    """Rank 2 stops answering between two blocks of collectives (as at a log step)."""
    value = torch.ones(1)
    with gp.collectives("stop broadcast at step 1"):
        dist.broadcast(value, src=0)
    if rank == 2:
        time.sleep(hang_s)  # stands for SIGSTOP, a stuck disk, a debugger...
    begin = time.monotonic()
    try:
        with gp.collectives("stats at step 1"):
            dist.all_reduce(value)
    except gp.PipelineFailure as failure:
        return str(failure), time.monotonic() - begin
    return None, time.monotonic() - begin


def test_a_rank_that_hangs_outside_step_is_named_within_the_bound(tmp_path: Path) -> None:
    results = spawn(run_hung_rank, 3, tmp_path, 10.0, pg_timeout_s=PG_TIMEOUT_S, timeout_s=60)
    for rank in (0, 1):
        message, waited = results[rank]
        assert message is not None, f"rank {rank} did not fail"
        assert message.startswith(f"rank {rank} stops: a collective in 'stats at step 1' got "
                                  "no answer (rank 2 is still at 'stop broadcast at step 1'")
        assert "rank 1 is" not in message and "rank 0 is" not in message
        assert waited < PG_TIMEOUT_S + 5.0  # the bound, plus the grace to let marks settle
    assert results[2][0] is not None  # the late rank finds its peers gone: it fails too


def run_raising_rank(rank: int, world: int) -> Any:
    """Rank 1 raises outside step(); the top-level handler reports it, rank 0 names its error."""
    value = torch.ones(1)
    if rank == 1:
        error = ValueError("shard 3 of the training data is truncated")
        gp.report_failure(error)
        return None
    try:
        with gp.collectives("stop broadcast at step 7"):
            dist.broadcast(value, src=0)
            dist.all_reduce(value)
    except gp.PipelineFailure as failure:
        return str(failure)
    return None


def test_a_rank_that_raised_is_named_with_its_error(tmp_path: Path) -> None:
    results = spawn(run_raising_rank, 2, tmp_path, pg_timeout_s=PG_TIMEOUT_S, timeout_s=60)
    assert results[0] == ("rank 0 stops: the run failed at rank 1: ValueError: shard 3 of the "
                          "training data is truncated")


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 2))


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


def run_save(rank: int, world: int, directory: str) -> None:
    pipe = gp.DistributedGPipe(build(), [2, 2], chunks=2, loss_fn=loss_fn)
    pipe.save_checkpoint(directory, files={f"train-state-rank{rank:03d}.pt": {"rank": rank},
                                           f"note-{rank}.txt": f"rank {rank}\n"})


def test_every_rank_file_is_in_one_verified_index(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    spawn(run_save, 2, tmp_path / "run", str(directory), timeout_s=60)
    index = json.loads((directory / "index.json").read_text())
    assert index["num_shards"] == 2
    assert sorted(index["files"]) == [
        "note-0.txt", "note-1.txt", "shard-000-of-002.pt", "shard-001-of-002.pt",
        "train-state-rank000.pt", "train-state-rank001.pt"]
    gp.verify_checkpoint(directory)
    plain = build()
    plain.load_state_dict(gp.load_shards(directory))
    shard = directory / "shard-001-of-002.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(gp.CheckpointCorruptError, match=r"shard-001-of-002\.pt is damaged"):
        gp.load_shards(directory)


def run_own_error(rank: int, world: int) -> Any:
    try:
        with gp.collectives("my own code"):
            raise RuntimeError("shape mismatch in my own code")
    except RuntimeError as error:
        result = type(error).__name__, str(error)
    # neither rank may leave before both have connected: a rank that exits while its peer is
    # still connecting makes the peer's process-group set-up fail (seen on a loaded machine)
    dist.barrier()
    return result


def test_an_error_in_the_block_itself_is_not_blamed_on_a_peer(tmp_path: Path) -> None:
    results = spawn(run_own_error, 2, tmp_path, pg_timeout_s=PG_TIMEOUT_S, timeout_s=60)
    assert results == [("RuntimeError", "shape mismatch in my own code")] * 2


# ---------------------------------------------------------------------------------------------
# Every kind of wait inside a pipeline is bounded by init_process_groups(timeout_s=...): a rank
# stopped by SIGSTOP is named by its peer within timeout_s + NAMING_S. The world group of these
# processes waits 120 s, so a wait on any group built without the bound could not pass.

# Long enough that a first step on two busy cores never times out by itself (3 s once did, at a
# load average of 8), short enough that the 30-minute default could not pass for it.
GROUP_TIMEOUT_S = 5.0


def run_stopped_rank(rank: int, world: int, where: str, report: str) -> None:
    import os
    import signal

    num_stages = 1 if where == "data-parallel average" else 2
    pipeline_group, data_group = gp.init_process_groups(num_stages, timeout_s=GROUP_TIMEOUT_S)
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    balance = [4] if num_stages == 1 else [2, 2]
    pipe = gp.DistributedGPipe(build(), balance, chunks=2, loss_fn=loss_fn, group=pipeline_group,
                               data_parallel_group=data_group if num_stages == 1 else None)
    assert pipe.timeout_s == GROUP_TIMEOUT_S  # one number bounds messages and collectives
    inputs, targets = torch.randn(4, 4), torch.randn(4, 2)
    pipe.step(inputs, targets)
    pipe.clip_grad_norm_(1.0)
    dist.barrier()  # both ranks are past their first step (slow on busy cores)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 kills it once it has named it
    begin = time.monotonic()
    try:
        if where in ("message", "data-parallel average"):
            pipe.step(inputs, targets)
        elif where == "clip_grad_norm_":
            pipe.clip_grad_norm_(1.0)
        elif where == "evaluation loss":
            pipe.evaluate(inputs, targets)
        message = None
    except gp.PipelineFailure as failure:
        message = str(failure)
    waited = time.monotonic() - begin
    Path(report).write_text(json.dumps({"message": message, "waited": waited}))
    os.kill(pids[1], signal.SIGKILL)


@pytest.mark.parametrize("where", ["message", "clip_grad_norm_", "data-parallel average",
                                   "evaluation loss"])
def test_a_stopped_rank_is_named_within_the_groups_bound(tmp_path: Path, where: str) -> None:
    report = tmp_path / "rank0.json"
    codes = spawn(run_stopped_rank, 2, tmp_path / "run", where, str(report), pg_timeout_s=120,
                  timeout_s=90, expect_failure=True)
    assert codes[0][0] == 0, codes[0][1]
    result = json.loads(report.read_text())
    assert result["message"] is not None and "rank 1" in result["message"], result
    assert result["message"].startswith("rank 0"), result
    # the bound: the group's timeout, then at most NAMING_S to name the rank (plus scheduling)
    assert GROUP_TIMEOUT_S <= result["waited"] < GROUP_TIMEOUT_S + gp.failure.NAMING_S + 1.0, result
