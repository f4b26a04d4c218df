"""Moving activations forward and gradients backward between neighbouring stages.

A transport belongs to one stage. It sends that stage's outputs to the next stage and its input
gradients to the previous one, and receives the converse. Activations are nested
tuples/lists/dicts of tensors (non-tensor values ride along); gradients are flat lists with one
tensor or None per tensor leaf. Shapes and dtypes may change from one micro-batch to the next.

- :class:`LocalTransport`: stages in one process; a message is a dictionary entry, moved to the
  receiving stage's device.
- :class:`DistributedTransport`: one stage per process, point-to-point ``torch.distributed``
  messages (gloo on CPU, NCCL on GPU).

Wire format of one distributed message (all on the stage's device)::

    header  int64[HEADER_SIZE]: [skeleton_bytes, num_tensors, num_microbatches,
                                 (dtype, requires_grad, ndim, *shape) per tensor ...]
    skeleton  uint8[skeleton_bytes]  pickled nesting and non-tensor leaves; sent only when it
                                     differs from the previous message on this channel
    tensors   one message per tensor leaf, in order

Sends are asynchronous (``isend``) and complete by :meth:`Transport.finish`; receives wait at
most ``timeout_s`` seconds, so a dead or stuck neighbour turns into an error, never a hang.

With gloo, headers, skeletons and tensors travel under different tags, and a stage posts the
receives of all its headers for a step as soon as it knows the number of micro-batches: a
neighbour's header then lands in a waiting buffer instead of waiting for a handshake, and only
the tensors (whose shapes the header gives) cost one. NCCL ignores tags and matches messages in
order, so there every receive is posted when it is needed.
"""

from __future__ import annotations

import datetime
import pickle
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .microbatch import flatten, map_tensors, unflatten

__all__ = ["Transport", "LocalTransport", "Mailbox", "DistributedTransport", "PeerError"]

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


HEADER_SIZE = 256
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_TENSOR = "__tensor__"  # stands for a tensor leaf in the pickled skeleton
# Tags (gloo): step headers and tied weights, message headers, skeletons, tensors.
_TAG_CONTROL, _TAG_HEADER, _TAG_SKELETON, _TAG_TENSOR = 0, 1, 2, 3


class DistributedTransport(Transport):
    """Point-to-point messages with the neighbouring stages' processes."""

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
        self._sent_skeleton: dict[int, bytes] = {}
        self._recv_skeleton: dict[int, Any] = {}
        self._posted_headers: dict[int, deque[tuple[Any, Tensor]]] = {}
        self.use_tags = dist.get_backend() == "gloo"

    # -- public ----------------------------------------------------------------------------

    def send_activation(self, mb: int, payload: Any) -> None:
        self._send(self.stage_index + 1, payload)

    def recv_activation(self, mb: int) -> Any:
        return self._recv(self.stage_index - 1)

    def send_gradient(self, mb: int, grads: list[Tensor | None]) -> None:
        self._send(self.stage_index - 1, grads)

    def recv_gradient(self, mb: int) -> list[Tensor | None]:
        return self._recv(self.stage_index + 1)

    def send_step_header(self, num_microbatches: int, step: int) -> None:
        """Tell the next stage how many micro-batches this step has (it cannot see the input)."""
        header = torch.tensor([num_microbatches, step], dtype=torch.int64, device=self.device)
        self._isend(header, self.stage_index + 1, _TAG_CONTROL)

    def recv_step_header(self) -> tuple[int, int]:
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        self._irecv_wait([header], self.stage_index - 1, _TAG_CONTROL)
        num_microbatches, step = header.tolist()
        return int(num_microbatches), int(step)

    def post_header_receives(self, num_microbatches: int, *, backward: bool = True) -> None:
        """Post this step's header receives from the neighbours at once (gloo only).

        Activations come from the previous stage; gradients, when ``backward``, from the next.
        """
        if not self.use_tags:
            return
        neighbours = [self.stage_index - 1] + ([self.stage_index + 1] if backward else [])
        for stage in neighbours:
            if 0 <= stage < len(self.stage_ranks):
                queue = self._posted_headers.setdefault(stage, deque())
                for _ in range(num_microbatches):
                    buffer = torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)
                    work = dist.irecv(buffer, src=self.stage_ranks[stage], tag=_TAG_HEADER)
                    queue.append((work, buffer))

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

    def _isend(self, tensor: Tensor, stage: int, tag: int) -> None:
        rank = self.stage_ranks[stage]
        try:
            work = dist.isend(tensor, dst=rank, tag=tag if self.use_tags else 0)
        except RuntimeError as exc:
            raise PeerError(rank, stage, f"send failed ({exc})") from exc
        self._pending.append((work, tensor, stage))  # keep the buffer alive until it has left

    def _irecv_wait(self, buffers: list[Tensor], stage: int, tag: int) -> None:
        rank = self.stage_ranks[stage]
        tag = tag if self.use_tags else 0
        try:
            works = [dist.irecv(b, src=rank, tag=tag) for b in buffers]
            for work in works:
                assert work is not None
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(rank, stage, f"receive failed ({exc})") from exc

    def _recv_header(self, stage: int) -> Tensor:
        queue = self._posted_headers.get(stage)
        if not queue:
            header = torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)
            self._irecv_wait([header], stage, _TAG_HEADER)
            return header
        work, header = queue.popleft()
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(self.stage_ranks[stage], stage, f"receive failed ({exc})") from exc
        return header

    def _send(self, stage: int, payload: Any) -> None:
        leaves, spec = flatten(payload)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        skeleton = pickle.dumps((spec, [_TENSOR if isinstance(x, Tensor) else x for x in leaves]))
        send_skeleton = self._sent_skeleton.get(stage) != skeleton
        header = [len(skeleton) if send_skeleton else 0, len(tensors), 0]
        for tensor in tensors:
            if tensor.dtype not in _DTYPE_CODE:
                raise TypeError(f"cannot send a tensor of dtype {tensor.dtype} between stages")
            header += [_DTYPE_CODE[tensor.dtype], int(tensor.requires_grad), tensor.dim()]
            header += list(tensor.shape)
        if len(header) > HEADER_SIZE:
            raise ValueError(
                f"a message of {len(tensors)} tensors needs a {len(header)}-slot header, more "
                f"than {HEADER_SIZE}; pass fewer or lower-dimensional tensors between stages"
            )
        header += [0] * (HEADER_SIZE - len(header))
        self._isend(torch.tensor(header, dtype=torch.int64, device=self.device), stage, _TAG_HEADER)
        if send_skeleton:
            self._sent_skeleton[stage] = skeleton
            data = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8).to(self.device)
            self._isend(data, stage, _TAG_SKELETON)
        for tensor in tensors:
            self._isend(tensor.detach().to(self.device).contiguous(), stage, _TAG_TENSOR)

    def _recv(self, stage: int) -> Any:
        header = self._recv_header(stage).tolist()
        skeleton_bytes, num_tensors = int(header[0]), int(header[1])
        if skeleton_bytes:
            data = torch.empty(skeleton_bytes, dtype=torch.uint8, device=self.device)
            self._irecv_wait([data], stage, _TAG_SKELETON)
            self._recv_skeleton[stage] = pickle.loads(data.cpu().numpy().tobytes())
        spec, kinds = self._recv_skeleton[stage]
        buffers: list[Tensor] = []
        flags: list[bool] = []
        pos = 3
        for _ in range(num_tensors):
            dtype, requires_grad, ndim = header[pos], header[pos + 1], header[pos + 2]
            shape = header[pos + 3 : pos + 3 + ndim]
            pos += 3 + ndim
            buffers.append(torch.empty(shape, dtype=_DTYPES[dtype], device=self.device))
            flags.append(bool(requires_grad))
        if buffers:
            self._irecv_wait(buffers, stage, _TAG_TENSOR)
        tensors = iter(
            b.requires_grad_(True) if flag else b for b, flag in zip(buffers, flags, strict=True)
        )
        leaves = [next(tensors) if kind == _TENSOR else kind for kind in kinds]
        return unflatten(leaves, spec)
