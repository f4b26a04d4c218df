"""Micro-batch BatchNorm: running statistics equal the plain module's over the whole mini-batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe_core as gp


def bn_net(kind: str, momentum: float | None) -> tuple[nn.Sequential, tuple[int, ...]]:
    """A network whose single BatchNorm sees the same input with and without micro-batches.

    (Downstream of a first BatchNorm, activations differ by design: GPipe normalizes each
    micro-batch with its own statistics.)
    """
    if kind == "1d":
        layers = [nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=momentum), nn.Tanh(), nn.Linear(4, 2)]
        shape: tuple[int, ...] = (3,)
    elif kind == "1d_seq":
        layers = [nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4, momentum=momentum), nn.Flatten(),
                  nn.Linear(4 * 5, 2)]
        shape = (3, 7)
    elif kind == "2d":
        layers = [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
                  nn.Flatten(), nn.Linear(4 * 5 * 5, 2)]
        shape = (3, 5, 5)
    else:
        layers = [nn.Conv3d(3, 4, 1), nn.BatchNorm3d(4, momentum=momentum), nn.Flatten(),
                  nn.Linear(4 * 8, 2)]
        shape = (3, 2, 2, 2)
    return nn.Sequential(*layers).double(), shape


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("kind", ["1d", "1d_seq", "2d", "3d"])
@pytest.mark.parametrize(("balance_index", "chunks"), [(0, 4), (1, 3), (2, 5)])
def test_running_stats_match_whole_minibatch(
    kind: str, momentum: float | None, balance_index: int, chunks: int, checkpoint: str
) -> None:
    ref, shape = bn_net(kind, momentum)
    n = len(ref)
    balance = [[n], [1, n - 1], [2, n - 2]][balance_index]
    pipe = gp.GPipe(
        copy.deepcopy(ref), balance, chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True
    )
    for _ in range(3):  # several steps: momentum and the cumulative average both compound
        x = torch.randn(10, *shape, dtype=torch.float64)
        ref(x).sum().backward()
        pipe(x).sum().backward()
    ref_buffers = dict(ref.named_buffers())
    assert ref_buffers
    for name, buffer in pipe.named_buffers():
        if name in ref_buffers:
            torch.testing.assert_close(buffer, ref_buffers[name], rtol=0, atol=1e-10, msg=name)
    ref.eval()
    pipe.eval()
    x = torch.randn(6, *shape, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), ref(x), rtol=0, atol=1e-10)


def test_actual_number_of_microbatches_is_used() -> None:
    # 3 samples with chunks=8 run as 3 micro-batches; statistics still cover all 3 samples.
    ref = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4)).double()
    pipe = gp.GPipe(copy.deepcopy(ref), [1, 1], chunks=8, deferred_batch_norm=True)
    x = torch.randn(3, 2, 2, 2, dtype=torch.float64)
    ref(x)
    pipe(x)
    torch.testing.assert_close(pipe[1].running_var, ref[1].running_var, rtol=0, atol=1e-12)
    assert int(pipe[1].num_batches_tracked) == 1


def test_training_normalizes_per_microbatch() -> None:
    bn = nn.BatchNorm1d(3).double()
    pipe = gp.GPipe(nn.Sequential(copy.deepcopy(bn)), [1], chunks=2, deferred_batch_norm=True)
    x = torch.randn(8, 3, dtype=torch.float64)
    expected = torch.cat([bn(x[:4]), bn(x[4:])])
    torch.testing.assert_close(pipe(x), expected, rtol=0, atol=1e-12)


def test_recomputation_does_not_update_plain_batchnorm_twice() -> None:
    # Without deferred BatchNorm each micro-batch updates the statistics once, exactly as running
    # the plain module on each micro-batch in turn; recomputation must not add a second update.
    ref = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    pipe = gp.GPipe(copy.deepcopy(ref), [1, 1], chunks=2, checkpoint="always")
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe(x).sum().backward()
    ref(x[:4])
    ref(x[4:])
    torch.testing.assert_close(pipe[1].running_mean, ref[1].running_mean, rtol=0, atol=1e-12)
    assert int(pipe[1].num_batches_tracked) == 2


class _OwnForwardBatchNorm(nn.BatchNorm1d):
    """A subclass with its own forward: recomputation falls back to restoring its buffers."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 1.0


@pytest.mark.parametrize("kind", ["plain", "own_forward", "deferred", "eval"])
def test_recomputation_leaves_every_kind_of_batchnorm_as_the_plain_module_does(kind: str) -> None:
    bn = _OwnForwardBatchNorm(4) if kind == "own_forward" else nn.BatchNorm1d(4)
    ref = nn.Sequential(nn.Linear(4, 4), bn, nn.Linear(4, 2)).double()
    ref[1].running_mean.uniform_(-1, 1)
    if kind == "eval":
        ref[1].eval()  # a frozen BatchNorm inside a model in training
    deferred = kind == "deferred"
    pipe = gp.GPipe(copy.deepcopy(ref), [2, 1], chunks=2, checkpoint="always",
                    deferred_batch_norm=deferred)
    if kind == "eval":
        pipe[1].eval()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe(x).sum().backward()
    if deferred:
        ref(x)
        expected_batches = 1
    else:
        expected = torch.cat([ref(x[:4]), ref(x[4:])])
        expected.sum().backward()
        expected_batches = 0 if kind == "eval" else 2
        for (name, p), q in zip(ref.named_parameters(), pipe.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(pipe[1], name), getattr(ref[1], name), rtol=0,
                                   atol=1e-12)
    assert int(pipe[1].num_batches_tracked) == expected_batches
    # The switches are back where they were.
    assert pipe[1].track_running_stats
    assert not getattr(pipe[1], "recomputing", False)


def test_float32_statistics_far_from_zero_match_the_plain_module() -> None:
    """The micro-batch statistics are the ones the normalization itself computes (its mean and
    inverse standard deviation): the variance recovered from them keeps float32 accuracy where
    the data sit far from zero with a small spread (mean 50, std 0.05: a sum of squares would
    cancel to nothing)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.BatchNorm1d(6, momentum=None), nn.Linear(6, 2))  # running = batch
    pipe = gp.GPipe(copy.deepcopy(ref), [1, 1], chunks=4, deferred_batch_norm=True)
    x = 50.0 + 0.05 * torch.randn(32, 6)
    ref(x).sum().backward()
    pipe(x).sum().backward()
    buffers = dict(pipe.named_buffers())
    torch.testing.assert_close(buffers["0.running_mean"], ref[0].running_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(buffers["0.running_var"], ref[0].running_var, rtol=1e-4, atol=0)


def test_a_module_never_committed_keeps_bounded_state_and_exact_statistics() -> None:
    """Used outside a pipeline (no stage commits), the statistics it keeps stay bounded (pooled
    every 64 micro-batches) and a late commit still folds in the whole stream's statistics."""
    torch.manual_seed(0)
    bn = gp.DeferredBatchNorm(3, momentum=None).double()
    batches = [torch.randn(4, 3, dtype=torch.float64) * 2 + 1 for _ in range(150)]
    for x in batches:
        bn(x)
    assert len(bn._pending) <= 65
    bn.commit()
    whole = torch.cat(batches)
    torch.testing.assert_close(bn.running_mean, whole.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, whole.var(0), rtol=1e-9, atol=0)
