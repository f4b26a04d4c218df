"""Manipulation of micro-batches: scatter a mini-batch into chunks and gather it back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["scatter", "gather", "batch_size", "map_tensors", "flatten", "unflatten"]

# A batch is a tensor, or a tuple/list/dict (possibly nested) of tensors and other values.
# Tensors with at least one dimension are split along dim 0; 0-dim tensors and non-tensor values
# (None, ints, strings, ...) are passed through unchanged to every micro-batch.
Batch = Any


def _is_batched(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0


def flatten(batch: Batch) -> tuple[list[Any], Any]:
    """Flatten nested tuples/lists/dicts into a list of leaves and a spec to rebuild them."""
    if isinstance(batch, tuple | list):
        leaves: list[Any] = []
        specs = []
        for item in batch:
            item_leaves, item_spec = flatten(item)
            leaves.extend(item_leaves)
            specs.append((len(item_leaves), item_spec))
        return leaves, (type(batch), specs)
    if isinstance(batch, dict):
        leaves = []
        dict_specs: list[tuple[Any, int, Any]] = []
        for key, item in batch.items():
            item_leaves, item_spec = flatten(item)
            leaves.extend(item_leaves)
            dict_specs.append((key, len(item_leaves), item_spec))
        return leaves, (dict, dict_specs)
    return [batch], None


def unflatten(leaves: list[Any], spec: Any) -> Batch:
    """Inverse of :func:`flatten`."""
    if spec is None:
        return leaves[0]
    kind, specs = spec
    if kind is dict:
        out: dict[Any, Any] = {}
        pos = 0
        for key, count, item_spec in specs:
            out[key] = unflatten(leaves[pos : pos + count], item_spec)
            pos += count
        return out
    items = []
    pos = 0
    for count, item_spec in specs:
        items.append(unflatten(leaves[pos : pos + count], item_spec))
        pos += count
    if kind is tuple or kind is list:
        return kind(items)
    return kind(*items)  # a namedtuple


def map_tensors(batch: Batch, fn: Callable[[Tensor], Any]) -> Batch:
    """Apply ``fn`` to every tensor in a (nested) batch, leaving other values as they are."""
    leaves, spec = flatten(batch)
    return unflatten([fn(x) if isinstance(x, Tensor) else x for x in leaves], spec)


def batch_size(batch: Batch) -> int:
    """The size of dim 0 shared by every batched tensor; an error names disagreeing sizes."""
    leaves, _ = flatten(batch)
    sizes = [x.size(0) for x in leaves if _is_batched(x)]
    if not sizes:
        raise TypeError(
            "the batch holds no tensor with a batch dimension; give at least one tensor "
            f"with dim >= 1 (got leaves of types {[type(x).__name__ for x in leaves]})"
        )
    if any(size != sizes[0] for size in sizes):
        raise ValueError(
            f"tensors in the batch have different sizes along dim 0: {sizes}; every batched "
            "tensor must share the batch dimension so it can be split into micro-batches"
        )
    return sizes[0]


def scatter(batch: Batch, chunks: int) -> list[Batch]:
    """Split ``batch`` along dim 0 into ``min(chunks, batch_size)`` nearly equal micro-batches.

    Sizes differ by at most one (``torch.tensor_split``), the larger ones first. A batch smaller
    than ``chunks`` gives one micro-batch per sample rather than empty micro-batches.
    """
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be at least 1")
    leaves, spec = flatten(batch)
    size = batch_size(batch)
    if size == 0:
        raise ValueError(
            "the batch is empty (size 0 along dim 0); give at least one sample (a data loader "
            "that ran dry, or a filter that dropped every row?)"
        )
    num_microbatches = min(chunks, size)
    pieces = [
        x.tensor_split(num_microbatches) if _is_batched(x) else [x] * num_microbatches
        for x in leaves
    ]
    return [unflatten([p[i] for p in pieces], spec) for i in range(num_microbatches)]


def gather(microbatches: list[Batch]) -> Batch:
    """Concatenate micro-batches along dim 0; non-batched values are taken from the first."""
    if not microbatches:
        raise ValueError("gather() needs at least one micro-batch")
    flat = [flatten(mb) for mb in microbatches]
    leaves0, spec = flat[0]
    if len(microbatches) == 1:
        return microbatches[0]
    gathered = []
    for i, leaf in enumerate(leaves0):
        if _is_batched(leaf):
            gathered.append(torch.cat([leaves[i] for leaves, _ in flat]))
        else:
            gathered.append(leaf)
    return unflatten(gathered, spec)
