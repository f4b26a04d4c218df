"""Gradients across ranks: averaging over data-parallel replicas, clipping by a global norm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .failure import collectives

__all__ = ["average_gradients", "clip_grad_norm"]


def average_gradients(params: Sequence[nn.Parameter], group: Any) -> None:
    """Average the parameters' gradients over ``group`` (one flat all-reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(
    params: Sequence[nn.Parameter],
    max_norm: float,
    norm_type: float,
    *,
    group: Any,
    device: torch.device,
    counted_elsewhere: nn.Parameter | None = None,
) -> Tensor:
    """Clip gradients by one norm over every rank of ``group``; return that total norm.

    ``counted_elsewhere``: a local parameter whose gradient another rank counts (a tied
    weight's second copy), left out of the sum of powers.
    """
    params = [p for p in params if p.grad is not None]
    if norm_type == float("inf"):
        local = max((p.grad.abs().max() for p in params), default=torch.zeros(()))  # type: ignore[union-attr]
        total = local.to(device, torch.float64)
        with collectives("clip_grad_norm_"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for p in params:
            if p is counted_elsewhere:
                continue
            local += p.grad.detach().double().norm(norm_type) ** norm_type  # type: ignore[union-attr]
        with collectives("clip_grad_norm_"):
            dist.all_reduce(local, group=group)
        total = local ** (1.0 / norm_type)
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)  # type: ignore[union-attr]
    return total
