"""One partition on one device: runs forward and backward actions, keeps per-micro-batch state.

For every micro-batch a stage keeps what its backward will need, and frees it in that backward:

    re-materialized:  the partition's input only; the forward runs again, with autograd, in B
    kept:             the input and the forward's autograd graph
    selective:        (a :class:`~gpipe_core.remat.Remat`) the partition as runs of layers, each
                      from its own detached input: a kept run's graph, a recomputed run's input

A selective micro-batch's backward goes through the runs from the last to the first: a
recomputed run's forward runs again from its input, then autograd takes the gradient from the
run's outputs to its input, which is the gradient of the previous run's outputs::

    input -> [run 0: kept graph] -> leaf -> [run 1: input only] -> leaf -> [run 2: kept] -> out
              B3: backward <- grad   B2: recompute, backward <- grad   B1: backward <- grad_out

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
from .remat import (
    Checkpoint,
    Remat,
    as_checkpoint,
    checkpoint_stop,
    fork_rng,
    layer_seeds,
    seed_rng,
)
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
    runs: list[_Run] | None = None  # selective re-materialization: the runs, in order


@dataclass
class _Run:
    """One run of layers ``[start, stop)`` of a selectively re-materialized micro-batch: its
    detached input leaves and, unless recomputed (None until its backward), its outputs."""

    start: int
    stop: int
    inputs: list[Any]
    spec: Any
    outputs: Any | None
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
        checkpoint: Checkpoint,
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
        self.checkpoint = as_checkpoint(checkpoint)
        # a Remat: this stage's layers as runs (start, stop, kept); None: a mode for all layers
        self._runs: list[tuple[int, int, bool]] | None = None
        if isinstance(self.checkpoint, Remat):
            remat = self.checkpoint
            if stage_index >= remat.num_stages:
                raise ValueError(f"checkpoint gives kept layers for {remat.num_stages} stages; "
                                 f"stage {stage_index} has none: give one set per stage")
            outside = sorted(i for i in remat.keep[stage_index] if i >= len(self.layers))
            if outside:
                raise ValueError(f"checkpoint keeps layers {outside} of stage {stage_index}, "
                                 f"which has {len(self.layers)} layers; indices count from each "
                                 "stage's first layer")
            self._runs = remat.runs(stage_index, len(self.layers))
        self.seed = seed
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        # "bf16"/"fp16": the stage runs its forward under autocast itself; "fp32": as called
        check_precision(precision)
        self.precision = precision
        # fp16 loss scaling: backward starts from the loss times this (the stored loss is not)
        self.grad_scale = 1.0
        checkpoint_stop(self.checkpoint, 1)  # validates the mode early
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
        runs: list[_Run] | None = None
        # "fp32" runs as called: the state just read is the one in force, nothing to enter
        with autocast.applied(self.device) if self.precision != "fp32" else nullcontext():
            if rematerialize and self._runs is not None:
                outputs, loss, kept, runs = self._forward_runs(step, mb, leaves, spec, targets)
            elif rematerialize:
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
                                             autocast if rematerialize else None, runs=runs)
        if loss is not None:
            self.losses[(step, mb)] = loss.detach()
        self._forwards_done[step] += 1
        if self._forwards_done[step] == num_microbatches:
            for bn in self._deferred:
                bn.commit()
        return outputs

    def _forward_runs(self, step: int, mb: int, leaves: list[Any], spec: Any, targets: Any
                      ) -> tuple[Any, Tensor | None, Any, list[_Run]]:
        """The selective forward: each run from its own detached input, a kept run with
        autograd, a recomputed one without (its outputs flagged as differentiable, as a
        re-materialized partition's are). Returns outputs, loss, what the last run keeps (the
        stage's ``_Saved.outputs``, unused by the backward) and the runs."""
        assert self._runs is not None
        needs_grad = self._needs_grad(leaves)
        runs: list[_Run] = []
        outputs: Any = None
        loss: Tensor | None = None
        for start, stop, kept in self._runs:
            if runs:  # the previous run's outputs, detached: this run's input
                leaves, spec = flatten(outputs)
                leaves = [_as_input_leaf(x, True) for x in leaves]
            last = stop == len(self.layers)
            with nullcontext() if kept else torch.no_grad():
                outputs = self._run_layers(step, mb, unflatten(leaves, spec), start, stop)
                if last:
                    loss = self._loss(step, mb, outputs, targets)
            if not kept and needs_grad:
                outputs = _mark_requires_grad(outputs)
            held = (loss if loss is not None else outputs) if kept else None
            runs.append(_Run(start, stop, leaves, spec, held))
        return outputs, loss, runs[-1].outputs, runs

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

    def _run_layers(self, step: int, mb: int, x: Any, start: int = 0,
                    stop: int | None = None) -> Any:
        """Layers ``[start, stop)`` of the stage (default all) on ``x``, each seeded."""
        if torch.is_grad_enabled() and torch.is_autocast_enabled(self.device.type):
            x = _not_leaves(x)
        layers = self.layers[start:stop]
        seeds = layer_seeds(self.seed, step, mb, self.first_layer_index + start, len(layers))
        with fork_rng([self.device]) if self.restore_rng else nullcontext():
            for offset, ((name, layer), seed) in enumerate(zip(layers, seeds, strict=True),
                                                          start=start):
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
        if saved.runs is not None:
            return self._backward_runs(step, mb, saved, grad_outputs, split=False)
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
        if saved.runs is not None:
            return self._backward_runs(step, mb, saved, grad_outputs, split=True)
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
            for run in reversed(saved.runs or []):  # selective: each run's own part, last first
                assert run.pending is not None
                run.pending.run()
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
        recomputes = (saved.outputs is None if saved.runs is None
                      else any(run.outputs is None for run in saved.runs))
        frozen = frozen_running_stats(self._batchnorms) if recomputes else nullcontext()
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
        return self._roots(mb, outputs, grad_outputs, self.loss_fn is not None)

    def _roots(self, mb: int, outputs: Any, grad_outputs: Grads | None, is_loss: bool
               ) -> tuple[list[Tensor], list[Tensor | None]]:
        """The tensors of ``outputs`` to backpropagate from (the loss, or the outputs that
        require grad and have a gradient) and their gradients."""
        if is_loss:
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

    def _backward_runs(self, step: int, mb: int, saved: _Saved, grad_outputs: Grads | None,
                       *, split: bool) -> Grads:
        """A selective micro-batch's backward (B), or its I (``split``: each run's W kept in
        the run), through the runs from the last to the first; returns the input gradients."""
        assert saved.runs is not None
        grads = grad_outputs
        params = self._parameters_requiring_grad(step)
        later: _Run | None = None  # the run backpropagated before this one
        with self._rebuilding(saved):
            for run in reversed(saved.runs):
                outputs = run.outputs
                last = run.stop == len(self.layers)
                if outputs is None:
                    assert saved.autocast is not None  # saved with every selective forward
                    with saved.autocast.applied(self.device):
                        outputs = self._run_layers(step, mb, unflatten(run.inputs, run.spec),
                                                   run.start, run.stop)
                        if last and self.loss_fn is not None:
                            outputs = self._loss(step, mb, outputs, saved.targets)
                    run.outputs = outputs
                tensors, root_grads = self._roots(mb, outputs, grads,
                                                  last and self.loss_fn is not None)
                if split:
                    if tensors and not tensors[0].requires_grad:
                        tensors, root_grads = [], []
                    mine = {id(p) for _, layer in self.layers[run.start:run.stop]
                            for p in layer.parameters()}
                    grads, run.pending = split_backward_input(
                        tensors, root_grads, run.inputs, [p for p in params if id(p) in mine])
                else:
                    if tensors and tensors[0].requires_grad:
                        torch.autograd.backward(tensors, root_grads)  # type: ignore[arg-type]
                    grads = [x.grad if isinstance(x, Tensor) and x.requires_grad else None
                             for x in run.inputs]
                    run.outputs = None  # this run's graph is spent; free it now
                # Free what is spent before the next run is rebuilt: this run's outputs and
                # their gradients, and the gradients of the later run's inputs it received.
                del outputs, tensors, root_grads
                if later is not None:
                    for x in later.inputs:
                        if isinstance(x, Tensor):
                            x.grad = None
                later = run
        if split:  # W runs every run's part; the stage-level part has nothing to do
            saved.pending = PendingWeights([], {})
        assert grads is not None
        return grads

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


def _not_leaves(inputs: Any) -> Any:
    """The input leaves that take a gradient, as views (which autograd passes through).

    Autocast caches its cast of a leaf that requires grad (meant for weights): every use then
    shares one cast, and the gradients of those uses are summed in bf16 before the cast back.
    A stage's inputs are such leaves only because the pipeline cut the graph there; in the
    plain module they are intermediate tensors, each use cast on its own and the gradients
    summed in float32. Without this, a cut between two uses of a tensor (an encoder's output
    read by two decoder layers) changed the gradients under autocast."""
    leaves, spec = flatten(inputs)
    return unflatten([x.view_as(x) if isinstance(x, Tensor) and x.is_leaf and x.requires_grad
                      else x for x in leaves], spec)


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
