"""Process groups: a group's timeout is read back from torch, never guessed."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gpipe_core as gp
from gpipe_core.groups import _backend_timeout_s


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=42))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_group_timeout_is_the_bound_each_group_was_made_with(world_of_one: None) -> None:
    # Reads torch's private ProcessGroup._get_backend(device).options._timeout: if a torch
    # moves it, this fails with the error group_timeout_s raises, not with 1800 s.
    small = dist.new_group([0], timeout=datetime.timedelta(seconds=7))
    assert gp.group_timeout_s() == 42.0
    assert gp.group_timeout_s(small) == 7.0
    assert gp.DistributedGPipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], chunks=1,
                               loss_fn=lambda out, target: out.sum(), group=small
                               ).timeout_s == 7.0


def test_an_unreadable_timeout_is_an_error_that_names_the_fix() -> None:
    class Moved:  # a process group of a torch whose backend options lost ``_timeout``
        def _get_backend(self, device: torch.device) -> object:
            return type("Backend", (), {"options": object()})()

    with pytest.raises(RuntimeError, match=r"cannot read the timeout of a 'gloo' .*timeout_s="):
        _backend_timeout_s(Moved(), torch.device("cpu"), "gloo")
