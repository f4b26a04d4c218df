"""``gp.Channel`` (``pipe.channel()``): tagged messages between stages outside steps, matched by
tag, not confused with a step's messages, and a silent peer named within the timeout."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import gpipe_core as gp
from tests.distributed.launch import spawn
from tests.distributed.test_pipeline import build, loss_fn, make_batch

pytestmark = pytest.mark.distributed


def exchange_then_stay_silent(rank: int, world: int) -> Any:
    pipe = gp.DistributedGPipe(build(), [4, 4], chunks=2, loss_fn=loss_fn, timeout_s=60)
    channel = pipe.channel("a test exchange")  # the pipe's timeout: ranks start unevenly
    channel.refresh()
    other = 1 - pipe.stage_index
    # two messages sent in one order, received in the other: tags keep them apart
    channel.send(torch.full((3,), float(rank)), other, tag=5)
    channel.send(torch.arange(4, dtype=torch.long) + 10 * rank, other, tag=9)
    posted = channel.post(torch.empty(4, dtype=torch.long), other, tag=9)
    first = channel.recv(torch.empty(3), other, tag=5)
    second = channel.wait(posted)
    channel.finish()
    (x, mask), y = make_batch(0)  # a step after the channel's messages: nothing was taken
    loss = float(pipe.step((x, mask) if pipe.is_first else None, y if pipe.is_last else None))
    if rank == 1:  # alive, but sends nothing more
        time.sleep(8)
        return first.tolist(), second.tolist(), loss, "silent"
    start = time.monotonic()
    try:
        pipe.channel("a test exchange", timeout_s=2).recv(torch.empty(2), other, tag=1)
        failure = "no error"
    except gp.PipelineFailure as error:
        failure = f"{time.monotonic() - start:.0f} s: {error}"
    return first.tolist(), second.tolist(), loss, failure


def test_channel_messages_by_tag_and_a_silent_peer_named(tmp_path: Path) -> None:
    zero, one = spawn(exchange_then_stay_silent, 2, tmp_path, timeout_s=120)
    assert zero[:2] == ([1.0] * 3, [10, 11, 12, 13])
    assert one[:2] == ([0.0] * 3, [0, 1, 2, 3])
    assert zero[2] == one[2]
    assert one[3] == "silent"
    seconds, message = zero[3].split(" s: ", 1)
    assert int(seconds) < 8, zero[3]
    assert message.startswith("rank 0 (stage 0) in a test exchange, waiting for peer rank 1 "
                              "(stage 1), stops: "), message
    assert message.endswith("(no answer within 2 s or connection closed; that rank failed or "
                            "hangs)"), message
