"""One weight tied across the pipeline's ends (embedding and output projection).

The first and the last stage each hold a copy of the weight. The copies start equal (the first
stage's is sent to the last) and stay equal: after each step both get the sum of the two
gradients, so an optimizer step moves them alike. The exchange goes over a
:class:`~gpipe_core.channel.Channel` between the two end stages' ranks, on the pipeline's
control tag (``TAG_CONTROL``), so a failed peer is a
:class:`~gpipe_core.failure.PipelineFailure` naming both ends and the timeout; when one rank
runs both ends (a V-shaped placement of virtual stages) the two copies are kept equal in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .channel import TAG_CONTROL, Channel, P2PPolicy

__all__ = ["TiedWeight"]


class TiedWeight:
    """This rank's copies of a tied weight (``first`` on the first stage, ``last`` on the last;
    None where the rank does not run that stage) and their exchange with the other end over
    ``channel`` (one whose ``stage`` is this rank's end; unused when the rank holds both)."""

    def __init__(self, first: nn.Parameter | None, last: nn.Parameter | None,
                 channel: Channel, *, num_stages: int) -> None:
        self.first = first
        self.last = last
        self.channel = channel
        self.last_stage = num_stages - 1

    @classmethod
    def resolve(cls, named: dict[str, nn.Parameter], tied: tuple[str, str] | None, *,
                stages: tuple[int, ...], stage_ranks: Sequence[int], policy: P2PPolicy,
                timeout_s: float) -> TiedWeight | None:
        """The tie of ``tied = (first_stage_name, last_stage_name)`` on a rank running
        ``stages`` of a pipeline whose stage s runs on rank ``stage_ranks[s]``; None when the
        rank holds no copy, or one parameter serves both ends. Its messages take the
        pipeline's ``policy`` and ``timeout_s``."""
        num_stages = len(stage_ranks)
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
        end = 0 if first is not None else num_stages - 1
        channel = Channel(end, stage_ranks, policy=policy, timeout_s=timeout_s,
                          what="the tied weight's first copy", tag_base=0)
        return cls(first, last, channel, num_stages=num_stages)

    @property
    def second_copy(self) -> nn.Parameter | None:
        """The last stage's copy: its gradient equals the first's, so a global norm counts
        the weight once, on the first stage."""
        return self.last

    def sync(self) -> None:
        """Start from the first stage's copy."""
        self.channel.what = "the tied weight's first copy"
        with torch.no_grad():
            if self.first is not None and self.last is not None:
                self.last.data.copy_(self.first.data)
            elif self.first is not None:
                self.channel.send(self.first.data.contiguous(), self.last_stage, TAG_CONTROL)
                self.channel.finish()
            else:
                assert self.last is not None
                self.channel.recv(self.last.data, 0, TAG_CONTROL)

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
        channel = self.channel
        channel.what = "the tied weight's gradient exchange"
        if self.first is not None:
            channel.send(grad.contiguous(), self.last_stage, TAG_CONTROL)
            channel.recv(other, self.last_stage, TAG_CONTROL)
        else:
            channel.recv(other, 0, TAG_CONTROL)
            channel.send(grad.contiguous(), 0, TAG_CONTROL)
        channel.finish()
        param.grad = grad + other


def _grad(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)
