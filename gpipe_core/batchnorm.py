"""BatchNorm over micro-batches with running statistics of the whole mini-batch (GPipe's rule).

In training each micro-batch is normalized with its own statistics, as the paper defines; the
running mean and variance are updated once per mini-batch with the statistics of all its
micro-batches together, so they equal what the plain module accumulates on the whole mini-batch.
The micro-batches' statistics are the normalization's own, pooled exactly at commit
(count, mean, M2).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredBatchNorm", "frozen_running_stats"]

# Micro-batches' statistics a DeferredBatchNorm keeps before it pools them without a commit (a
# module used outside a pipeline, where no stage commits): its memory stays bounded.
_MOST_PENDING = 64


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm (1d/2d/3d alike) that defers running-statistics updates to :meth:`commit`."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, True, device=device, dtype=dtype)
        self.recomputing = False  # set by frozen_running_stats: a forward run again adds nothing
        # this mini-batch's micro-batches so far: each one's mean and inverse standard deviation
        # per channel (as the normalization computed them) and its values per channel
        self._pending: list[tuple[Tensor, Tensor, int]] = []

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects input of dim >= 2, got {input.dim()}D")

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        if self.recomputing:  # a forward run again: the statistics were counted the first time
            return F.batch_norm(input, None, None, self.weight, self.bias, training=True,
                                momentum=0.0, eps=self.eps)
        # Normalize by this micro-batch's statistics without touching the running ones, and
        # take the statistics the normalization computed: the op F.batch_norm runs (the same
        # kernel, autograd and autocast behaviour on every device), which also returns the
        # batch's mean and inverse standard deviation (a second pass over the input for them
        # had made a deferred BatchNorm's forward 1.7x a plain one's on CPU).
        output, mean, invstd, _, _ = torch._batch_norm_impl_index(
            input, self.weight, self.bias, None, None, True, 0.0, self.eps,
            torch.backends.cudnn.enabled)
        # kept as they are until commit, which folds them all at once (per micro-batch folding
        # cost a dozen tiny operations per call: 40 us, 4% of an AmoebaNet step of 92 of them)
        self._pending.append((mean.detach(), invstd.detach(), input.numel() // input.size(1)))
        if len(self._pending) > _MOST_PENDING:  # never committed (outside a pipeline): bounded
            mean, var, n = self._pooled()
            self._pending = [(mean, (var + self.eps).rsqrt(), n)]
        return output

    def _pooled(self) -> tuple[Tensor, Tensor, int]:
        """The pending micro-batches' statistics as one batch's: its mean, biased variance and
        values per channel (each one's M2 plus its count times its mean's squared distance from
        the whole mean: exact, no sum of squares)."""
        pending = self._pending
        dtype = self.running_mean.dtype if self.running_mean is not None else torch.float32
        means = torch.stack([mean for mean, _, _ in pending]).to(dtype)
        invstd = torch.stack([inv for _, inv, _ in pending]).to(dtype)
        variances = (invstd.reciprocal().square() - self.eps).clamp_min(0.0)
        counts = torch.tensor([[float(c)] for _, _, c in pending], dtype=dtype,
                              device=means.device)
        n = sum(c for _, _, c in pending)
        mean = (counts * means).sum(0) / n
        m2 = (counts * variances).sum(0) + (counts * (means - mean).square()).sum(0)
        return mean, m2 / n, n

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the mini-batch's statistics (its micro-batches' pooled, :meth:`_pooled`) into
        the running ones, then reset."""
        if not self._pending:
            return
        mean, var, n = self._pooled()
        self._pending = []
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked += 1
        if self.momentum is None:  # cumulative moving average, as nn.BatchNorm does
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        unbiased_var = var * n / max(n - 1, 1)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var, alpha=factor)

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Return ``module`` with every ``nn.BatchNorm{1,2,3}d`` replaced by DeferredBatchNorm.

        Parameters and running statistics are carried over; modules that do not track running
        statistics are left alone (they have nothing to defer).
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            if not module.track_running_stats:
                return module
            weight = module.weight
            new = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                device=module.running_mean.device if module.running_mean is not None else None,
                dtype=module.running_mean.dtype if module.running_mean is not None else None,
            )
            if module.affine:
                assert weight is not None and module.bias is not None
                new.weight = weight
                new.bias = module.bias
            new.running_mean = module.running_mean
            new.running_var = module.running_var
            new.num_batches_tracked = module.num_batches_tracked
            new.train(module.training)
            return new
        for name, child in module.named_children():
            converted = cls.convert(child)
            if converted is not child:
                setattr(module, name, converted)
        return module


@contextmanager
def frozen_running_stats(batchnorms: Sequence[_BatchNorm]) -> Iterator[None]:
    """Run a forward again (re-materialization) without updating running statistics twice.

    The recomputed forward normalizes exactly as the first one did (with its micro-batch's own
    statistics), so only the bookkeeping has to be switched off, which costs nothing:
    ``DeferredBatchNorm`` skips accumulating, and a standard ``nn.BatchNorm*d`` in training mode
    runs with ``track_running_stats`` off (batch statistics, no update). A subclass with its own
    ``forward`` (``SyncBatchNorm``, third-party ones) cannot be switched reliably; its buffers are
    copied before and written back after, which the caller's backward may still read, so the
    context must enclose the backward too.
    """
    switched: list[_BatchNorm] = []
    snapshots = []
    try:
        for bn in batchnorms:
            if isinstance(bn, DeferredBatchNorm):
                bn.recomputing = True
                switched.append(bn)
            elif not bn.training or not bn.track_running_stats:
                continue  # nothing updates running statistics
            elif type(bn).forward is _BatchNorm.forward:
                bn.track_running_stats = False
                switched.append(bn)
            else:
                snapshots.append((bn, {name: buf.clone()
                                       for name, buf in bn.named_buffers(recurse=False)}))
        yield
    finally:
        for bn in switched:
            if isinstance(bn, DeferredBatchNorm):
                bn.recomputing = False
            else:
                bn.track_running_stats = True
        with torch.no_grad():
            for bn, buffers in snapshots:
                for name, value in buffers.items():
                    getattr(bn, name).copy_(value)
