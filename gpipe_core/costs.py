"""Per-layer costs of a training step counted on the ``meta`` device: bytes and FLOPs, no memory.

:func:`layer_costs` runs one forward and one backward of every layer of an ``nn.Sequential``
on a sample batch and counts, per layer:

- parameters and their bytes;
- ``saved_bytes``: the storages autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, so views and tensors
  saved twice count once, parameters never; a layer's input storages are counted apart in
  ``saved_input_bytes`` and only when the previous layer did not already save them (its
  output saved by both counts with the first), the way the CPU memory model counts them;
  ``saved_fixed_bytes``: the part of ``saved_bytes`` that does not grow with the batch (a
  normalisation's per-channel statistics), counted at the sample's batch and at twice it, so
  a micro-batch's count is not the batch's share of it;
- ``input_bytes`` / ``output_bytes``: the boundary message a stage receives or sends;
- ``output_unsaved_bytes``: the part of ``output_bytes`` whose storage the layer did not save
  for its own backward: what a stage ending at this layer holds apart, per micro-batch, while
  it waits for the output's gradient (it keeps its outputs to run the backward from them);
- ``output_passthrough_bytes``: the part of ``output_bytes`` that is the layer's input passed
  on (the same storage), so the next layer's input shares it with this one's;
- ``forward_working_bytes``: the most the layer's forward holds at once beyond what it leaves
  (what it saved and its output): the temporaries that exist only while it runs (an
  AmoebaNet cell's branch outputs beside the concatenation made of them);
  ``input_freed_bytes``: the part of its input that neither it nor the previous layer saved
  nor it passes on, alive while it runs and freed once it returns (the model's input counts
  nothing: the caller holds it). The two give the most a chain of layers holds while layer
  ``i`` runs: what it holds after ``i`` plus both of ``i``'s (an upper bound where an earlier
  layer than the previous one saved that input);
- ``backward_bytes``: the most the layer's backward holds at once beyond what the forward
  saved: the gradient it receives (``output_bytes``), its temporaries and the gradient of its
  input, replayed from every storage its backward creates and frees, its parameters' fresh
  gradients included: in every backward but a stage's first they are made beside the
  gradients already held (which the optimizer's memory counts) and summed into them, so they
  are temporaries at the layer's peak (a weight used twice: both parts and their sum; an
  embedding's dense gradient is as large as its table). Counted at the sample's batch and at twice
  it: the part that grows with the batch is ``backward_bytes``, the rest, which does not
  (a weight used twice has its gradient's parts summed), ``backward_fixed_bytes``;
- ``forward_flops`` / ``backward_flops``: ``torch.utils.flop_counter.FlopCounterMode``
  (matrix products and convolutions; element-wise work counts nothing, as in MFU);
- ``forward_ops`` / ``backward_ops``: operator calls (metadata-only ones such as views not
  counted), for the fixed per-operator cost that makes tiny micro-batches run below peak;
- ``forward_traffic_bytes`` / ``backward_traffic_bytes``: the bytes read and written by the
  operators that do no counted FLOPs (element-wise work, normalisation, pooling, copies, the
  embedding's gather and its gradient's scatter): each tensor argument and result once (a
  broadcast argument at its storage's size), so a device's memory bandwidth prices the work
  the FLOP count leaves out. Like ``backward_bytes``, counted at the sample's batch and at
  twice it: the part that does not grow with the batch (a weight-sized gradient) is apart,
  in ``forward_traffic_fixed_bytes`` / ``backward_traffic_fixed_bytes``.

Everything scales linearly with the batch (:meth:`LayerCosts.scaled`), so one count at any
batch size serves every micro-batch size. What one stage of layers ``[a, b)`` keeps for one
micro-batch's backward is :meth:`LayerCosts.kept_bytes`: its input, plus what its layers save.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .microbatch import flatten, map_tensors

__all__ = ["LayerCosts", "layer_costs", "structural_key"]

# Fields that do not scale with the batch.
_PER_SAMPLE = ("param_count", "param_bytes", "saved_fixed_bytes", "backward_fixed_bytes",
               "forward_ops",
               "backward_ops", "forward_traffic_fixed_bytes", "backward_traffic_fixed_bytes")


@dataclass
class LayerCosts:
    """Per layer of an ``nn.Sequential``, for a batch of ``batch_size`` samples."""

    batch_size: float  # samples the counts are for
    names: list[str] = field(default_factory=list)
    param_count: list[int] = field(default_factory=list)
    param_bytes: list[float] = field(default_factory=list)
    saved_bytes: list[float] = field(default_factory=list)  # saved for backward, inputs apart
    saved_input_bytes: list[float] = field(default_factory=list)  # inputs it saves, not saved before
    saved_fixed_bytes: list[float] = field(default_factory=list)  # of saved_bytes, at any batch
    input_bytes: list[float] = field(default_factory=list)
    output_bytes: list[float] = field(default_factory=list)
    output_unsaved_bytes: list[float] = field(default_factory=list)  # output it did not save
    # output that is its input passed on (the same storage: an AmoebaNet cell hands the
    # previous cell's output to the next beside its own)
    output_passthrough_bytes: list[float] = field(default_factory=list)
    # held only while its forward runs: its temporaries, and its input that is freed after
    forward_working_bytes: list[float] = field(default_factory=list)
    input_freed_bytes: list[float] = field(default_factory=list)
    backward_bytes: list[float] = field(default_factory=list)  # held by its backward, per batch
    backward_fixed_bytes: list[float] = field(default_factory=list)  # and at any batch
    forward_flops: list[float] = field(default_factory=list)
    backward_flops: list[float] = field(default_factory=list)
    forward_ops: list[int] = field(default_factory=list)  # operator calls
    backward_ops: list[int] = field(default_factory=list)
    # bytes moved by operators without counted FLOPs, per batch, and at any batch
    forward_traffic_bytes: list[float] = field(default_factory=list)
    backward_traffic_bytes: list[float] = field(default_factory=list)
    forward_traffic_fixed_bytes: list[float] = field(default_factory=list)
    backward_traffic_fixed_bytes: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def scaled(self, batch_size: float) -> LayerCosts:
        """The same layers for ``batch_size`` samples (a micro-batch: the mini-batch / M)."""
        ratio = batch_size / self.batch_size
        values = {f.name: (getattr(self, f.name) if f.name in _PER_SAMPLE or f.name == "names"
                           else [v * ratio for v in getattr(self, f.name)])
                  for f in fields(self) if f.name != "batch_size"}
        if self.saved_fixed_bytes:  # what does not grow with the batch stays as counted
            values["saved_bytes"] = [fixed + (v - fixed) * ratio for v, fixed in
                                     zip(self.saved_bytes, self.saved_fixed_bytes, strict=True)]
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
    """Counts operator calls (each is at least one kernel launch on an accelerator) and the
    bytes the calls without counted FLOPs read and write (``traffic``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.traffic = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func not in _FREE_OPS:
            self.calls += 1
            if func._overloadpacket not in flop_registry and func not in _ALLOCATING_OPS:
                self.traffic += sum(_moved_bytes(t) for t in _tensors((args, kwargs, out)))
        return out


def _moved_bytes(tensor: Tensor) -> int:
    """What an operator reads or writes of ``tensor``: its elements, but no more than its
    storage (a broadcast bias is read once, not once per row)."""
    return min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())


# Metadata-only operators: no kernel runs.
_FREE_OPS = {torch.ops.aten.view.default, torch.ops.aten.t.default,
             torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.expand.default, torch.ops.aten.permute.default,
             torch.ops.aten.transpose.int, torch.ops.aten.unsqueeze.default,
             torch.ops.aten.squeeze.dim, torch.ops.aten.alias.default,
             torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
             torch.ops.aten._reshape_alias.default, torch.ops.aten.split.Tensor,
             torch.ops.aten.split_with_sizes.default, torch.ops.aten.as_strided.default}
# Operators that only allocate (their memory is written by the operator that fills it).
_ALLOCATING_OPS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                   torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
                   torch.ops.aten.new_empty_strided.default}


def _storage_key(tensor: Tensor) -> int:
    # Views share their base's storage object, on meta too (where data_ptr() is always 0).
    return int(tensor.untyped_storage()._cdata)


class _Allocations(TorchDispatchMode):
    """Every storage an operator creates inside the context, and when it is freed, in order:
    what was alive at once can be replayed afterwards, leaving out storages known only at the
    end (the parameters' gradients). A storage's key (its address) is reused once it is freed,
    so each creation gets its own number. Storages that exist before (:meth:`hold`: what a
    forward saved) count from the start, so freeing them inside lowers the count."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (number, +bytes) created, (number, 0) freed
        self._alive: dict[int, int] = {}  # storage key -> its creation's number
        self._held = 0  # bytes alive at the start

    def hold(self, tensors: list[Tensor]) -> None:
        """Count these tensors' storages as alive from the start, until freed (call before the
        context; pass the only other references, which the call drops)."""
        while tensors:
            storage = tensors.pop().untyped_storage()
            if int(storage._cdata) not in self._alive:
                self._track(storage)
                self._held += storage.nbytes()

    def _track(self, storage: Any) -> None:
        """A new storage: numbered, sized, and its freeing recorded when it happens."""
        key, number = int(storage._cdata), len(self.events)
        self._alive[key] = number
        self.events.append((number, storage.nbytes()))
        weakref.finalize(storage, self._freed, key, number)

    def _freed(self, key: int, number: int) -> None:
        self.events.append((number, 0))
        if self._alive.get(key) == number:
            del self._alive[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an argument's storage: nothing new
        given = {_storage_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            key = _storage_key(t)
            if key not in self._alive and key not in given:
                self._track(t.untyped_storage())
        return out

    def alive(self) -> int:
        """Bytes alive now among the storages created inside (and held from the start)."""
        freed = {number for number, size in self.events if not size}
        return sum(size for number, size in self.events if size and number not in freed)

    def peak(self, excluded: Sequence[Tensor] = ()) -> int:
        """The most bytes alive at once above what was held at the start, the storages of
        ``excluded`` (alive now) left out."""
        left_out = {self._alive.get(_storage_key(t)) for t in excluded}
        sizes: dict[int, int] = {}
        current = peak = 0
        for number, size in self.events:
            if number in left_out:
                continue
            if size:
                sizes[number] = size
                current += size
                peak = max(peak, current)
            else:
                current -= sizes.pop(number, 0)
        return peak - self._held


class _SavedStorages:
    """The storages autograd saves, by key, with their sizes; the module's parameters and
    buffers excluded."""

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

    def release(self) -> list[Tensor]:
        """The saved tensors, one per storage; this object holds them no longer."""
        alive, self._alive = self._alive, []
        return alive


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
    unkept_inputs: list[tuple[frozenset[int], int]]  # input leaves it neither saved nor passed


def _count_layer(layer: nn.Module, x: Any, parameters: set[int],
                 grad_of: Callable[[Tensor], Tensor]) -> _Counted:
    leaves = _tensors(x)
    saved = _SavedStorages(parameters)
    forward_ops, backward_ops = _OpCount(), _OpCount()
    # Data-dependent indexing has no meta kernel unless told every element is selected.
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # type: ignore[attr-defined]
        forward_allocations = _Allocations()
        with FlopCounterMode(display=False) as forward_count, forward_ops, \
                forward_allocations, \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            y = layer(x)
        forward_working = forward_allocations.peak() - forward_allocations.alive()
        outputs = [t for t in _tensors(y) if t.requires_grad]
        grads = [grad_of(t) for t in outputs]
        # what the forward saved counts as held: the backward frees some of it on the way
        allocations = _Allocations()
        allocations.hold(saved.release())
        with FlopCounterMode(display=False) as backward_count, backward_ops, allocations:
            if outputs:
                torch.autograd.backward(outputs, grads)
    backward_held = allocations.peak() + sum(g.numel() * g.element_size() for g in grads)
    del grads
    layer.zero_grad(set_to_none=True)
    input_keys = [_storage_key(t) for t in leaves]
    saved_inputs = [(frozenset(i for i, k in enumerate(input_keys) if k == key), size)
                    for key, size in saved.sizes.items() if key in input_keys]
    own = sum(size for key, size in saved.sizes.items() if key not in input_keys)
    y = map_tensors(y, lambda t: t.detach())
    output_leaves = _tensors(y)
    saved_outputs = frozenset(i for i, t in enumerate(output_leaves)
                              if _storage_key(t) in saved.sizes)
    unsaved: dict[int, int] = {}  # each storage once: two outputs may be views of one
    passed: dict[int, int] = {}
    for i, t in enumerate(output_leaves):
        if i not in saved_outputs:
            unsaved[_storage_key(t)] = t.numel() * t.element_size()
        if _storage_key(t) in input_keys:
            passed[_storage_key(t)] = t.numel() * t.element_size()
    kept_keys = set(saved.sizes) | set(passed)
    unkept_inputs = [(frozenset(i for i, k in enumerate(input_keys) if k == key), size)
                     for key, size in {_storage_key(t): t.untyped_storage().nbytes()
                                       for t in leaves}.items() if key not in kept_keys]
    values = {
        "param_count": sum(p.numel() for p in layer.parameters()),
        "param_bytes": float(sum(p.numel() * p.element_size() for p in layer.parameters())),
        "saved_bytes": float(own),
        "input_bytes": _nbytes(x),
        "output_bytes": _nbytes(y),
        "output_unsaved_bytes": float(sum(unsaved.values())),
        "output_passthrough_bytes": float(sum(passed.values())),
        "forward_working_bytes": float(forward_working),
        "backward_bytes": float(backward_held),
        "forward_flops": float(forward_count.get_total_flops()),
        "backward_flops": float(backward_count.get_total_flops()),
        "forward_ops": forward_ops.calls,
        "backward_ops": backward_ops.calls,
        "forward_traffic_bytes": float(forward_ops.traffic),
        "backward_traffic_bytes": float(backward_ops.traffic),
    }
    return _Counted(values, saved_inputs, y, saved_outputs, unkept_inputs)


def structural_key(layer: nn.Module) -> Hashable:
    """What makes two layers cost the same on the same input: class, ``repr`` (sizes, strides,
    dropout), parameter and buffer shapes and dtypes, training mode."""
    return (type(layer).__qualname__, repr(layer), layer.training,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in layer.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()))


def _signature(x: Any) -> Hashable:
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in _tensors(x))


# Counts split into the part that grows with the batch (measured from the count at twice the
# batch) and the part that does not.
_GROWING_AND_FIXED = (("backward_bytes", "backward_fixed_bytes"),
                      ("forward_traffic_bytes", "forward_traffic_fixed_bytes"),
                      ("backward_traffic_bytes", "backward_traffic_fixed_bytes"))


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
    # the module's own tensors (parameters, and buffers such as running statistics) are held
    # anyway: a layer that saves them keeps nothing per micro-batch
    parameters = {_storage_key(t) for t in [*module.parameters(), *module.buffers()]}
    costs = LayerCosts(batch_size=batch_size)
    x = map_tensors(sample, lambda t: t.to("meta"))
    previous_saved: frozenset[int] = frozenset()  # input leaves the previous layer saved
    counted: dict[Hashable, _Counted] = {}
    # the same layers on twice the batch, for the part of a backward that grows with it (None
    # once a layer cannot take it: a tensor whose first dimension is not the batch)
    x2: Any = map_tensors(x, lambda t: torch.cat([t, t]) if t.dim() > 0 else t)

    def count_on(layer: nn.Module, inputs: Any) -> _Counted:
        inputs = map_tensors(inputs, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        key = None if same_layer is None else (same_layer(layer), _signature(inputs))
        if key is not None and key in counted:
            return counted[key]
        count = _count_layer(layer, inputs, parameters, grad_of)
        if key is not None:
            counted[key] = count
        return count

    # Not named_children(): it skips a layer that appears twice.
    for name, layer in module._modules.items():
        assert layer is not None
        count = count_on(layer, x)
        count2: _Counted | None = None
        if x2 is not None:
            try:
                count2 = count_on(layer, x2)
            except (RuntimeError, ValueError, IndexError):
                x2 = None
        costs.names.append(name)
        for field_name, value in count.values.items():
            getattr(costs, field_name).append(value)
        for growing_name, fixed_name in _GROWING_AND_FIXED:
            at_batch = count.values[growing_name]
            growing = at_batch if count2 is None else min(
                max(count2.values[growing_name] - at_batch, 0.0), at_batch)
            getattr(costs, growing_name)[-1] = growing
            getattr(costs, fixed_name).append(at_batch - growing)
        at_batch = count.values["saved_bytes"]
        costs.saved_fixed_bytes.append(0.0 if count2 is None else at_batch - min(
            max(count2.values["saved_bytes"] - at_batch, 0.0), at_batch))
        costs.saved_input_bytes.append(float(sum(
            size for leaves, size in count.saved_inputs if not leaves & previous_saved)))
        costs.input_freed_bytes.append(0.0 if not costs.input_freed_bytes else float(sum(
            size for leaves, size in count.unkept_inputs if not leaves & previous_saved)))
        previous_saved = count.saved_outputs
        x = count.output
        x2 = None if count2 is None else count2.output
    return costs
