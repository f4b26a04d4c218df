"""One partition on one device: runs forward and backward actions, keeps per-micro-batch state.

For every micro-batch a stage keeps what its backward will need, and frees it in that backward:

    re-materialized:  the partition's input only; the forward runs again, with autograd, in B
    kept:             the input and the forward's autograd graph

The backward runs whole (B, :meth:`Stage.backward`) or in two parts (zero-bubble schedules):
I (:meth:`Stage.backward_input`) returns the inputs' gradient and keeps the graph, with the
re-materialized forward run again there; W (:meth:`Stage.backward_weight`) then computes the
parameters' gradient from where I stopped (:mod:`gpipe_core.split_backward`) and frees the
micro-batch's state.

Inputs arrive detached (from the previous stage or the user); floating-point tensors that
required grad on the sending side become leaves that require grad here, so backward yields the
gradient to send back. Every layer's forward draws its randomness from a generator seeded by
(seed, step, micro-batch, layer index), which makes the recomputed forward equal to the first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .batchnorm import DeferredBatchNorm, frozen_running_stats
from .microbatch import flatten, unflatten
from .precision import AutocastState, check_precision
from .remat import checkpoint_stop, fork_rng, layer_seeds, seed_rng
from .split_backward import PendingWeights
from .split_backward import backward_input as split_backward_input

__all__ = ["Stage", "StagePosition", "LossFn"]

LossFn = Callable[[Any, Any], Tensor]
Grads = list[Tensor | None]


@dataclass
class _Saved:
    """What a micro-batch's backward needs: leaf inputs, and the graph unless re-materialized."""

    inputs: list[Any]
    spec: Any
    outputs: Any | None
    targets: Any
    autocast: AutocastState | None = None  # re-materialized: the state its forward ran in
    pending: PendingWeights | None = None  # after I: what W needs


class StagePosition:
    """``is_first`` and ``is_last`` of anything that has ``stage_index`` and ``num_stages``."""

    stage_index: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


class Stage(StagePosition):
    """Partition ``stage_index`` of ``num_stages``: the layers ``layers`` placed on ``device``."""

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        *,
        stage_index: int,
        num_stages: int,
        first_layer_index: int,
        device: torch.device,
        checkpoint: str,
        seed: int,
        loss_fn: LossFn | None = None,
        loss_scale: float | Callable[[int], float] | None = None,
        restore_rng: bool = True,
        precision: str = "fp32",
    ) -> None:
        self.layers = list(layers)
        # Give the caller's random state back after every forward; a caller that forks it
        # once around a whole step (DistributedGPipe) saves that per-action cost.
        self.restore_rng = restore_rng
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.first_layer_index = first_layer_index
        self.device = device
        self.checkpoint = checkpoint
        self.seed = seed
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        # "bf16"/"fp16": the stage runs its forward under autocast itself; "fp32": as called
        check_precision(precision)
        self.precision = precision
        # fp16 loss scaling: backward starts from the loss times this (the stored loss is not)
        self.grad_scale = 1.0
        checkpoint_stop(checkpoint, 1)  # validates the mode early
        self._batchnorms = [
            m for _, layer in self.layers for m in layer.modules() if isinstance(m, _BatchNorm)
        ]
        self._deferred = [m for m in self._batchnorms if isinstance(m, DeferredBatchNorm)]
        self._saved: dict[tuple[int, int], _Saved] = {}
        # The parameters that take gradients, read once per step (a walk over every module:
        # milliseconds on a stage of many small layers, once per micro-batch otherwise).
        self._trainable: tuple[int | None, list[Tensor]] = (None, [])
        self._forwards_done: dict[int, int] = {}
        self._num_microbatches: dict[int, int] = {}
        self.losses: dict[tuple[int, int], Tensor] = {}

    # -- bookkeeping -----------------------------------------------------------------------

    def begin_step(self, step: int, num_microbatches: int) -> None:
        """Announce a step of ``num_microbatches`` micro-batches (BatchNorm commits after all)."""
        self._num_microbatches[step] = num_microbatches
        self._forwards_done[step] = 0

    def discard(self, step: int) -> None:
        """Free everything kept for ``step`` (a forward whose backward never came)."""
        for key in [k for k in self._saved if k[0] == step]:
            del self._saved[key]
        for key in [k for k in self.losses if k[0] == step]:
            del self.losses[key]
        self._num_microbatches.pop(step, None)
        self._forwards_done.pop(step, None)

    def step_loss(self, step: int) -> Tensor | None:
        """The step's micro-batch losses summed in float64 (None without a ``loss_fn``)."""
        if self.loss_fn is None:
            return None
        loss = torch.zeros((), device=self.device, dtype=torch.float64)
        for mb in range(self._num_microbatches[step]):
            loss += self.losses[(step, mb)].double()
        return loss

    @property
    def num_saved(self) -> int:
        """Micro-batches whose backward is still pending (for tests and memory accounting)."""
        return len(self._saved)

    # -- forward ---------------------------------------------------------------------------

    def forward(self, step: int, mb: int, inputs: Any, targets: Any = None) -> Any:
        """Run the partition on micro-batch ``mb``; keep what its backward needs.

        Returns the partition's output (for the last stage with a ``loss_fn``, the output too;
        the micro-batch loss is stored in ``self.losses[(step, mb)]``).
        """
        grad_enabled = torch.is_grad_enabled()
        leaves, spec = flatten(inputs)
        leaves = [_as_input_leaf(x, grad_enabled) for x in leaves]
        num_microbatches = self._num_microbatches[step]
        rematerialize = grad_enabled and mb < checkpoint_stop(self.checkpoint, num_microbatches)
        # the autocast this forward runs in; a recomputation must run in it again
        autocast = AutocastState.current(self.device, self.precision)
        with autocast.applied(self.device):
            if rematerialize:
                with torch.no_grad():
                    outputs = self._run_layers(step, mb, unflatten(leaves, spec))
                    loss = self._loss(step, mb, outputs, targets)
                kept = None
                if self._needs_grad(leaves):
                    outputs = _mark_requires_grad(outputs)
            else:
                outputs = self._run_layers(step, mb, unflatten(leaves, spec))
                loss = self._loss(step, mb, outputs, targets)
                kept = loss if loss is not None else outputs
        if grad_enabled:
            self._saved[(step, mb)] = _Saved(leaves, spec, kept, targets,
                                             autocast if rematerialize else None)
        if loss is not None:
            self.losses[(step, mb)] = loss.detach()
        self._forwards_done[step] += 1
        if self._forwards_done[step] == num_microbatches:
            for bn in self._deferred:
                bn.commit()
        return outputs

    def _needs_grad(self, leaves: list[Any]) -> bool:
        """Would autograd have tracked this partition's forward?"""
        return any(isinstance(x, Tensor) and x.requires_grad for x in leaves) or any(
            p.requires_grad for _, layer in self.layers for p in layer.parameters()
        )

    def _loss(self, step: int, mb: int, outputs: Any, targets: Any) -> Tensor | None:
        if self.loss_fn is None:
            return None
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise TypeError(
                f"loss_fn must return a 0-dim tensor for each micro-batch, got "
                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}"
            )
        scale = self.loss_scale
        if callable(scale):
            scale = scale(self._num_microbatches[step])
        return loss * scale if scale is not None and scale != 1.0 else loss

    def _run_layers(self, step: int, mb: int, x: Any) -> Any:
        seeds = layer_seeds(self.seed, step, mb, self.first_layer_index, len(self.layers))
        with fork_rng([self.device]) if self.restore_rng else nullcontext():
            for offset, ((name, layer), seed) in enumerate(zip(self.layers, seeds, strict=True)):
                seed_rng(seed, self.device)
                x = layer(x)
                if not isinstance(x, Tensor):
                    _check_output(x, self.first_layer_index + offset, name)
        return x

    # -- backward --------------------------------------------------------------------------

    def backward(self, step: int, mb: int, grad_outputs: Grads | None) -> Grads:
        """Backpropagate micro-batch ``mb``; return one gradient (or None) per input leaf.

        ``grad_outputs`` holds one gradient (or None) per output leaf; the last stage of a
        pipeline with a ``loss_fn`` passes None and backpropagates its stored loss.
        """
        saved = self._take(step, mb, "backward")
        with self._rebuilding(saved):
            tensors, grads = self._backward_roots(step, mb, saved, grad_outputs)
            if tensors and tensors[0].requires_grad:
                torch.autograd.backward(tensors, grads)  # type: ignore[arg-type]
        return [
            x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in saved.inputs
        ]

    def backward_input(self, step: int, mb: int, grad_outputs: Grads | None) -> Grads:
        """The first part of a split backward (I): return the gradient of every input leaf
        (or None), as :meth:`backward` does, but leave the parameters' gradient to
        :meth:`backward_weight`; the micro-batch's graph is kept until then."""
        saved = self._saved.get((step, mb))
        if saved is None or saved.pending is not None:
            raise RuntimeError(
                f"stage {self.stage_index} cannot run backward_input for micro-batch {mb} of "
                f"step {step}: {'no forward state' if saved is None else 'it already ran'}"
            )
        with self._rebuilding(saved):
            tensors, grads = self._backward_roots(step, mb, saved, grad_outputs)
            if tensors and not tensors[0].requires_grad:
                tensors, grads = [], []
            input_grads, saved.pending = split_backward_input(
                tensors, grads, saved.inputs, self._parameters_requiring_grad(step)
            )
        return input_grads

    def backward_weight(self, step: int, mb: int) -> None:
        """The second part of a split backward (W): accumulate the parameters' gradient of
        micro-batch ``mb`` into ``.grad``, as :meth:`backward` does; free its state."""
        saved = self._saved.get((step, mb))
        if saved is None or saved.pending is None:
            raise RuntimeError(
                f"stage {self.stage_index} cannot run backward_weight for micro-batch {mb} of "
                f"step {step}: backward_input must run first (and W only once)"
            )
        del self._saved[(step, mb)]
        with torch.enable_grad():
            saved.pending.run()

    def _take(self, step: int, mb: int, what: str) -> _Saved:
        try:
            saved = self._saved.pop((step, mb))
        except KeyError:
            raise RuntimeError(
                f"stage {self.stage_index} has no forward state for micro-batch {mb} of step "
                f"{step}: {what} without forward, or backward twice (retain_graph is not "
                "supported by the pipeline)"
            ) from None
        return saved

    @contextmanager
    def _rebuilding(self, saved: _Saved) -> Iterator[None]:
        """Autograd on; for a re-materialized micro-batch, BatchNorm's running statistics left
        as the first forward left them. The context encloses the backward: a buffer restored
        by copy (BatchNorm subclasses with their own forward) may still be read there. W runs
        outside it; with such a layer, use B (or no re-materialization) instead of I/W."""
        frozen = (frozen_running_stats(self._batchnorms) if saved.outputs is None
                  else nullcontext())
        with torch.enable_grad(), frozen:
            yield

    def _backward_roots(
        self, step: int, mb: int, saved: _Saved, grad_outputs: Grads | None
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        """The tensors to backpropagate from and their gradients; runs a re-materialized
        forward again (and keeps its result for W)."""
        outputs = saved.outputs
        if outputs is None:
            assert saved.autocast is not None  # saved with every re-materialized forward
            with saved.autocast.applied(self.device):
                outputs = self._run_layers(step, mb, unflatten(saved.inputs, saved.spec))
                if self.loss_fn is not None:
                    outputs = self._loss(step, mb, outputs, saved.targets)
            saved.outputs = outputs
        if self.loss_fn is not None:
            assert isinstance(outputs, Tensor)
            if self.grad_scale != 1.0:  # as GradScaler.scale: a float32 0-dim multiplier
                outputs = outputs * torch.tensor(self.grad_scale, dtype=torch.float32,
                                                 device=outputs.device)
            return [outputs], [None]
        if grad_outputs is None:
            raise RuntimeError(f"stage {self.stage_index} needs gradients of its outputs")
        out_leaves, _ = flatten(outputs)
        if len(out_leaves) != len(grad_outputs):
            raise RuntimeError(
                f"stage {self.stage_index} got {len(grad_outputs)} output gradients for "
                f"{len(out_leaves)} outputs of micro-batch {mb}"
            )
        pairs = [
            (o, g)
            for o, g in zip(out_leaves, grad_outputs, strict=True)
            if isinstance(o, Tensor) and o.requires_grad and g is not None
        ]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _parameters_requiring_grad(self, step: int) -> list[Tensor]:
        """This stage's parameters that take gradients, as they are at ``step`` (a module
        changed or frozen between steps is seen at the next)."""
        cached_step, params = self._trainable
        if cached_step != step:
            unique = {id(p): p for _, layer in self.layers for p in layer.parameters()}
            params = [p for p in unique.values() if p.requires_grad]
            self._trainable = (step, params)
        return params


def _as_input_leaf(value: Any, grad_enabled: bool) -> Any:
    if not isinstance(value, Tensor):
        return value
    if grad_enabled and value.requires_grad and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value.detach()


def _mark_requires_grad(outputs: Any) -> Any:
    """Flag floating-point outputs of a forward run without autograd as differentiable.

    The next stage must know which inputs will need gradients although this forward ran under
    ``no_grad``; an output that turns out not to depend on anything differentiable simply gets
    its gradient dropped in backward.
    """
    leaves, spec = flatten(outputs)
    leaves = [
        x.detach().requires_grad_(True) if isinstance(x, Tensor) and x.is_floating_point() else x
        for x in leaves
    ]
    return unflatten(leaves, spec)


def _check_output(output: Any, layer_index: int, name: str) -> None:
    if isinstance(output, Tensor):
        return
    if isinstance(output, tuple | list | dict):
        leaves, _ = flatten(output)
        if any(isinstance(x, Tensor) for x in leaves):
            return
    raise TypeError(
        f"layer {layer_index} ({name!r}) returned {type(output).__name__}; every layer of a "
        "pipeline must return a tensor or a tuple of tensors (non-tensor values may ride along "
        "in the tuple)"
    )
