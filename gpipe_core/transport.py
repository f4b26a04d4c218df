"""Moving activations forward and gradients backward between neighbouring stages.

A transport belongs to one stage. It sends that stage's outputs to the next stage and its input
gradients to the previous one, and receives the converse. Activations are nested
tuples/lists/dicts of tensors (non-tensor values ride along); gradients are flat lists with one
tensor or None per tensor leaf. Shapes and dtypes may change from one micro-batch to the next.

- :class:`LocalTransport`: stages in one process; a message is a dictionary entry, moved to the
  receiving stage's device.
- :class:`DistributedTransport` (in ``gpipe_core.p2p``): one stage per process, point-to-point
  ``torch.distributed`` messages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .microbatch import map_tensors

__all__ = ["Transport", "LocalTransport", "Mailbox"]

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
        self.mailbox[key] = map_tensors(value, lambda t: t.to(device, non_blocking=True))

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
