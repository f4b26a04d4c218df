"""Moving activations forward and gradients backward between neighbouring stages.

A transport belongs to one stage. It sends that stage's outputs to the next stage and its input
gradients to the previous one, and receives the converse. Activations are nested
tuples/lists/dicts of tensors (non-tensor values ride along); gradients are flat lists with one
tensor or None per tensor leaf. Shapes and dtypes may change from one micro-batch to the next.

- :class:`LocalTransport`: stages in one process; a message is a dictionary entry, moved to the
  receiving stage's device.
- :class:`DistributedTransport`: one stage per process, point-to-point ``torch.distributed``
  messages (gloo on CPU, NCCL on GPU).

Wire format: one distributed message per transfer, a byte buffer on the stage's device::

    int64 prefix  [total_bytes, kind=DATA, num_meta_ints, skeleton_bytes, step,
                   micro-batches in the step, step loss (float64 bits, or NaN), 0]
    int64 meta    (dtype, requires_grad, ndim, *shape) per tensor leaf
    skeleton      pickled nesting and non-tensor leaves; only when it differs from the last one
    tensors       each tensor's bytes, 64-byte aligned; received tensors are views of the buffer

A receive must be posted with the message's exact size, which both sides predict the same way:
the size of the previous message on the same channel. When a message's size differs from that
prediction (the first message, a new sequence length, an uneven last micro-batch), the sender
first sends a RESIZE message of the predicted size that announces the new one. With gloo the
receiver posts the next receive as soon as the current one arrives, so a message lands in a
waiting buffer and every transfer is a single message: no header round trip per micro-batch.
Posting early matters: gloo writes a message's data only once the receiver's receive is
posted; a send that comes first is parked, and the sender's I/O thread must wake again (on a
core busy with the sender's compute) to write it when the receive is announced.
NCCL ignores tags and matches messages in order, so there receives are posted when needed.

The step number and micro-batch count in every prefix spare a header message per step: a stage
learns both from its first activation. The last gradient message of a step carries the step's
loss, which thus reaches every stage without a collective.

Sends are asynchronous (``isend``) and complete by :meth:`Transport.finish`; receives wait at
most ``timeout_s`` seconds, so a dead or stuck neighbour turns into an error, never a hang.
"""

from __future__ import annotations

import datetime
import math
import pickle
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .cpu import QuietIOThreads
from .microbatch import flatten, map_tensors, unflatten

__all__ = [
    "Transport", "LocalTransport", "Mailbox", "DistributedTransport", "PeerError", "StepMismatch",
]

Grads = list[Tensor | None]


class Transport(ABC):
    """One stage's view of its neighbours."""

    @abstractmethod
    def send_activation(self, mb: int, payload: Any) -> None:
        """Send this stage's output for micro-batch ``mb`` to the next stage."""

    @abstractmethod
    def recv_activation(self, mb: int) -> Any:
        """Receive the previous stage's output for micro-batch ``mb``."""

    @abstractmethod
    def send_gradient(self, mb: int, grads: Grads) -> None:
        """Send gradients of this stage's inputs for ``mb`` to the previous stage."""

    @abstractmethod
    def recv_gradient(self, mb: int) -> Grads:
        """Receive gradients of this stage's outputs for ``mb`` from the next stage."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Wait until every message this stage sent has left (end of a step)."""


Mailbox = dict[tuple[str, int, int], Any]


class LocalTransport(Transport):
    """Stages in one process exchange messages through a shared mailbox."""

    def __init__(self, stage_index: int, devices: Sequence[torch.device], mailbox: Mailbox) -> None:
        self.stage_index = stage_index
        self.devices = list(devices)
        self.mailbox = mailbox

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

    def send_activation(self, mb: int, payload: Any) -> None:
        next_stage = self.stage_index + 1
        self._put(("F", next_stage, mb), payload, self.devices[next_stage])

    def recv_activation(self, mb: int) -> Any:
        return self._take(("F", self.stage_index, mb))

    def send_gradient(self, mb: int, grads: Grads) -> None:
        prev_stage = self.stage_index - 1
        self._put(("B", prev_stage, mb), grads, self.devices[prev_stage])

    def recv_gradient(self, mb: int) -> Grads:
        return self._take(("B", self.stage_index, mb))


class PeerError(RuntimeError):
    """A neighbouring stage stopped answering or closed its connection."""

    def __init__(self, peer_rank: int, peer_stage: int, detail: str) -> None:
        who = f"peer rank {peer_rank} (stage {peer_stage})" if peer_rank >= 0 else "a peer rank"
        super().__init__(f"{who}: {detail}")
        self.peer_rank = peer_rank
        self.peer_stage = peer_stage


_ALIGN = 64  # cache line: received tensors are views of the buffer at these offsets
# Prefix, eight int64: total bytes, kind, meta ints, skeleton bytes, step, micro-batches in the
# step, the step's loss (float64 bits; on a step's last gradient message), reserved.
_PREFIX = struct.Struct("<8q")
_PREFIX_BYTES = _PREFIX.size
_KIND_DATA, _KIND_RESIZE = 0, 1
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_TENSOR = "__tensor__"  # stands for a tensor leaf in the pickled skeleton
# Tags (gloo): tied weights; activations and gradients.
_TAG_CONTROL, _TAG_DATA = 0, 1


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class _Channel:
    """Messages with one neighbour in one direction: the size both sides expect next."""

    def __init__(self) -> None:
        self.predicted = _PREFIX_BYTES
        self.skeleton: Any = None  # last skeleton sent (bytes) or received (parsed)
        self.posted: tuple[Any, Tensor] | None = None  # a receive already waiting (gloo)
        self.remaining = 0  # messages still to receive (or to send) this step


class StepMismatch(RuntimeError):
    """A neighbour sent a message of another step: the ranks' calls went out of step."""


class DistributedTransport(Transport):
    """Point-to-point messages with the neighbouring stages' processes.

    Every message carries its step number and the step's micro-batch count, so a stage learns
    both from its first activation (:meth:`recv_step`) instead of a header message of its own;
    the step's last gradient message carries the step's loss back towards the first stage
    (:attr:`loss_source` on the last stage, :attr:`received_loss` elsewhere).
    """

    def __init__(
        self,
        stage_index: int,
        stage_ranks: Sequence[int],
        device: torch.device,
        *,
        group: Any = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.stage_index = stage_index
        self.stage_ranks = list(stage_ranks)
        self.device = device
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pending: list[Any] = []  # (work, buffers) of sends in flight
        self._send_channels: dict[int, _Channel] = {}
        self._recv_channels: dict[int, _Channel] = {}
        self.use_tags = dist.get_backend() == "gloo"
        # gloo's I/O thread must not preempt our sends and posts (see gpipe_core.cpu).
        self.quiet_io = QuietIOThreads() if self.use_tags else None
        if self.quiet_io is not None:
            self.quiet_io.refresh()
        self.step = 0
        self.num_microbatches = 0
        self._first_activation: tuple[Any] | None = None  # read by recv_step, not yet taken
        self.loss_source: Callable[[], float] | None = None  # the last stage's step loss
        self.received_loss = math.nan  # the step loss from the last gradient message

    # -- public ----------------------------------------------------------------------------

    def send_activation(self, mb: int, payload: Any) -> None:
        self._send(self.stage_index + 1, payload)

    def recv_activation(self, mb: int) -> Any:
        if self._first_activation is not None:
            (payload,), self._first_activation = self._first_activation, None
            return payload
        return self._recv(self.stage_index - 1)

    def send_gradient(self, mb: int, grads: list[Tensor | None]) -> None:
        self._send(self.stage_index - 1, grads)

    def recv_gradient(self, mb: int) -> list[Tensor | None]:
        return self._recv(self.stage_index + 1)

    def recv_step(self, step: int) -> int:
        """Wait for the previous stage's first activation of ``step``; return the step's
        micro-batch count (:class:`StepMismatch` if the neighbour is at another step).

        The activation itself is kept for the step's first :meth:`recv_activation`.
        """
        stage = self.stage_index - 1
        channel = self._recv_channels.setdefault(stage, _Channel())
        channel.remaining = 1  # the step's size is not known yet: take one message only
        payload, num_microbatches, _ = self._recv_message(stage, step)
        self._first_activation = (payload,)
        return num_microbatches

    def begin_step(self, step: int, num_microbatches: int, *, backward: bool) -> None:
        """Start ``step`` of ``num_microbatches`` (with gradients flowing back if ``backward``).

        Every message of the step carries both numbers. Counts the messages to expect from
        each neighbour and, with gloo, posts the first receive of each channel.
        """
        self.step, self.num_microbatches = step, num_microbatches
        self.received_loss = math.nan
        if self.quiet_io is not None:
            self.quiet_io.refresh()
        last = len(self.stage_ranks) - 1
        first_taken = self._first_activation is not None
        expected = {self.stage_index - 1: num_microbatches - int(first_taken)}
        if backward:
            expected[self.stage_index + 1] = num_microbatches
        for stage, count in expected.items():
            if not 0 <= stage <= last:
                continue
            channel = self._recv_channels.setdefault(stage, _Channel())
            channel.remaining = count
            if self.use_tags and count > 0 and channel.posted is None:
                channel.posted = self._post_recv(stage, channel.predicted)
        for stage in (self.stage_index - 1, self.stage_index + 1):
            if 0 <= stage <= last and (backward or stage > self.stage_index):
                self._send_channels.setdefault(stage, _Channel()).remaining = num_microbatches

    def send_tensor(self, tensor: Tensor, stage: int) -> None:
        """Send one tensor of known shape to ``stage`` (used for tied-parameter gradients)."""
        self._isend(tensor.contiguous(), stage, _TAG_CONTROL)

    def recv_tensor(self, out: Tensor, stage: int) -> Tensor:
        self._irecv_wait([out], stage, _TAG_CONTROL)
        return out

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for work, _buffer, stage in pending:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                rank = self.stage_ranks[stage]
                raise PeerError(rank, stage, f"send did not complete ({exc})") from exc

    # -- wire format -----------------------------------------------------------------------

    def _p2p(self, op: Callable[..., Any], tensor: Tensor, rank: int, tag: int) -> Any:
        """``dist.isend`` or ``dist.irecv``, with gloo's I/O thread kept from preempting it."""
        tag = tag if self.use_tags else 0  # NCCL ignores tags
        quiet = self.quiet_io
        if quiet is None:
            return op(tensor, rank, tag=tag)
        quiet.enter()
        try:
            return op(tensor, rank, tag=tag)
        finally:
            quiet.leave()

    def _isend(self, tensor: Tensor, stage: int, tag: int) -> None:
        rank = self.stage_ranks[stage]
        try:
            work = self._p2p(dist.isend, tensor, rank, tag)
        except RuntimeError as exc:
            raise PeerError(rank, stage, f"send failed ({exc})") from exc
        self._pending.append((work, tensor, stage))  # keep the buffer alive until it has left

    def _irecv_wait(self, buffers: list[Tensor], stage: int, tag: int) -> None:
        rank = self.stage_ranks[stage]
        try:
            works = [self._p2p(dist.irecv, b, rank, tag) for b in buffers]
            for work in works:
                assert work is not None
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(rank, stage, f"receive failed ({exc})") from exc

    def _post_recv(self, stage: int, nbytes: int) -> tuple[Any, Tensor]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        rank = self.stage_ranks[stage]
        try:
            work = self._p2p(dist.irecv, buffer, rank, _TAG_DATA)
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

    def _send(self, stage: int, payload: Any) -> None:
        channel = self._send_channels.setdefault(stage, _Channel())
        channel.remaining -= 1
        loss = math.nan
        if stage < self.stage_index and channel.remaining == 0:  # the step's last gradient
            loss = self.loss_source() if self.loss_source is not None else self.received_loss
        leaves, spec = flatten(payload)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        skeleton = pickle.dumps((spec, [_TENSOR if isinstance(x, Tensor) else x for x in leaves]))
        if skeleton == channel.skeleton:  # sent only when it changed
            skeleton = b""
        else:
            channel.skeleton = skeleton
        meta: list[int] = []
        for tensor in tensors:
            if tensor.dtype not in _DTYPE_CODE:
                raise TypeError(f"cannot send a tensor of dtype {tensor.dtype} between stages")
            meta += [_DTYPE_CODE[tensor.dtype], int(tensor.requires_grad), tensor.dim()]
            meta += tensor.shape
        offset = _aligned(_PREFIX_BYTES + 8 * len(meta) + len(skeleton))
        offsets = []
        for tensor in tensors:
            offsets.append(offset)
            offset = _aligned(offset + tensor.numel() * tensor.element_size())
        total = offset
        if total != channel.predicted:  # announce the new size in a message of the old one
            resize = torch.zeros(channel.predicted, dtype=torch.uint8, device=self.device)
            resize[:_PREFIX_BYTES].copy_(_as_bytes(_PREFIX.pack(
                total, _KIND_RESIZE, 0, 0, self.step, self.num_microbatches, 0, 0)))
            self._isend(resize, stage, _TAG_DATA)
            channel.predicted = total
        packed = torch.empty(total, dtype=torch.uint8, device=self.device)
        head = _PREFIX.pack(total, _KIND_DATA, len(meta), len(skeleton), self.step,
                            self.num_microbatches, _float_bits(loss), 0)
        head += struct.pack(f"<{len(meta)}q", *meta) + skeleton
        packed[: len(head)].copy_(_as_bytes(head))
        for tensor, start in zip(tensors, offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            packed[start : start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(
                tensor.detach()
            )
        self._isend(packed, stage, _TAG_DATA)

    def _recv(self, stage: int) -> Any:
        payload, _, loss = self._recv_message(stage, self.step)
        if not math.isnan(loss):
            self.received_loss = loss
        return payload

    def _recv_message(self, stage: int, expect_step: int) -> tuple[Any, int, float]:
        """The next message of ``expect_step`` from ``stage``: ``(payload, micro-batches, loss
        or nan)``."""
        channel = self._recv_channels.setdefault(stage, _Channel())
        posted, channel.posted = channel.posted, None
        if posted is None:
            posted = self._post_recv(stage, channel.predicted)
        buffer = self._wait(posted, stage)
        header = _PREFIX.unpack_from(_host(buffer, _PREFIX_BYTES))
        if header[1] == _KIND_RESIZE:
            channel.predicted = header[0]
            buffer = self._wait(self._post_recv(stage, channel.predicted), stage)
            header = _PREFIX.unpack_from(_host(buffer, _PREFIX_BYTES))
        _, _, num_meta, skeleton_len, step, num_microbatches, loss_bits, _ = header
        if step != expect_step:
            raise StepMismatch(
                f"stage {self.stage_index} is at step {expect_step} but stage {stage} sent a "
                f"message of step {step}; every rank must call step() and evaluate() the same "
                "number of times, in the same order"
            )
        channel.remaining -= 1
        if self.use_tags and channel.remaining > 0:
            channel.posted = self._post_recv(stage, channel.predicted)  # the next finds it waiting
        meta_end = _PREFIX_BYTES + 8 * num_meta
        host = _host(buffer, meta_end + skeleton_len)
        meta = struct.unpack_from(f"<{num_meta}q", host, _PREFIX_BYTES)
        if skeleton_len:
            channel.skeleton = pickle.loads(host[meta_end : meta_end + skeleton_len])
        spec, kinds = channel.skeleton
        offset = _aligned(meta_end + skeleton_len)
        tensors: list[Tensor] = []
        pos = 0
        while pos < num_meta:
            dtype, requires_grad, ndim = meta[pos], meta[pos + 1], meta[pos + 2]
            shape = meta[pos + 3 : pos + 3 + ndim]
            pos += 3 + ndim
            dtype_ = _DTYPES[dtype]
            nbytes = _numel(shape) * dtype_.itemsize
            tensor = buffer[offset : offset + nbytes].view(dtype_).view(shape).detach()
            tensors.append(tensor.requires_grad_(True) if requires_grad else tensor)
            offset = _aligned(offset + nbytes)
        values = iter(tensors)
        leaves = [next(values) if kind_ == _TENSOR else kind_ for kind_ in kinds]
        return unflatten(leaves, spec), num_microbatches, _bits_float(loss_bits)


def _host(buffer: Tensor, nbytes: int) -> Any:
    """The first ``nbytes`` of a uint8 buffer as host memory that ``struct`` can read."""
    if buffer.device.type == "cpu":
        return buffer.numpy()  # shares the buffer's memory, no copy
    return buffer[:nbytes].cpu().numpy()


def _as_bytes(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
