"""Moving activations forward and gradients backward between neighbouring stages.

A transport belongs to one stage. It sends that stage's outputs to the next stage and its input
gradients to the previous one, and receives the converse. Activations are nested
tuples/lists/dicts of tensors (non-tensor values ride along); gradients are flat lists with one
tensor or None per tensor leaf. Shapes and dtypes may change from one micro-batch to the next.

- :class:`LocalTransport`: stages in one process; a message is a dictionary entry, moved to the
  receiving stage's device.
- :class:`DistributedTransport`: one stage per process, point-to-point ``torch.distributed``
  messages (gloo on CPU, NCCL on GPU) over one :class:`~gpipe_core.channel.Channel` per
  neighbour: this module frames the messages, the channel moves them.

Wire format (:mod:`gpipe_core.wire`): one distributed message per transfer, a byte buffer on
the stage's device holding a prefix (size, step, micro-batches in the step, a carried value),
the tensors' dtypes and shapes, the payload's nesting when it changed, and the tensors' bytes.

A receive must be posted with the message's exact size, which both sides predict the same way:
the size of the previous message on the same link (one neighbour, one direction). When a message's size differs from that
prediction (the first message, a new sequence length, an uneven last micro-batch), the sender
first sends a RESIZE message of the predicted size that announces the new one. With gloo
(:class:`~gpipe_core.channel.GlooPolicy`) the receiver posts the next receive as soon as the
current one arrives, so a message lands in a waiting buffer and every transfer is a single
message: no header round trip per micro-batch.
Posting early matters: gloo writes a message's data only once the receiver's receive is
posted; a send that comes first is parked, and the sender's I/O thread must wake again (on a
core busy with the sender's compute) to write it when the receive is announced.
NCCL ignores tags and matches messages in order, so there receives are posted when needed.

Virtual stages: a rank may run several stages, each with its own transport. Each boundary
between stage s and s+1 has its own tag (gloo: ``TAG_BOUNDARY + s``, see
:mod:`gpipe_core.channel`), so messages of two boundaries between the same two ranks cannot be
confused; a boundary inside one rank (the turn of a V-shaped placement) passes messages
through an in-process mailbox (``local``) instead.

The per-step protocol is part of the interface and driven by the runtime
(:class:`~gpipe_core.runtime.StageRuntime`): :meth:`Transport.recv_step` (a stage after the
first learns the step's micro-batch count from its first activation: the step number and count
ride in every prefix, which spares a header message per step), :meth:`Transport.begin_step`,
the messages, then :meth:`Transport.finish`. The step's last gradient message carries a value
back (``carry``; the step's loss), which thus reaches every stage without a collective.

Sends are asynchronous (``isend``) and complete by :meth:`Transport.finish`; receives wait at
most ``timeout_s`` seconds, so a dead or stuck neighbour turns into a
:class:`~gpipe_core.failure.PipelineFailure` naming this rank and stage, the step, the peer's rank
and stage and the timeout (the channel's), never a hang.
"""


from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import wire
from .channel import TAG_BOUNDARY, Channel, GlooPolicy, P2PPolicy, Posted, policy_for
from .failure import PipelineFailure
from .microbatch import map_tensors

__all__ = [
    "Transport", "LocalTransport", "Mailbox", "DistributedTransport", "StepMismatch",
    # the backend policies live with the Channel; named here too, where they were before
    "P2PPolicy", "GlooPolicy", "policy_for",
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


class StepMismatch(RuntimeError):
    """A neighbour sent a message of another step: the ranks' calls went out of step."""


def __getattr__(name: str) -> Any:
    if name == "PeerError":  # before issue 41 a failed message raised it; now every one raises
        warnings.warn("gpipe_core.transport.PeerError is deprecated: a neighbour that fails "
                      "raises gpipe_core.PipelineFailure (naming rank, stage, peer and "
                      "timeout); catch that", DeprecationWarning, stacklevel=2)
        return PipelineFailure
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Link:
    """Messages with one neighbour in one direction: the size both sides expect next."""

    def __init__(self) -> None:
        self.predicted = wire.PREFIX_BYTES
        self.skeleton: Any = None  # last skeleton sent (bytes) or received (parsed)
        self.posted: Posted | None = None  # a receive already waiting (post_early)
        self.remaining = 0  # messages still to receive this step


def _step_name(step: int) -> str:
    """A step as errors name it: training steps count 0, 1, ... and evaluations -1, -2, ...
    (:class:`~gpipe_core.DistributedGPipe`'s numbering)."""
    return f"step {step + 1}" if step >= 0 else f"evaluation {-step}"


class DistributedTransport(Transport):
    """Point-to-point messages with the neighbouring stages' processes.

    Every message carries its step number and the step's micro-batch count, so a stage learns
    both from its first activation (:meth:`recv_step`) instead of a header message of its own.
    This class frames the messages (:mod:`gpipe_core.wire`, sizes, steps); one
    :class:`~gpipe_core.channel.Channel` per neighbour moves them (the backend's policy, the
    bound on every wait, buffers kept alive until sent, failures that name the peer).
    ``policy``: the backend's :class:`~gpipe_core.channel.P2PPolicy` (default: that of the
    default group). ``stage_ranks[s]``: the rank running stage s; a neighbour on this process's
    own rank exchanges messages through ``local`` (one mailbox shared by the rank's transports).
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
        self.timeout_s = timeout_s
        # one Channel per neighbour on another rank, on the pipeline's own tags (tag_base 0)
        self.channels = {
            stage: Channel(stage_index, self.stage_ranks, policy=self.policy,
                           timeout_s=timeout_s, what=_step_name(0), tag_base=0)
            for stage in (stage_index - 1, stage_index + 1)
            if 0 <= stage < len(self.stage_ranks) and not self._is_local(stage)
        }
        self._send_links: dict[int, _Link] = {}
        self._recv_links: dict[int, _Link] = {}
        self._step = 0
        self._num_microbatches = 0
        self._first_activation: tuple[Any] | None = None  # read by recv_step, not yet taken
        self._carried = math.nan
        # the sends of each activation not yet known taken: (micro-batch, its messages)
        self._sent_activations: list[tuple[int, list[Posted]]] = []

    # -- the step --------------------------------------------------------------------------

    def recv_step(self, step: int) -> int:
        """Also :class:`StepMismatch` if the previous stage is at another step."""
        stage = self.stage_index - 1
        self._name_step(step)
        link = self._recv_link(stage)
        link.remaining = 1  # the step's size is not known yet: take one message only
        payload, header = self._recv_message(stage, step)
        self._first_activation = (payload,)
        return header.num_microbatches

    def begin_step(self, step: int, num_microbatches: int, *, backward: bool) -> None:
        """Every message of the step carries both numbers. Counts the messages to expect from
        each neighbour and, with ``policy.post_early``, posts the first receive of each."""
        self._step, self._num_microbatches = step, num_microbatches
        self._carried = math.nan
        self._name_step(step)
        self.policy.refresh()
        last = len(self.stage_ranks) - 1
        first_taken = self._first_activation is not None
        expected = {self.stage_index - 1: num_microbatches - int(first_taken)}
        if backward:
            expected[self.stage_index + 1] = num_microbatches
        for stage, count in expected.items():
            if not 0 <= stage <= last or self._is_local(stage):
                continue
            link = self._recv_link(stage)
            link.remaining = count
            if self.policy.post_early and count > 0 and link.posted is None:
                link.posted = self._post_recv(stage, link.predicted)

    def send_activation(self, mb: int, payload: Any) -> None:
        sends = self._send(self.stage_index + 1, payload, math.nan)
        if sends:
            self._sent_activations.append((mb, sends))

    def recv_activation(self, mb: int) -> Any:
        if self._first_activation is not None:
            (payload,), self._first_activation = self._first_activation, None
            return payload
        return self._recv(self.stage_index - 1)

    def send_gradient(self, mb: int, grads: Grads, *, carry: float = math.nan) -> None:
        self._send(self.stage_index - 1, grads, carry)

    def recv_gradient(self, mb: int) -> Grads:
        grads = self._recv(self.stage_index + 1)
        # The next stage ran micro-batch mb's backward after the forwards of every micro-batch
        # up to mb (each stage runs its forwards in order), so it has taken those activations:
        # their buffers go now, not at the step's end (a backend such as gloo learns of a
        # send's end only by waiting for it).
        taken = [sends for m, sends in self._sent_activations if m <= mb]
        if taken:
            self._sent_activations = [(m, s) for m, s in self._sent_activations if m > mb]
            self.channels[self.stage_index + 1].release([p for sends in taken for p in sends])
        return grads  # type: ignore[no-any-return]

    def carried(self) -> float:
        return self._carried

    def finish(self) -> None:
        self._sent_activations = []
        for channel in self.channels.values():
            channel.finish()

    def _is_local(self, stage: int) -> bool:
        return self.stage_ranks[stage] == self.stage_ranks[self.stage_index]

    def _tag(self, stage: int) -> int:
        """The tag of the boundary between this stage and its neighbour ``stage``."""
        return TAG_BOUNDARY + min(stage, self.stage_index)

    def _name_step(self, step: int) -> None:
        """Failures name the step they happen in."""
        what = _step_name(step)
        for channel in self.channels.values():
            channel.what = what

    def _recv_link(self, stage: int) -> _Link:
        link = self._recv_links.get(stage)
        if link is None:
            link = self._recv_links[stage] = _Link()
        return link

    # -- messages --------------------------------------------------------------------------

    def _post_recv(self, stage: int, nbytes: int) -> Posted:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.channels[stage].post(buffer, stage, self._tag(stage))

    def _send(self, stage: int, payload: Any, carry: float) -> list[Posted]:
        """The message's sends (none to a neighbour on this rank)."""
        if self._is_local(stage):  # the neighbour runs on this rank: no message
            self.local.setdefault((self.stage_index, stage), []).append((payload, carry))
            return []
        link = self._send_links.get(stage)
        if link is None:
            link = self._send_links[stage] = _Link()
        channel, tag = self.channels[stage], self._tag(stage)
        buffer, link.skeleton = wire.pack(
            payload, step=self._step, num_microbatches=self._num_microbatches,
            device=self.device, carry=carry, previous_skeleton=link.skeleton,
        )
        size = buffer.numel()
        sends = []
        if size != link.predicted:  # announce the new size in a message of the old one
            sends.append(channel.send(wire.pack_resize(
                link.predicted, size, step=self._step, num_microbatches=self._num_microbatches,
                device=self.device), stage, tag))
            link.predicted = size
        sends.append(channel.send(buffer, stage, tag))
        return sends

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
        link, channel = self._recv_link(stage), self.channels[stage]
        posted, link.posted = link.posted, None
        if posted is None:
            posted = self._post_recv(stage, link.predicted)
        buffer = channel.wait(posted)
        header = wire.read_header(buffer)
        if header.kind == wire.RESIZE:
            link.predicted = header.total_bytes
            buffer = channel.wait(self._post_recv(stage, link.predicted))
            header = wire.read_header(buffer)
            if header.kind != wire.DATA:
                raise wire.WireError(f"stage {stage} sent two RESIZE messages in a row")
        if header.step != expect_step:
            raise StepMismatch(
                f"stage {self.stage_index} is at step {expect_step} but stage {stage} sent a "
                f"message of step {header.step}; every rank must call step() and evaluate() "
                "the same number of times, in the same order"
            )
        link.remaining -= 1
        if self.policy.post_early and link.remaining > 0:
            link.posted = self._post_recv(stage, link.predicted)  # the next finds it waiting
        payload, link.skeleton = wire.unpack(buffer, header, link.skeleton)
        return payload, header
