"""Splitting an nn.Sequential into contiguous partitions, and choosing the balance optimally.

Every ``balance_by_*`` function measures one cost per layer and hands it to
:func:`optimal_balance`, which minimizes the cost of the most expensive partition exactly
(dynamic programming over contiguous splits, not a greedy heuristic). The returned
:class:`Balance` is a plain ``list[int]`` that also carries the predicted per-partition costs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .microbatch import flatten, map_tensors

__all__ = [
    "Balance",
    "verify_module",
    "verify_balance",
    "split_module",
    "optimal_balance",
    "balance_by_params",
    "balance_by_time",
    "balance_by_memory",
]


class Balance(list[int]):
    """Layers per partition, with the predicted cost of each partition from the profile."""

    def __init__(self, sizes: Sequence[int], stage_costs: Sequence[float], unit: str) -> None:
        super().__init__(sizes)
        self.stage_costs = list(stage_costs)
        self.unit = unit

    @property
    def max_cost(self) -> float:
        """The predicted cost of the slowest (largest) partition: what bounds a pipeline step."""
        return max(self.stage_costs)

    def describe(self) -> str:
        costs = ", ".join(f"{c:.4g}" for c in self.stage_costs)
        return f"balance {list(self)}: {self.unit} per partition [{costs}], max {self.max_cost:.4g}"


def verify_module(module: nn.Module) -> None:
    """A pipeline needs an ``nn.Sequential``: its order is the order the layers run in."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be nn.Sequential, got {type(module).__name__}; express the network "
            "as nn.Sequential(layer, ...) whose layers each take and return a tensor or a tuple"
        )


def verify_balance(module: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Check that ``balance`` cuts ``module`` into non-empty partitions; return it as a list."""
    balance = list(balance)
    if len(balance) == 0:
        raise ValueError("balance is empty; give the number of layers of each partition, e.g. [2, 2]")
    bad = [b for b in balance if not isinstance(b, int) or b <= 0]
    if bad:
        raise ValueError(
            f"balance={balance} has non-positive or non-integer entries {bad}; every partition "
            "needs at least one layer"
        )
    if sum(balance) != len(module):
        raise ValueError(
            f"sum(balance)={sum(balance)} does not match len(module)={len(module)}; "
            "give one balance entry per partition whose sum is the number of layers"
        )
    return balance


def split_module(
    module: nn.Sequential, balance: Sequence[int], *, tie_first_last: bool = False
) -> list[list[tuple[str, nn.Module]]]:
    """Cut ``module`` into ``len(balance)`` lists of ``(name, layer)``, in order.

    Raises when a parameter is shared by layers of two different partitions: each partition's
    gradients are computed separately, so a shared parameter would silently get only part of its
    gradient. ``tie_first_last`` allows sharing between the first and the last partition only:
    ``DistributedGPipe(tied=(first_name, last_name))`` keeps such a tied weight's two copies
    equal and sums their gradients.
    """
    verify_module(module)
    balance = verify_balance(module, balance)
    # Not named_children(): it skips a layer that appears twice, which would shift the cut.
    named = list(module._modules.items())
    partitions = []
    start = 0
    for size in balance:
        partitions.append(named[start : start + size])
        start += size
    ends = {0, len(partitions) - 1}
    owner: dict[int, tuple[int, str]] = {}
    for index, partition in enumerate(partitions):
        for layer_name, layer in partition:
            for param_name, param in layer.named_parameters():
                key = id(param)
                if key in owner and owner[key][0] != index:
                    other_index, other_name = owner[key]
                    if tie_first_last and {other_index, index} == ends:
                        continue
                    raise ValueError(
                        f"parameter {layer_name}.{param_name} is shared with {other_name} "
                        f"across partitions {other_index} and {index}; move the layers that "
                        "share it into one partition (change balance), or untie them"
                    )
                owner.setdefault(key, (index, f"{layer_name}.{param_name}"))
    return partitions


def optimal_balance(costs: Sequence[float], partitions: int) -> Balance:
    """Split ``costs`` into ``partitions`` contiguous non-empty groups minimizing the largest sum.

    Exact dynamic programming in O(partitions * n^2); among optimal splits it returns the one
    found first scanning cut points from the left.
    """
    n = len(costs)
    if partitions < 1:
        raise ValueError(f"partitions={partitions} must be at least 1")
    if n < partitions:
        raise ValueError(
            f"cannot split {n} layers into {partitions} non-empty partitions; use at most {n}"
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    if partitions * n * n > _DP_LIMIT:
        return _bisected_balance(prefix, partitions)
    inf = float("inf")
    # best[k][i]: minimal max-cost of splitting the first i layers into k groups; cut[k][i] the
    # start of the last group in that optimum.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            row_best, row_cut = inf, k - 1
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < row_best:
                    row_best, row_cut = value, j
            best[k][i], cut[k][i] = row_best, row_cut
    sizes = []
    i = n
    for k in range(partitions, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    sizes.reverse()
    stage_costs = []
    start = 0
    for size in sizes:
        stage_costs.append(prefix[start + size] - prefix[start])
        start += size
    return Balance(sizes, stage_costs, unit="cost")


# Above this many steps the dynamic programme gives way to bisection on the largest cost
# (a 1665-layer model on 128 stages would take 3.5e8 steps).
_DP_LIMIT = 4_000_000


def _bisected_balance(prefix: list[float], partitions: int) -> Balance:
    """The same minimal largest sum for long models: bisect on the bound, each bound checked
    by a greedy left-to-right fill (O(n) per check); optimal up to float rounding."""
    n = len(prefix) - 1

    def groups(bound: float) -> list[int] | None:
        sizes, start = [], 0
        while start < n:
            end = start + 1
            if prefix[end] - prefix[start] > bound:
                return None
            while end < n and prefix[end + 1] - prefix[start] <= bound:
                end += 1
            sizes.append(end - start)
            start = end
            if len(sizes) > partitions:
                return None
        return sizes

    low = max(prefix[i + 1] - prefix[i] for i in range(n)) * (1 - 1e-12)
    high = prefix[n]
    for _ in range(200):
        middle = (low + high) / 2
        if groups(middle) is None:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * max(high, 1e-300):
            break
    sizes = groups(high)
    assert sizes is not None
    while len(sizes) < partitions:  # split the largest group: the maximum cannot grow
        index = max((i for i, size in enumerate(sizes) if size > 1), key=lambda i: sizes[i])
        sizes[index:index + 1] = [sizes[index] // 2, sizes[index] - sizes[index] // 2]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    stage_costs = [prefix[b] - prefix[a] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return Balance(sizes, stage_costs, unit="cost")


def balance_by_params(module: nn.Sequential, partitions: int) -> Balance:
    """Balance by the number of parameters of each layer (no data needed)."""
    verify_module(module)
    costs = [float(sum(p.numel() for p in layer.parameters())) for layer in module]
    result = optimal_balance(costs, partitions)
    result.unit = "parameters"
    return result


def _requires_grad_copy(sample: Any) -> Any:
    return map_tensors(sample, lambda x: x.detach().requires_grad_(x.is_floating_point()))


def _differentiable_outputs(output: Any) -> list[Tensor]:
    leaves, _ = flatten(output)
    return [x for x in leaves if isinstance(x, Tensor) and x.requires_grad]


def balance_by_time(
    module: nn.Sequential,
    sample: Any,
    partitions: int,
    *,
    repeats: int = 3,
    device: torch.device | str | None = None,
) -> Balance:
    """Balance by measured forward+backward time of each layer on ``sample`` (the fastest of
    ``repeats`` runs: other processes on the machine only ever add time).

    Each layer runs on the output of the previous one, so shapes are those of the real network.
    """
    verify_module(module)
    device = torch.device(device) if device is not None else _module_device(module)
    times: list[list[float]] = [[] for _ in module]
    for _ in range(repeats):
        x = map_tensors(sample, lambda t: t.to(device))
        for index, layer in enumerate(module):
            x = _requires_grad_copy(x)
            _synchronize(device)
            start = time.perf_counter()
            y = layer(x)
            outputs = _differentiable_outputs(y)
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            _synchronize(device)
            times[index].append(time.perf_counter() - start)
            x = map_tensors(y, lambda t: t.detach())
    module.zero_grad(set_to_none=True)
    costs = [min(t) for t in times]
    result = optimal_balance(costs, partitions)
    result.unit = "seconds"
    return result


def balance_by_memory(
    module: nn.Sequential,
    sample: Any,
    partitions: int,
    *,
    param_scale: float = 4.0,
    device: torch.device | str | None = None,
) -> Balance:
    """Balance by bytes each layer needs: activations saved for backward + scaled parameter bytes.

    ``param_scale`` counts parameter, gradient and optimizer state copies (4 = Adam: weights,
    gradients and two moments). Saved activations are counted with
    ``torch.autograd.graph.saved_tensors_hooks`` on a forward pass over ``sample``.
    """
    verify_module(module)
    device = torch.device(device) if device is not None else _module_device(module)
    costs = []
    x = map_tensors(sample, lambda t: t.to(device))
    for layer in module:
        x = _requires_grad_copy(x)
        saved = _SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            y = layer(x)
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        costs.append(saved.total + param_scale * param_bytes)
        x = map_tensors(y, lambda t: t.detach())
    result = optimal_balance(costs, partitions)
    result.unit = "bytes"
    return result


class _SavedBytes:
    """Counts the storage bytes autograd saves for backward, each storage once."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[int] = set()

    def pack(self, tensor: Tensor) -> Tensor:
        if not isinstance(tensor, nn.Parameter):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.total += storage.nbytes()
        return tensor

    def unpack(self, tensor: Tensor) -> Tensor:
        return tensor


def _module_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
