"""Transports as units: the in-process mailbox, backend policies, and the distributed transport
over an in-memory network that enforces gloo's rule (a receive takes a message of its size)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_core import wire
from gpipe_core.channel import Posted
from gpipe_core.failure import PipelineFailure
from gpipe_core.transport import (
    DistributedTransport,
    GlooPolicy,
    LocalTransport,
    Mailbox,
    P2PPolicy,
    StepMismatch,
    policy_for,
)

CPU = torch.device("cpu")


# -- LocalTransport --------------------------------------------------------------------------


def local_pair() -> tuple[LocalTransport, LocalTransport]:
    mailbox: Mailbox = {}
    return LocalTransport(0, [CPU, CPU], mailbox), LocalTransport(1, [CPU, CPU], mailbox)


def test_local_messages_and_the_carried_value() -> None:
    first, second = local_pair()
    for transport in (first, second):
        transport.begin_step(0, 2, backward=True)
    first.send_activation(0, (torch.ones(2), "x"))
    out, note = second.recv_activation(0)
    assert torch.equal(out, torch.ones(2)) and note == "x"
    second.send_gradient(0, [torch.ones(2)])
    first.recv_gradient(0)
    assert math.isnan(first.carried())
    second.send_gradient(1, [None], carry=1.25)
    assert first.recv_gradient(1) == [None] and first.carried() == 1.25
    first.begin_step(1, 2, backward=True)
    assert math.isnan(first.carried())


def test_local_errors_name_the_message() -> None:
    first, second = local_pair()
    first.send_activation(0, torch.ones(1))
    with pytest.raises(RuntimeError, match="sent twice"):
        first.send_activation(0, torch.ones(1))
    with pytest.raises(RuntimeError, match="never sent"):
        second.recv_activation(1)
    with pytest.raises(NotImplementedError, match="micro-batch count"):
        second.recv_step(0)


# -- policies --------------------------------------------------------------------------------


def test_policy_per_backend() -> None:
    gloo, nccl = policy_for("gloo"), policy_for("nccl")
    assert isinstance(gloo, GlooPolicy) and gloo.tags and gloo.post_early
    assert type(nccl) is P2PPolicy and not nccl.tags and not nccl.post_early
    calls: list[tuple[int, int]] = []

    def op(tensor: Tensor, rank: int, *, tag: int) -> str:
        calls.append((rank, tag))
        return "work"

    assert nccl.call(op, torch.ones(1), 3, 5) == "work"
    gloo.quiet_io = None  # the I/O thread may preempt: a plain call
    gloo.call(op, torch.ones(1), 3, 5)
    assert calls == [(3, 0), (3, 5)]  # NCCL ignores tags


# -- DistributedTransport over an in-memory network -------------------------------------------


class _Work:
    def __init__(self, done: bool = True, match: Any = None) -> None:
        self.done, self.match = done, match

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.match()
        if not self.done:
            raise RuntimeError("timed out: no message (the single-threaded test would hang)")
        return True


class Network:
    """Messages between ranks, matched in order per (source, destination, tag)."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int, int], list[Tensor]] = {}
        self.posted: dict[tuple[int, int, int], list[tuple[Tensor, _Work]]] = {}
        self.sizes: list[int] = []  # of every message sent, in order

    def policy(self, rank: int, *, post_early: bool = True) -> P2PPolicy:
        network = self

        class InMemory(P2PPolicy):
            tags = True

            def call(self, op: Any, tensor: Tensor, peer: int, tag: int) -> Any:
                if op is dist.isend:
                    return network.send(tensor, rank, peer, tag)
                return network.recv(tensor, peer, rank, tag)

        policy = InMemory()
        policy.post_early = post_early
        return policy

    def send(self, tensor: Tensor, src: int, dst: int, tag: int) -> _Work:
        self.sizes.append(tensor.numel())
        self.sent.setdefault((src, dst, tag), []).append(tensor.clone())
        self._match((src, dst, tag))
        return _Work()

    def recv(self, buffer: Tensor, src: int, dst: int, tag: int) -> _Work:
        key = (src, dst, tag)
        work = _Work(done=False, match=lambda: self._match(key))
        self.posted.setdefault(key, []).append((buffer, work))
        self._match(key)
        return work

    def _match(self, key: tuple[int, int, int]) -> None:
        sent, posted = self.sent.get(key, []), self.posted.get(key, [])
        while sent and posted:
            message, (buffer, work) = sent.pop(0), posted.pop(0)
            if message.numel() != buffer.numel():
                raise RuntimeError(f"size mismatch: {message.numel()} sent, {buffer.numel()} "
                                   "posted")
            buffer.copy_(message)
            work.done = True


def pair(network: Network, *, post_early: bool = True) -> list[DistributedTransport]:
    return [DistributedTransport(stage, [0, 1], CPU, policy=network.policy(stage,
                                 post_early=post_early)) for stage in (0, 1)]


@pytest.mark.parametrize("post_early", [True, False])
def test_a_step_with_new_shapes_resizes_and_carries_the_loss(post_early: bool) -> None:
    network = Network()
    first, second = pair(network, post_early=post_early)
    for step, lengths in enumerate([(5, 5, 3), (5, 8, 8)]):
        first.begin_step(step, 3, backward=True)
        sent = [(torch.randn(2, n, requires_grad=True), torch.ones(2, dtype=torch.bool))
                for n in lengths]
        for mb, activation in enumerate(sent):
            first.send_activation(mb, activation)
        assert second.recv_step(step) == 3
        second.begin_step(step, 3, backward=True)
        for mb, activation in enumerate(sent):
            x, mask = second.recv_activation(mb)
            assert torch.equal(x, activation[0]) and x.requires_grad and mask.all()
            carry = 0.5 + step if mb == 2 else math.nan
            second.send_gradient(mb, [torch.full_like(x, mb), None], carry=carry)
        second.finish()
        for mb in range(3):
            grad, none = first.recv_gradient(mb)
            assert none is None and (grad == mb).all()
        assert first.carried() == 0.5 + step
        first.finish()
    assert not any(network.sent.values()) and not any(network.posted.values())


def test_a_message_of_another_step_is_a_step_mismatch() -> None:
    network = Network()
    first, second = pair(network)
    first.begin_step(0, 1, backward=False)
    first.send_activation(0, torch.ones(1))
    with pytest.raises(StepMismatch, match="step 1 but stage 0 sent a message of step 0"):
        second.recv_step(1)


def test_a_truncated_message_is_a_wire_error() -> None:
    network = Network()
    _, second = pair(network)
    network.send(torch.zeros(wire.PREFIX_BYTES - 8, dtype=torch.uint8), 0, 1, 1)
    with pytest.raises(RuntimeError, match="size mismatch"):  # gloo: sizes must agree
        second.recv_step(0)
    network.sent.clear()
    network.posted.clear()
    message, _ = wire.pack(torch.ones(3), step=0, num_microbatches=1, device=CPU)
    damaged = message.clone()
    damaged[8:16] = 0x7F  # kind
    second._recv_links[0].predicted = message.numel()
    network.send(damaged, 0, 1, 1)
    with pytest.raises(wire.WireError, match="unknown message kind"):
        second.recv_step(0)


def test_sends_that_have_left_are_released_before_the_step_ends() -> None:
    # Otherwise a stage would hold every message of a step (M activations) until finish().
    network = Network()
    first, _ = pair(network)
    first.begin_step(0, 4, backward=False)
    channel = first.channels[1]
    for mb in range(4):
        first.send_activation(mb, torch.ones(1000))
        assert len(channel._sends) == 1  # the earlier sends completed: only the newest is held
    in_flight = _Work(done=False, match=lambda: None)
    channel._sends.append(Posted(in_flight, torch.ones(1), 1))
    first.send_activation(4, torch.ones(1000))
    assert [sent.work for sent in channel._sends][0] is in_flight  # still in flight: kept
    assert len(channel._sends) == 2


def test_a_neighbour_that_does_not_answer_is_a_pipeline_failure_naming_both_ends() -> None:
    network = Network()
    first, second = pair(network)
    second.begin_step(2, 1, backward=False)  # the third training step
    with pytest.raises(PipelineFailure, match=(
            r"^rank 1 \(stage 1\) in step 3, waiting for peer rank 0 \(stage 0\), stops: timed "
            r"out: no message .*\(no answer within 60 s or connection closed; that rank failed "
            r"or hangs\)$")):
        second.recv_activation(0)
    first.begin_step(-2, 1, backward=True)  # the second evaluation
    first.send_activation(0, torch.ones(1))
    with pytest.raises(PipelineFailure, match=r"^rank 0 \(stage 0\) in evaluation 2, waiting "
                                              r"for peer rank 1 \(stage 1\), stops"):
        first.recv_gradient(0)


def test_peer_error_is_a_deprecated_name_of_pipeline_failure() -> None:
    from gpipe_core import transport

    with pytest.warns(DeprecationWarning, match="PipelineFailure"):
        assert transport.PeerError is PipelineFailure


def test_quiet_io_is_a_constructor_switch(tmp_path: Path) -> None:
    import torch.distributed as dist

    import gpipe_core as gp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        def build(**kwargs: bool) -> gp.DistributedGPipe:
            return gp.DistributedGPipe(nn.Sequential(nn.Linear(2, 2)), [1], chunks=1,
                                       loss_fn=lambda out, target: out.sum(), **kwargs)

        assert build().transport.policy.quiet_io is not None  # the library's default
        assert build(quiet_io=False).transport.policy.quiet_io is None  # plain gloo
    finally:
        dist.destroy_process_group()
