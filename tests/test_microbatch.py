"""Scatter/gather of micro-batches, with hypothesis round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpipe_core as gp
from gpipe_core.microbatch import batch_size, gather, scatter


def test_uneven_batch_splits_into_nearly_equal_chunks() -> None:
    x = torch.arange(10)
    sizes = [len(mb) for mb in scatter(x, 4)]
    assert sizes == [3, 3, 2, 2]


def test_batch_smaller_than_chunks_uses_fewer_microbatches() -> None:
    x = torch.arange(3)
    assert [mb.tolist() for mb in scatter(x, 8)] == [[0], [1], [2]]


def test_structures_and_non_tensors_pass_through() -> None:
    batch = {"x": torch.ones(4, 2), "pair": (torch.zeros(4), None), "tag": "hello", "k": 3}
    mbs = scatter(batch, 2)
    assert len(mbs) == 2
    for mb in mbs:
        assert mb["tag"] == "hello" and mb["k"] == 3 and mb["pair"][1] is None
        assert mb["x"].shape == (2, 2)
    back = gather(mbs)
    assert torch.equal(back["x"], batch["x"]) and back["tag"] == "hello"


def test_zero_dim_tensors_are_broadcast() -> None:
    scale = torch.tensor(2.0)
    mbs = scatter((torch.ones(4), scale), 2)
    assert all(mb[1] is scale for mb in mbs)


def test_mismatched_batch_sizes_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"different sizes along dim 0: \[4, 3\]"):
        scatter((torch.ones(4), torch.ones(3)), 2)


def test_no_batched_tensor_is_an_error() -> None:
    with pytest.raises(TypeError, match="no tensor with a batch dimension"):
        scatter((1, "a"), 2)


def test_chunks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunks=0"):
        scatter(torch.ones(2), 0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 33),
    chunks=st.integers(1, 12),
    width=st.integers(1, 4),
    as_dict=st.booleans(),
)
def test_scatter_gather_round_trip(n: int, chunks: int, width: int, as_dict: bool) -> None:
    x = torch.randn(n, width)
    y = torch.arange(n)
    batch = {"x": x, "rest": [y, 7]} if as_dict else (x, (y, None))
    mbs = scatter(batch, chunks)
    assert len(mbs) == min(n, chunks)
    sizes = [batch_size(mb) for mb in mbs]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    back = gather(mbs)
    if as_dict:
        assert torch.equal(back["x"], x) and torch.equal(back["rest"][0], y)
        assert back["rest"][1] == 7
    else:
        assert torch.equal(back[0], x) and torch.equal(back[1][0], y) and back[1][1] is None


def test_an_empty_batch_is_an_error_that_says_so() -> None:
    with pytest.raises(ValueError, match=r"the batch is empty \(size 0 along dim 0\)"):
        scatter(torch.zeros(0, 3), 4)
    pipe = gp.GPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), [1, 1], chunks=2)
    with pytest.raises(ValueError, match="the batch is empty"):
        pipe(torch.zeros(0, 3))
