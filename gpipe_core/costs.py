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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from .microbatch import flatten, map_tensors

__all__ = ["LayerCosts", "layer_costs"]

# Fields that do not scale with the batch.
_PER_SAMPLE = ("param_count", "param_bytes", "forward_ops", "backward_ops")


@dataclass
class LayerCosts:
    """Per layer of an ``nn.Sequential``, for a batch of ``batch_size`` samples."""

    batch_size: int
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


def layer_costs(
    module: nn.Sequential,
    sample: Any,
    *,
    batch_size: int | None = None,
    grad_of: Callable[[Tensor], Tensor] = torch.ones_like,
) -> LayerCosts:
    """Count :class:`LayerCosts` of ``module`` on ``sample`` (a batch: tensor or tuple).

    A module built on ``meta`` is counted as it is (nothing allocated); any other module is
    counted on a ``meta`` copy, so the count never runs a kernel either way. ``batch_size``:
    the samples in ``sample`` (default: the first dimension of its first tensor). Each layer's
    backward gets a gradient shaped like its output, as a stage receives one.
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
    previous_saved: set[int] = set()
    # Not named_children(): it skips a layer that appears twice.
    for name, layer in module._modules.items():
        assert layer is not None
        x = map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        inputs = {_storage_key(t): t.untyped_storage().nbytes() for t in _tensors(x)}
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
        own = {k: v for k, v in saved.sizes.items() if k not in inputs}
        reused = {k: v for k, v in saved.sizes.items() if k in inputs and k not in previous_saved}
        costs.names.append(name)
        costs.param_count.append(sum(p.numel() for p in layer.parameters()))
        costs.param_bytes.append(float(sum(p.numel() * p.element_size()
                                           for p in layer.parameters())))
        costs.saved_bytes.append(float(sum(own.values())))
        costs.saved_input_bytes.append(float(sum(reused.values())))
        costs.input_bytes.append(_nbytes(x))
        costs.output_bytes.append(_nbytes(y))
        costs.forward_flops.append(float(forward_count.get_total_flops()))
        costs.backward_flops.append(float(backward_count.get_total_flops()))
        costs.forward_ops.append(forward_ops.calls)
        costs.backward_ops.append(backward_ops.calls)
        y = map_tensors(y, lambda t: t.detach())
        previous_saved = {_storage_key(t) for t in _tensors(y)} & set(saved.sizes)
        x = y
    return costs
