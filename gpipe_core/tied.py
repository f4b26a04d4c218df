"""One weight tied across the pipeline's ends (embedding and output projection).

The first and the last stage each hold a copy of the weight. The copies start equal (the first
stage's is sent to the last) and stay equal: after each step both get the sum of the two
gradients, so an optimizer step moves them alike. The exchange uses the transport's control
messages between the two end stages' ranks; when one rank runs both ends (a V-shaped placement
of virtual stages) the two copies are kept equal in place.
"""

from __future__ import annotations

import torch
from torch import nn

from .transport import DistributedTransport

__all__ = ["TiedWeight"]


class TiedWeight:
    """This rank's copies of a tied weight (``first`` on the first stage, ``last`` on the last;
    None where the rank does not run that stage) and their exchange with the other end."""

    def __init__(self, first: nn.Parameter | None, last: nn.Parameter | None,
                 transport: DistributedTransport, *, num_stages: int) -> None:
        self.first = first
        self.last = last
        self.transport = transport
        self.last_stage = num_stages - 1

    @classmethod
    def resolve(cls, named: dict[str, nn.Parameter], tied: tuple[str, str] | None,
                transport: DistributedTransport, *, stages: tuple[int, ...],
                num_stages: int) -> TiedWeight | None:
        """The tie of ``tied = (first_stage_name, last_stage_name)`` on a rank running
        ``stages``; None when the rank holds no copy, or one parameter serves both ends."""
        if tied is None or num_stages == 1:
            return None
        copies: list[nn.Parameter | None] = []
        for name, stage in zip(tied, (0, num_stages - 1), strict=True):
            if stage not in stages:
                copies.append(None)
            elif name not in named:
                raise ValueError(f"tied parameter {name!r} is not on stage {stage}")
            else:
                copies.append(named[name])
        first, last = copies
        if (first is None and last is None) or first is last:
            return None
        return cls(first, last, transport, num_stages=num_stages)

    @property
    def second_copy(self) -> nn.Parameter | None:
        """The last stage's copy: its gradient equals the first's, so a global norm counts
        the weight once, on the first stage."""
        return self.last

    def sync(self) -> None:
        """Start from the first stage's copy."""
        with torch.no_grad():
            if self.first is not None and self.last is not None:
                self.last.data.copy_(self.first.data)
            elif self.first is not None:
                self.transport.send_tensor(self.first.data, self.last_stage)
                self.transport.finish()
            else:
                assert self.last is not None
                self.transport.recv_tensor(self.last.data, 0)

    def reduce_gradient(self) -> None:
        """Sum the gradients of the two copies; both copies get the sum."""
        if self.first is not None and self.last is not None:
            total = _grad(self.first) + _grad(self.last)
            self.first.grad, self.last.grad = total, total.clone()
            return
        param = self.first if self.first is not None else self.last
        assert param is not None
        grad = _grad(param)
        other = torch.empty_like(grad)
        if self.first is not None:
            self.transport.send_tensor(grad, self.last_stage)
            self.transport.recv_tensor(other, self.last_stage)
        else:
            self.transport.recv_tensor(other, 0)
            self.transport.send_tensor(grad, 0)
        self.transport.finish()
        param.grad = grad + other


def _grad(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)
