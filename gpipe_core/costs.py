"""Per-layer costs of a training step counted on the ``meta`` device: bytes and FLOPs, no memory.

:func:`layer_costs` runs one forward and one backward of every layer of an ``nn.Sequential``
on a sample batch and counts, per layer:

- parameters and their bytes;
- ``saved_bytes``: the storages autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, so views and tensors
  saved twice count once, parameters never; a layer's input storages are counted apart in
  ``saved_input_bytes`` and only when the previous layer did not already save them (its
  output saved by both counts with the first), the way the CPU memory model counts them;
- ``input_bytes`` / ``output_bytes``: the boundary message a stage receives or sends;
- ``forward_flops`` / ``backward_flops``: ``torch.utils.flop_counter.FlopCounterMode``
  (matrix products and convolutions; element-wise work counts nothing, as in MFU);
- ``forward_ops`` / ``backward_ops``: operator calls (metadata-only ones such as views not
  counted), for the fixed per-operator cost that makes tiny micro-batches run below peak.

Everything scales linearly with the batch (:meth:`LayerCosts.scaled`), so one count at any
batch size serves every micro-batch size. What one stage of layers ``[a, b)`` keeps for one
micro-batch's backward is :meth:`LayerCosts.kept_bytes`: its input, plus what its layers save.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from .microbatch import flatten, map_tensors

__all__ = ["LayerCosts", "layer_costs", "structural_key"]

# Fields that do not scale with the batch.
_PER_SAMPLE = ("param_count", "param_bytes", "forward_ops", "backward_ops")


@dataclass
class LayerCosts:
    """Per layer of an ``nn.Sequential``, for a batch of ``batch_size`` samples."""

    batch_size: float  # samples the counts are for
    names: list[str] = field(default_factory=list)
    param_count: list[int] = field(default_factory=list)
    param_bytes: list[float] = field(default_factory=list)
    saved_bytes: list[float] = field(default_factory=list)  # saved for backward, inputs apart
    saved_input_bytes: list[float] = field(default_factory=list)  # inputs it saves, not saved before
    input_bytes: list[float] = field(default_factory=list)
    output_bytes: list[float] = field(default_factory=list)
    forward_flops: list[float] = field(default_factory=list)
    backward_flops: list[float] = field(default_factory=list)
    forward_ops: list[int] = field(default_factory=list)  # operator calls
    backward_ops: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def scaled(self, batch_size: float) -> LayerCosts:
        """The same layers for ``batch_size`` samples (a micro-batch: the mini-batch / M)."""
        ratio = batch_size / self.batch_size
        values = {f.name: (getattr(self, f.name) if f.name in _PER_SAMPLE or f.name == "names"
                           else [v * ratio for v in getattr(self, f.name)])
                  for f in fields(self) if f.name != "batch_size"}
        return LayerCosts(batch_size=batch_size, **values)  # type: ignore[arg-type]

    def select(self, indices: Sequence[int]) -> LayerCosts:
        """These layers in this order (repeat an index to repeat a layer: a deeper model of
        identical layers without counting every one)."""
        values = {f.name: [getattr(self, f.name)[i] for i in indices]
                  for f in fields(self) if f.name != "batch_size"}
        return LayerCosts(batch_size=self.batch_size, **values)

    def kept_bytes(self, start: int, stop: int) -> float:
        """Bytes layers ``[start, stop)`` keep for one batch's backward, their input included."""
        return (self.input_bytes[start] + sum(self.saved_bytes[start:stop])
                + sum(self.saved_input_bytes[start + 1:stop]))

    @property
    def num_parameters(self) -> int:
        return sum(self.param_count)


class _OpCount(TorchDispatchMode):
    """Counts operator calls (each is at least one kernel launch on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func not in _FREE_OPS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


# Metadata-only operators: no kernel runs.
_FREE_OPS = {torch.ops.aten.view.default, torch.ops.aten.t.default,
             torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.expand.default, torch.ops.aten.permute.default,
             torch.ops.aten.transpose.int, torch.ops.aten.unsqueeze.default,
             torch.ops.aten.squeeze.dim, torch.ops.aten.alias.default,
             torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
             torch.ops.aten._reshape_alias.default, torch.ops.aten.split.Tensor,
             torch.ops.aten.split_with_sizes.default, torch.ops.aten.as_strided.default}


def _storage_key(tensor: Tensor) -> int:
    # Views share their base's storage object, on meta too (where data_ptr() is always 0).
    return int(tensor.untyped_storage()._cdata)


class _SavedStorages:
    """The storages autograd saves, by key, with their sizes; parameters excluded."""

    def __init__(self, parameters: set[int]) -> None:
        self.sizes: dict[int, int] = {}
        self._parameters = parameters
        self._alive: list[Tensor] = []  # keeps keys unique while counting

    def pack(self, tensor: Tensor) -> Tensor:
        key = _storage_key(tensor)
        if key not in self._parameters and key not in self.sizes:
            self.sizes[key] = tensor.untyped_storage().nbytes()
            self._alive.append(tensor)
        return tensor


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in flatten(value)[0] if isinstance(t, Tensor)]


def _nbytes(value: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in _tensors(value)))


@dataclass
class _Counted:
    """One layer's count on one input signature, reusable for an identical layer."""

    values: dict[str, float]
    saved_inputs: list[tuple[frozenset[int], int]]  # input leaves sharing a saved storage, bytes
    output: Any
    saved_outputs: frozenset[int]  # output leaves whose storage this layer saved


def _count_layer(layer: nn.Module, x: Any, parameters: set[int],
                 grad_of: Callable[[Tensor], Tensor]) -> _Counted:
    leaves = _tensors(x)
    saved = _SavedStorages(parameters)
    forward_ops, backward_ops = _OpCount(), _OpCount()
    # Data-dependent indexing has no meta kernel unless told every element is selected.
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # type: ignore[attr-defined]
        with FlopCounterMode(display=False) as forward_count, forward_ops, \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            y = layer(x)
        outputs = [t for t in _tensors(y) if t.requires_grad]
        with FlopCounterMode(display=False) as backward_count, backward_ops:
            if outputs:
                torch.autograd.backward(outputs, [grad_of(t) for t in outputs])
    layer.zero_grad(set_to_none=True)
    input_keys = [_storage_key(t) for t in leaves]
    saved_inputs = [(frozenset(i for i, k in enumerate(input_keys) if k == key), size)
                    for key, size in saved.sizes.items() if key in input_keys]
    own = sum(size for key, size in saved.sizes.items() if key not in input_keys)
    y = map_tensors(y, lambda t: t.detach())
    saved_outputs = frozenset(i for i, t in enumerate(_tensors(y))
                              if _storage_key(t) in saved.sizes)
    values = {
        "param_count": sum(p.numel() for p in layer.parameters()),
        "param_bytes": float(sum(p.numel() * p.element_size() for p in layer.parameters())),
        "saved_bytes": float(own),
        "input_bytes": _nbytes(x),
        "output_bytes": _nbytes(y),
        "forward_flops": float(forward_count.get_total_flops()),
        "backward_flops": float(backward_count.get_total_flops()),
        "forward_ops": forward_ops.calls,
        "backward_ops": backward_ops.calls,
    }
    return _Counted(values, saved_inputs, y, saved_outputs)


def structural_key(layer: nn.Module) -> Hashable:
    """What makes two layers cost the same on the same input: class, ``repr`` (sizes, strides,
    dropout), parameter and buffer shapes and dtypes, training mode."""
    return (type(layer).__qualname__, repr(layer), layer.training,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in layer.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()))


def _signature(x: Any) -> Hashable:
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in _tensors(x))


def layer_costs(
    module: nn.Sequential,
    sample: Any,
    *,
    batch_size: int | None = None,
    grad_of: Callable[[Tensor], Tensor] = torch.ones_like,
    same_layer: Callable[[nn.Module], Hashable] | None = None,
) -> LayerCosts:
    """Count :class:`LayerCosts` of ``module`` on ``sample`` (a batch: tensor or tuple).

    A module built on ``meta`` is counted as it is (nothing allocated); any other module is
    counted on a ``meta`` copy, so the count never runs a kernel either way. ``batch_size``:
    the samples in ``sample`` (default: the first dimension of its first tensor). Each layer's
    backward gets a gradient shaped like its output, as a stage receives one.
    ``same_layer``: a key (e.g. :func:`structural_key`) under which layers receiving inputs of
    the same shapes are counted once, which makes a model of a thousand identical layers as
    quick to count as one; a layer whose cost depends on anything else must not share a key.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential, got {type(module).__name__}")
    if any(p.device.type != "meta" for p in module.parameters()) or any(
            b.device.type != "meta" for b in module.buffers()):
        module = copy.deepcopy(module).to("meta")
    tensors = _tensors(sample)
    if batch_size is None:
        if not tensors or tensors[0].dim() == 0:
            raise ValueError("sample has no batched tensor; pass batch_size=")
        batch_size = int(tensors[0].shape[0])
    parameters = {_storage_key(p) for p in module.parameters()}
    costs = LayerCosts(batch_size=batch_size)
    x = map_tensors(sample, lambda t: t.to("meta"))
    previous_saved: frozenset[int] = frozenset()  # input leaves the previous layer saved
    counted: dict[Hashable, _Counted] = {}
    # Not named_children(): it skips a layer that appears twice.
    for name, layer in module._modules.items():
        assert layer is not None
        x = map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        key = None if same_layer is None else (same_layer(layer), _signature(x))
        if key is not None and key in counted:
            count = counted[key]
        else:
            count = _count_layer(layer, x, parameters, grad_of)
            if key is not None:
                counted[key] = count
        costs.names.append(name)
        for field_name, value in count.values.items():
            getattr(costs, field_name).append(value)
        costs.saved_input_bytes.append(float(sum(
            size for leaves, size in count.saved_inputs if not leaves & previous_saved)))
        previous_saved = count.saved_outputs
        x = count.output
    return costs
