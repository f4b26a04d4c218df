"""``gpipe_core.launch.spawn``: how a rank ends. A rank that succeeded saves its result, leaves
the process group and exits without the interpreter's teardown (where gloo's threads could
abort it); a rank that failed exits the usual way, its traceback quoted."""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import spawn

pytestmark = pytest.mark.distributed


def _mark(path: str) -> None:
    Path(path).write_text("the interpreter's teardown ran")


def run_and_register_teardown(rank: int, world: int, root: str, fail_rank: int | None) -> Any:
    atexit.register(_mark, f"{root}/teardown-{rank}")
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    print(f"rank {rank} says {int(value)}", end="")  # no newline, no flush: still printed
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank * 10


def test_a_rank_that_succeeded_exits_without_the_teardown(tmp_path: Path,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    results = spawn(run_and_register_teardown, 2, tmp_path / "run", str(marks), None,
                    timeout_s=60, pg_timeout_s=20)
    assert results == [0, 10]
    assert sorted(p.name for p in marks.iterdir()) == []  # no atexit handler ran
    out = capfd.readouterr().out
    assert "rank 0 says 1" in out and "rank 1 says 1" in out  # flushed before leaving


def test_a_rank_that_failed_exits_the_usual_way(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    results = spawn(run_and_register_teardown, 2, tmp_path / "run", str(marks), 1,
                    timeout_s=60, pg_timeout_s=20, expect_failure=True)
    (code0, error0), (code1, error1) = results
    assert (code0, error0) == (0, "")
    assert code1 == 1 and "ValueError: rank 1 fails on purpose" in error1
    assert sorted(p.name for p in marks.iterdir()) == ["teardown-1"]
