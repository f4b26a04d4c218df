"""Moving activations forward and gradients backward between neighbouring stages.

A transport belongs to one stage. It sends that stage's outputs to the next stage and its input
gradients to the previous one, and receives the converse. Activations are nested
tuples/lists/dicts of tensors (non-tensor values ride along); gradients are flat lists with one
tensor or None per tensor leaf. Shapes and dtypes may change from one micro-batch to the next.

- :class:`LocalTransport`: stages in one process; a message is a dictionary entry, moved to the
  receiving stage's device.
- :class:`DistributedTransport`: one stage per process, point-to-point ``torch.distributed``
  messages (gloo on CPU, NCCL on GPU).

Wire format (:mod:`gpipe_core.wire`): one distributed message per transfer, a byte buffer on
the stage's device holding a prefix (size, step, micro-batches in the step, a carried value),
the tensors' dtypes and shapes, the payload's nesting when it changed, and the tensors' bytes.

A receive must be posted with the message's exact size, which both sides predict the same way:
the size of the previous message on the same channel. When a message's size differs from that
prediction (the first message, a new sequence length, an uneven last micro-batch), the sender
first sends a RESIZE message of the predicted size that announces the new one. With gloo
(:class:`GlooPolicy`) the receiver posts the next receive as soon as the current one arrives,
so a message lands in a
waiting buffer and every transfer is a single message: no header round trip per micro-batch.
Posting early matters: gloo writes a message's data only once the receiver's receive is
posted; a send that comes first is parked, and the sender's I/O thread must wake again (on a
core busy with the sender's compute) to write it when the receive is announced.
NCCL ignores tags and matches messages in order, so there receives are posted when needed.

Virtual stages: a rank may run several stages, each with its own transport. Each boundary
between stage s and s+1 has its own tag (gloo), so messages of two boundaries between the same
two ranks cannot be confused; a boundary inside one rank (the turn of a V-shaped placement)
passes messages through an in-process mailbox (``local``) instead.

The per-step protocol is part of the interface and driven by the runtime
(:class:`~gpipe_core.runtime.StageRuntime`): :meth:`Transport.recv_step` (a stage after the
first learns the step's micro-batch count from its first activation: the step number and count
ride in every prefix, which spares a header message per step), :meth:`Transport.begin_step`,
the messages, then :meth:`Transport.finish`. The step's last gradient message carries a value
back (``carry``; the step's loss), which thus reaches every stage without a collective.

Sends are asynchronous (``isend``) and complete by :meth:`Transport.finish`; receives wait at
most ``timeout_s`` seconds, so a dead or stuck neighbour turns into an error, never a hang.
"""


from __future__ import annotations

import datetime
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import wire
from .cpu import QuietIOThreads
from .microbatch import map_tensors

__all__ = [
    "Transport", "LocalTransport", "Mailbox", "DistributedTransport", "P2PPolicy", "GlooPolicy",
    "policy_for", "PeerError", "StepMismatch",
]

Grads = list[Tensor | None]


class Transport(ABC):
    """One stage's view of its neighbours, step by step.

    Per step, the runtime calls :meth:`recv_step` (stages after the first, when the step's
    micro-batch count is not known yet), :meth:`begin_step`, the sends and receives of the
    schedule, and :meth:`finish`. The step's last :meth:`send_gradient` may ``carry`` one
    float back to the previous stage, where :meth:`carried` returns it.
    """

    def recv_step(self, step: int) -> int:
        """Wait for the previous stage's first activation of ``step``; return the step's
        micro-batch count. The activation is kept for the step's first :meth:`recv_activation`.
        """
        raise NotImplementedError(f"{type(self).__name__} needs the step's micro-batch count")

    def begin_step(self, step: int, num_microbatches: int, *, backward: bool) -> None:  # noqa: B027
        """Start ``step`` of ``num_microbatches`` (gradients flow back if ``backward``)."""

    @abstractmethod
    def send_activation(self, mb: int, payload: Any) -> None:
        """Send this stage's output for micro-batch ``mb`` to the next stage."""

    @abstractmethod
    def recv_activation(self, mb: int) -> Any:
        """Receive the previous stage's output for micro-batch ``mb``."""

    @abstractmethod
    def send_gradient(self, mb: int, grads: Grads, *, carry: float = math.nan) -> None:
        """Send gradients of this stage's inputs for ``mb`` to the previous stage, with
        ``carry`` riding along (NaN: nothing)."""

    @abstractmethod
    def recv_gradient(self, mb: int) -> Grads:
        """Receive gradients of this stage's outputs for ``mb`` from the next stage."""

    @abstractmethod
    def carried(self) -> float:
        """The value carried by a gradient received this step (NaN until one arrived)."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Wait until every message this stage sent has left (end of a step)."""


Mailbox = dict[tuple[str, int, int], Any]


class LocalTransport(Transport):
    """Stages in one process exchange messages through a shared mailbox."""

    def __init__(self, stage_index: int, devices: Sequence[torch.device], mailbox: Mailbox) -> None:
        self.stage_index = stage_index
        self.devices = list(devices)
        self.mailbox = mailbox
        self._carried = math.nan

    def _put(self, key: tuple[str, int, int], value: Any, device: torch.device) -> None:
        if key in self.mailbox:
            raise RuntimeError(f"message {key} sent twice without being received")
        self.mailbox[key] = map_tensors(
            value, lambda t: t if t.device == device else t.to(device, non_blocking=True)
        )

    def _take(self, key: tuple[str, int, int]) -> Any:
        try:
            return self.mailbox.pop(key)
        except KeyError:
            raise RuntimeError(
                f"stage {self.stage_index} waits for message {key} that was never sent; the "
                "schedule runs an action before its dependency"
            ) from None

    def begin_step(self, step: int, num_microbatches: int, *, backward: bool) -> None:
        self._carried = math.nan

    def send_activation(self, mb: int, payload: Any) -> None:
        next_stage = self.stage_index + 1
        self._put(("F", next_stage, mb), payload, self.devices[next_stage])

    def recv_activation(self, mb: int) -> Any:
        return self._take(("F", self.stage_index, mb))

    def send_gradient(self, mb: int, grads: Grads, *, carry: float = math.nan) -> None:
        prev_stage = self.stage_index - 1
        self._put(("B", prev_stage, mb), grads, self.devices[prev_stage])
        if not math.isnan(carry):
            self.mailbox[("C", prev_stage, mb)] = carry

    def recv_gradient(self, mb: int) -> Grads:
        grads = self._take(("B", self.stage_index, mb))
        carry = self.mailbox.pop(("C", self.stage_index, mb), None)
        if carry is not None:
            self._carried = carry
        return grads  # type: ignore[no-any-return]

    def carried(self) -> float:
        return self._carried


class PeerError(RuntimeError):
    """A neighbouring stage stopped answering or closed its connection."""

    def __init__(self, peer_rank: int, peer_stage: int, detail: str) -> None:
        who = f"peer rank {peer_rank} (stage {peer_stage})" if peer_rank >= 0 else "a peer rank"
        super().__init__(f"{who}: {detail}")
        self.peer_rank = peer_rank
        self.peer_stage = peer_stage


class StepMismatch(RuntimeError):
    """A neighbour sent a message of another step: the ranks' calls went out of step."""


class P2PPolicy:
    """How point-to-point messages behave on a backend; this base is NCCL's.

    NCCL ignores tags and matches messages in order, so a receive is posted when it is needed.
    """

    tags = False  # whether messages are matched by tag
    post_early = False  # post a channel's next receive as soon as the current one arrives

    def refresh(self) -> None:
        """Called at the start of every step (the process's threads may have changed)."""

    def call(self, op: Callable[..., Any], tensor: Tensor, rank: int, tag: int) -> Any:
        """Run ``dist.isend`` or ``dist.irecv``."""
        return op(tensor, rank, tag=0)


class GlooPolicy(P2PPolicy):
    """gloo: tagged messages, receives posted early, and an I/O thread kept quiet in our calls.

    gloo's I/O thread must not preempt our sends and posts (see
    :class:`~gpipe_core.cpu.QuietIOThreads`); ``quiet_io = None`` lets it.
    """

    tags = True
    post_early = True

    def __init__(self, quiet_io: bool = True) -> None:
        self.quiet_io: QuietIOThreads | None = QuietIOThreads() if quiet_io else None
        if self.quiet_io is not None:
            self.quiet_io.refresh()

    def refresh(self) -> None:
        if self.quiet_io is not None:
            self.quiet_io.refresh()

    def call(self, op: Callable[..., Any], tensor: Tensor, rank: int, tag: int) -> Any:
        quiet = self.quiet_io
        if quiet is None:
            return op(tensor, rank, tag=tag)
        quiet.enter()
        try:
            return op(tensor, rank, tag=tag)
        finally:
            quiet.leave()


def policy_for(backend: str, *, quiet_io: bool = True) -> P2PPolicy:
    """The policy of a ``torch.distributed`` backend: gloo's (``quiet_io``: keep its I/O thread
    from preempting our calls), or in-order matching (NCCL)."""
    return GlooPolicy(quiet_io) if backend == "gloo" else P2PPolicy()


# Tags (gloo): control messages (tied weights); activations and gradients across the boundary
# between stage s and s+1 use _TAG_DATA + s.
_TAG_CONTROL, _TAG_DATA = 0, 1


class _Channel:
    """Messages with one neighbour in one direction: the size both sides expect next."""

    def __init__(self) -> None:
        self.predicted = wire.PREFIX_BYTES
        self.skeleton: Any = None  # last skeleton sent (bytes) or received (parsed)
        self.posted: tuple[Any, Tensor] | None = None  # a receive already waiting (post_early)
        self.remaining = 0  # messages still to receive this step


class DistributedTransport(Transport):
    """Point-to-point messages with the neighbouring stages' processes.

    Every message carries its step number and the step's micro-batch count, so a stage learns
    both from its first activation (:meth:`recv_step`) instead of a header message of its own.
    ``policy``: the backend's :class:`P2PPolicy` (default: that of the default group).
    ``stage_ranks[s]``: the rank running stage s; a neighbour on this process's own rank
    exchanges messages through ``local`` (one mailbox shared by the rank's transports).
    """

    def __init__(
        self,
        stage_index: int,
        stage_ranks: Sequence[int],
        device: torch.device,
        *,
        policy: P2PPolicy | None = None,
        timeout_s: float = 60.0,
        local: dict[tuple[int, int], list[tuple[Any, float]]] | None = None,
    ) -> None:
        self.stage_index = stage_index
        self.stage_ranks = list(stage_ranks)
        self.local = local if local is not None else {}
        self.device = device
        self.policy = policy if policy is not None else policy_for(dist.get_backend())
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pending: list[Any] = []  # (work, buffer, stage) of sends in flight
        self._send_channels: dict[int, _Channel] = {}
        self._recv_channels: dict[int, _Channel] = {}
        self._step = 0
        self._num_microbatches = 0
        self._first_activation: tuple[Any] | None = None  # read by recv_step, not yet taken
        self._carried = math.nan

    # -- the step --------------------------------------------------------------------------

    def recv_step(self, step: int) -> int:
        """Also :class:`StepMismatch` if the previous stage is at another step."""
        stage = self.stage_index - 1
        channel = self._recv_channels.setdefault(stage, _Channel())
        channel.remaining = 1  # the step's size is not known yet: take one message only
        payload, header = self._recv_message(stage, step)
        self._first_activation = (payload,)
        return header.num_microbatches

    def begin_step(self, step: int, num_microbatches: int, *, backward: bool) -> None:
        """Every message of the step carries both numbers. Counts the messages to expect from
        each neighbour and, with ``policy.post_early``, posts the first receive of each."""
        self._step, self._num_microbatches = step, num_microbatches
        self._carried = math.nan
        self.policy.refresh()
        last = len(self.stage_ranks) - 1
        first_taken = self._first_activation is not None
        expected = {self.stage_index - 1: num_microbatches - int(first_taken)}
        if backward:
            expected[self.stage_index + 1] = num_microbatches
        for stage, count in expected.items():
            if not 0 <= stage <= last or self._is_local(stage):
                continue
            channel = self._recv_channels.setdefault(stage, _Channel())
            channel.remaining = count
            if self.policy.post_early and count > 0 and channel.posted is None:
                channel.posted = self._post_recv(stage, channel.predicted)

    def send_activation(self, mb: int, payload: Any) -> None:
        self._send(self.stage_index + 1, payload, math.nan)

    def recv_activation(self, mb: int) -> Any:
        if self._first_activation is not None:
            (payload,), self._first_activation = self._first_activation, None
            return payload
        return self._recv(self.stage_index - 1)

    def send_gradient(self, mb: int, grads: Grads, *, carry: float = math.nan) -> None:
        self._send(self.stage_index - 1, grads, carry)

    def recv_gradient(self, mb: int) -> Grads:
        return self._recv(self.stage_index + 1)  # type: ignore[no-any-return]

    def carried(self) -> float:
        return self._carried

    def _is_local(self, stage: int) -> bool:
        return self.stage_ranks[stage] == self.stage_ranks[self.stage_index]

    def _tag(self, stage: int) -> int:
        """The tag of the boundary between this stage and its neighbour ``stage``."""
        return _TAG_DATA + min(stage, self.stage_index)

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for work, _buffer, stage in pending:
            self._wait_sent(work, stage)

    def _wait_sent(self, work: Any, stage: int) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            rank = self.stage_ranks[stage]
            raise PeerError(rank, stage, f"send did not complete ({exc})") from exc

    def _release_sent(self) -> None:
        """Free the buffers of sends that have left (a step would otherwise hold every message
        it sent until :meth:`finish`: M activations or gradients on a stage); a failed one
        raises here as it would there."""
        still = []
        for work, buffer, stage in self._pending:
            if work.is_completed():
                self._wait_sent(work, stage)
            else:
                still.append((work, buffer, stage))
        self._pending = still

    # -- control messages outside steps ----------------------------------------------------

    def send_tensor(self, tensor: Tensor, stage: int) -> None:
        """Send one tensor of known shape to ``stage`` (tied weights); :meth:`finish` waits."""
        self._isend(tensor.contiguous(), stage, _TAG_CONTROL)

    def recv_tensor(self, out: Tensor, stage: int) -> Tensor:
        """Receive into ``out`` a tensor that ``stage`` sent with :meth:`send_tensor`."""
        rank = self.stage_ranks[stage]
        try:
            work = self.policy.call(dist.irecv, out, rank, _TAG_CONTROL)
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(rank, stage, f"receive failed ({exc})") from exc
        return out

    # -- messages --------------------------------------------------------------------------

    def _isend(self, tensor: Tensor, stage: int, tag: int) -> None:
        rank = self.stage_ranks[stage]
        try:
            work = self.policy.call(dist.isend, tensor, rank, tag)
        except RuntimeError as exc:
            raise PeerError(rank, stage, f"send failed ({exc})") from exc
        self._release_sent()
        self._pending.append((work, tensor, stage))  # keep the buffer alive until it has left

    def _post_recv(self, stage: int, nbytes: int) -> tuple[Any, Tensor]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        rank = self.stage_ranks[stage]
        try:
            work = self.policy.call(dist.irecv, buffer, rank, self._tag(stage))
        except RuntimeError as exc:
            raise PeerError(rank, stage, f"receive failed ({exc})") from exc
        return work, buffer

    def _wait(self, posted: tuple[Any, Tensor], stage: int) -> Tensor:
        work, buffer = posted
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            rank = self.stage_ranks[stage]
            raise PeerError(rank, stage, f"receive failed ({exc})") from exc
        return buffer

    def _send(self, stage: int, payload: Any, carry: float) -> None:
        if self._is_local(stage):  # the neighbour runs on this rank: no message
            self.local.setdefault((self.stage_index, stage), []).append((payload, carry))
            return
        channel = self._send_channels.setdefault(stage, _Channel())
        buffer, channel.skeleton = wire.pack(
            payload, step=self._step, num_microbatches=self._num_microbatches,
            device=self.device, carry=carry, previous_skeleton=channel.skeleton,
        )
        size = buffer.numel()
        if size != channel.predicted:  # announce the new size in a message of the old one
            self._isend(wire.pack_resize(channel.predicted, size, step=self._step,
                                         num_microbatches=self._num_microbatches,
                                         device=self.device), stage, self._tag(stage))
            channel.predicted = size
        self._isend(buffer, stage, self._tag(stage))

    def _recv(self, stage: int) -> Any:
        if self._is_local(stage):
            queue = self.local.get((stage, self.stage_index))
            if not queue:
                raise RuntimeError(
                    f"stage {self.stage_index} waits for a message from stage {stage} on the "
                    "same rank that was not sent yet; the schedule runs an action before its "
                    "dependency"
                )
            payload, carry = queue.pop(0)
            if not math.isnan(carry):
                self._carried = carry
            return payload
        payload, header = self._recv_message(stage, self._step)
        if not math.isnan(header.carry):
            self._carried = header.carry
        return payload

    def _recv_message(self, stage: int, expect_step: int) -> tuple[Any, wire.Header]:
        """The next message of ``expect_step`` from ``stage``: its payload and header."""
        channel = self._recv_channels.setdefault(stage, _Channel())
        posted, channel.posted = channel.posted, None
        if posted is None:
            posted = self._post_recv(stage, channel.predicted)
        buffer = self._wait(posted, stage)
        header = wire.read_header(buffer)
        if header.kind == wire.RESIZE:
            channel.predicted = header.total_bytes
            buffer = self._wait(self._post_recv(stage, channel.predicted), stage)
            header = wire.read_header(buffer)
            if header.kind != wire.DATA:
                raise wire.WireError(f"stage {stage} sent two RESIZE messages in a row")
        if header.step != expect_step:
            raise StepMismatch(
                f"stage {self.stage_index} is at step {expect_step} but stage {stage} sent a "
                f"message of step {header.step}; every rank must call step() and evaluate() "
                "the same number of times, in the same order"
            )
        channel.remaining -= 1
        if self.policy.post_early and channel.remaining > 0:
            channel.posted = self._post_recv(stage, channel.predicted)  # the next finds it waiting
        payload, channel.skeleton = wire.unpack(buffer, header, channel.skeleton)
        return payload, header
