"""Balancing: the optimal contiguous min-max partition, checked against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpipe_core as gp
from gpipe_core.partition import optimal_balance, split_module


def brute_force(costs: list[float], k: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_hand_made_costs() -> None:
    assert optimal_balance([1, 1, 1, 1], 2) == [2, 2]
    assert optimal_balance([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [1, 8]
    result = optimal_balance([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    assert result.max_cost == 17  # [1..5]=15, [6,7]=13? -> optimum 17: [1..6]=21 too big
    assert result.max_cost == brute_force([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    assert sum(result) == 9 and all(size > 0 for size in result)


def test_greedy_would_be_wrong() -> None:
    # A greedy "fill to the average" split gives [5, 4 | 4 | 6] = max 9 ... the optimum is 8.
    costs = [5.0, 3.0, 1.0, 4.0, 1.0, 3.0, 3.0]
    assert optimal_balance(costs, 3).max_cost == brute_force(costs, 3)


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.integers(0, 50), min_size=1, max_size=9),
    k=st.integers(1, 5),
)
def test_matches_brute_force(costs: list[int], k: int) -> None:
    if k > len(costs):
        with pytest.raises(ValueError, match="non-empty partitions"):
            optimal_balance(costs, k)
        return
    result = optimal_balance(costs, k)
    assert len(result) == k and sum(result) == len(costs) and min(result) >= 1
    assert result.max_cost == brute_force(costs, k)
    assert result.stage_costs == [
        sum(costs[sum(result[:i]) : sum(result[: i + 1])]) for i in range(k)
    ]


def test_balance_by_params() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10))
    balance = gp.balance_by_params(model, 2)
    assert balance == [1, 3]
    assert balance.max_cost == 100 * 100 + 100
    assert "parameters" in balance.describe()


def test_balance_by_time_puts_the_slow_layer_alone() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 512), nn.Linear(512, 512),
        nn.Linear(512, 8), nn.Linear(8, 8),
    )
    balance = gp.balance_by_time(model, torch.randn(256, 8), 3, repeats=3)
    assert sum(balance) == 6 and len(balance) == 3
    assert balance.unit == "seconds" and balance.max_cost > 0
    # The 512x512 layer dominates; the optimal cut isolates the heavy middle.
    assert balance[0] >= 2


def test_balance_by_memory_counts_saved_activations() -> None:
    model = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 16), nn.ReLU())
    balance = gp.balance_by_memory(model, torch.randn(64, 16), 2)
    assert sum(balance) == 4 and balance.unit == "bytes"
    assert balance.stage_costs[0] > 0 and balance.stage_costs[1] > 0


def test_too_many_partitions() -> None:
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 non-empty partitions"):
        gp.balance_by_params(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 3)


def tied_model() -> nn.Sequential:
    embed, middle, head = nn.Linear(4, 4, bias=False), nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, middle, nn.Tanh(), head)


def test_a_weight_tied_across_the_ends_needs_tie_first_last() -> None:
    model = tied_model()
    with pytest.raises(ValueError, match="shared with 0.weight across partitions 0 and 2"):
        gp.GPipe(model, [1, 2, 1])
    partitions = split_module(model, [1, 2, 1], tie_first_last=True)
    assert [[name for name, _ in p] for p in partitions] == [["0"], ["1", "2"], ["3"]]


def test_tie_first_last_still_refuses_other_sharing() -> None:
    model = tied_model()
    model[1].weight = model[0].weight  # shared by the first and a middle partition
    with pytest.raises(ValueError, match="across partitions 0 and 1"):
        split_module(model, [1, 2, 1], tie_first_last=True)


@pytest.mark.parametrize("tie_first_last", [False, True])
def test_a_wrong_balance_is_the_same_error_with_a_tie(tie_first_last: bool) -> None:
    with pytest.raises(ValueError, match=r"sum\(balance\)=5 does not match len\(module\)=4"):
        split_module(tied_model(), [2, 3], tie_first_last=tie_first_last)
