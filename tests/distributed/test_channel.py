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


def sends_held_by_the_first_stage(rank: int, world: int) -> Any:
    """Per schedule, after each gradient rank 0 receives: (micro-batch, the sends to stage 1
    its channel still holds, the activation messages of micro-batches after every one whose
    gradient came back)."""
    from gpipe_core.transport import DistributedTransport

    seen: list[tuple[int, int, int]] = []
    sent: dict[int, int] = {}
    send, receive = DistributedTransport.send_activation, DistributedTransport.recv_gradient

    def send_activation(self: DistributedTransport, mb: int, payload: Any) -> None:
        before = len(self.channels[1]._sends)
        send(self, mb, payload)
        sent[mb] = len(self.channels[1]._sends) - before  # this one, with a resize
        # (a send the backend already reports done is freed here and counts -1: none on gloo)

    def recv_gradient(self: DistributedTransport, mb: int) -> Any:
        grads = receive(self, mb)
        answered = max([mb] + [m for m, _, _ in seen])  # this gradient or an earlier one
        later = sum(count for m, count in sent.items() if m > answered)
        seen.append((mb, len(self.channels[1]._sends), later))
        return grads

    DistributedTransport.send_activation = send_activation  # type: ignore[method-assign]
    DistributedTransport.recv_gradient = recv_gradient  # type: ignore[method-assign]
    result = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        pipe = gp.DistributedGPipe(build(), [4, 4], chunks=4, loss_fn=loss_fn,
                                   schedule=schedule)
        (x, mask), y = make_batch(0)
        seen.clear()
        sent.clear()
        pipe.step((x, mask) if pipe.is_first else None, y if pipe.is_last else None)
        result[schedule] = list(seen)
    return result


def test_a_sent_activation_is_freed_once_its_gradient_comes_back(tmp_path: Path) -> None:
    """The first stage frees an activation's send buffer when the gradient of its micro-batch
    (or of a later one) comes back, not at the step's end: gloo reports a send done only to a
    wait, so under fill-drain the first rank held every activation of the step through its
    backward (the AmoebaNet default's whole-batch boundary, 2.6 MiB of 15.8, at M=8)."""
    zero, _ = spawn(sends_held_by_the_first_stage, 2, tmp_path, timeout_s=120)
    for schedule, seen in zero.items():
        assert sorted(mb for mb, _, _ in seen) == [0, 1, 2, 3], (schedule, seen)
        assert all(held == later for _, held, later in seen), (schedule, seen)
    assert zero["gpipe"][0] == (3, 0, 0)  # fill-drain: the last micro-batch's answers all
    assert zero["1f1b"][0][2] > 0  # 1F1B: later activations stay until theirs come back
