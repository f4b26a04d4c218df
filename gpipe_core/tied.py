"""One weight tied across the pipeline's ends (embedding and output projection).

The first and the last stage each hold a copy of the weight. The copies start equal (the first
stage's is sent to the last) and stay equal: after each step both get the sum of the two
gradients, so an optimizer step moves them alike. The exchange uses the transport's control
messages between the two end stages.
"""

from __future__ import annotations

import torch
from torch import nn

from .transport import DistributedTransport

__all__ = ["TiedWeight"]


class TiedWeight:
    """The local copy of a tied weight on an end stage, and its exchange with the other end."""

    def __init__(self, param: nn.Parameter, transport: DistributedTransport, *,
                 stage_index: int, num_stages: int) -> None:
        self.param = param
        self.transport = transport
        self.is_first = stage_index == 0
        self.peer = num_stages - 1 if self.is_first else 0

    @staticmethod
    def resolve(named: dict[str, nn.Parameter], tied: tuple[str, str] | None, *,
                stage_index: int, num_stages: int) -> nn.Parameter | None:
        """This stage's copy of ``tied = (first_stage_name, last_stage_name)``, if it holds one."""
        if tied is None or num_stages == 1:
            return None
        first_name, last_name = tied
        name = (first_name if stage_index == 0 else last_name if stage_index == num_stages - 1
                else None)
        if name is None:
            return None
        if name not in named:
            raise ValueError(f"tied parameter {name!r} is not on stage {stage_index}")
        return named[name]

    def sync(self) -> None:
        """Start from the first stage's copy."""
        with torch.no_grad():
            if self.is_first:
                self.transport.send_tensor(self.param.data, self.peer)
                self.transport.finish()
            else:
                self.transport.recv_tensor(self.param.data, self.peer)

    def reduce_gradient(self) -> None:
        """Sum the gradients of the two copies; both copies get the sum."""
        param = self.param
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        other = torch.empty_like(grad)
        if self.is_first:
            self.transport.send_tensor(grad, self.peer)
            self.transport.recv_tensor(other, self.peer)
        else:
            self.transport.recv_tensor(other, self.peer)
            self.transport.send_tensor(grad, self.peer)
        self.transport.finish()
        param.grad = grad + other
