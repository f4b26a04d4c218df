"""GPipe: the drop-in single-process pipeline module (``loss.backward()`` just works).

``forward`` scatters the mini-batch into micro-batches and runs every stage's forward actions
in clock order. The output is returned through one autograd function, ``_PipelineBackward``;
when autograd reaches it, it runs the backward actions of the same schedule::

    user input ──► [stage 0 F] ─► [stage 1 F] ─► ... ─► gather ─► _PipelineBackward ─► output
                                                                            │
    input grads ◄── [stage 0 B] ◄─ [stage 1 B] ◄─ ... ◄── scatter ◄── grad_output (backward)

Each backward action backpropagates one stage's graph for one micro-batch (recomputing it first
when re-materialized) and accumulates into that stage's parameters' ``.grad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .batchnorm import DeferredBatchNorm
from .microbatch import flatten, gather, scatter, unflatten
from .partition import split_module, verify_module
from .precision import check_precision
from .remat import Checkpoint, check_pipeline_args
from .runtime import StageRuntime, StepCounter, StepState
from .schedule import Action, Schedule, fill_drain
from .stage import Stage
from .transport import LocalTransport, Mailbox

__all__ = ["GPipe"]

Device = torch.device | str | int
_TENSOR = object()  # marks a tensor leaf of the pipeline's output


class GPipe(StepCounter, nn.Module):
    """Pipeline-parallel wrapper of an ``nn.Sequential`` for one process (one or many devices).

    Args:
        module: the network as ``nn.Sequential``; each layer takes and returns a tensor or a
            tuple of tensors (non-tensor values may ride along in the tuple).
        balance: layers per partition, e.g. ``[3, 5]``; see ``balance_by_time``.
        devices: one device per partition (default: all on CPU). Several partitions may share a
            device (the paper's "Pipeline-1").
        chunks: number of micro-batches M; a batch smaller than M uses one per sample.
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` or ``"never"``; or
            per stage the layers whose activations are kept, the rest recomputed in backward
            (a :class:`~gpipe_core.Remat`, or one set of layer indices within the stage per
            stage: ``[{0, 1}, set()]``).
        deferred_batch_norm: track BatchNorm running statistics over the whole mini-batch.
        seed: base of the per-layer random streams (default: ``torch.initial_seed()``).
        precision: ``"fp32"`` runs as called (under the caller's ``torch.autocast``, if any);
            ``"bf16"`` or ``"fp16"`` runs every stage under autocast to that dtype on its
            device. Either way a re-materialized forward is recomputed in the autocast state
            its first forward ran in (:mod:`gpipe_core.precision`). With ``"fp16"`` scale the
            loss as usual: ``torch.amp.GradScaler`` works through the pipeline unchanged.

    Parameter names and ``state_dict`` keys are those of ``module``.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int],
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: Checkpoint | Sequence[Collection[int]] = "except_last",
        deferred_batch_norm: bool = False,
        seed: int | None = None,
        precision: str = "fp32",
    ) -> None:
        super().__init__()
        verify_module(module)
        checkpoint = check_pipeline_args(chunks=chunks, checkpoint=checkpoint, balance=balance)
        check_precision(precision)
        partitions = split_module(module, balance)
        if devices is None:
            devices = ["cpu"] * len(partitions)
        if len(devices) != len(partitions):
            raise ValueError(
                f"len(devices)={len(devices)} does not match len(balance)={len(partitions)}; "
                "give one device per partition (the same device may repeat)"
            )
        if deferred_batch_norm:
            DeferredBatchNorm.convert(module)
            partitions = split_module(module, balance)
        # Register the layers under their original names so parameters and state_dict keys are
        # exactly the plain module's.
        for name, layer in module._modules.items():
            self.add_module(name, layer)
        self.balance = list(balance)
        self.devices = [
            torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices
        ]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.precision = precision
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self._step = 0
        self.stages: list[Stage] = []
        first = 0
        for index, (partition, device) in enumerate(zip(partitions, self.devices, strict=True)):
            for _, layer in partition:
                layer.to(device)
            self.stages.append(
                Stage(
                    partition,
                    stage_index=index,
                    num_stages=len(partitions),
                    first_layer_index=first,
                    device=device,
                    checkpoint=checkpoint,
                    seed=self.seed,
                    precision=precision,
                )
            )
            first += len(partition)

    def __len__(self) -> int:
        return sum(self.balance)

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # Moving the whole pipeline to one device would undo the partitioning.
    def cuda(self, device: Any = None) -> GPipe:  # type: ignore[override]
        raise TypeError("GPipe places its partitions itself; pass devices=[...] instead of .cuda()")

    def cpu(self) -> GPipe:  # type: ignore[override]
        raise TypeError("GPipe places its partitions itself; pass devices=[...] instead of .cpu()")

    def to(self, *args: Any, **kwargs: Any) -> GPipe:  # type: ignore[override]
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise TypeError(
                f"GPipe places its partitions itself; cannot move it to {device}; pass "
                "devices=[...] when building it (dtype conversion with .to(dtype) is fine)"
            )
        return super().to(*args, **kwargs)

    def schedule(self, num_microbatches: int) -> Schedule:
        """The schedule a forward with ``num_microbatches`` micro-batches runs (fill-drain)."""
        return fill_drain(self.num_stages, num_microbatches)

    def forward(self, inputs: Any) -> Any:
        microbatches = scatter(inputs, self.chunks)
        num_microbatches = len(microbatches)
        step = self._step
        self._step += 1
        first_device = self.devices[0]
        state = StepState(step, num_microbatches, backward=torch.is_grad_enabled())
        state.inputs = [
            unflatten([_to(x, first_device) for x in flatten(mb)[0]], flatten(mb)[1])
            for mb in microbatches
        ]
        mailbox: Mailbox = {}
        runtimes = [
            StageRuntime(stage, LocalTransport(stage.stage_index, self.devices, mailbox))
            for stage in self.stages
        ]
        for runtime in runtimes:
            runtime.begin_step(state)
        clock = self.schedule(num_microbatches).clock()
        forward_actions = [a for tick in clock for a in tick if a.kind == "F"]
        backward_actions = [a for tick in clock for a in tick if a.kind == "B"]
        for action in forward_actions:
            runtimes[action.stage].run_action(action, state)
        outputs = [state.outputs.pop(mb) for mb in range(num_microbatches)]
        if not torch.is_grad_enabled():
            for stage in self.stages:
                stage.discard(step)
            return gather(outputs)
        return _connect(self, runtimes, backward_actions, state, inputs, outputs)


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device, non_blocking=True) if isinstance(value, Tensor) else value


class _Run:
    """One forward whose backward is pending; frees the stages' state if it is dropped."""

    def __init__(
        self,
        runtimes: list[StageRuntime],
        backward_actions: list[Action],
        state: StepState,
        input_leaves: list[Any],
        input_positions: list[int],
        mb_sizes: list[int],
        output_spec: Any,
        output_mb_sizes: list[list[int] | None],
    ) -> None:
        self.runtimes = runtimes
        self.backward_actions = backward_actions
        self.state = state
        self.input_leaves = input_leaves
        self.input_positions = input_positions
        self.mb_sizes = mb_sizes
        self.output_spec = output_spec
        self.output_mb_sizes = output_mb_sizes
        self.output_leaves: list[Any] = []  # set by _PipelineBackward.forward, read by _connect
        stages = [r.stage for r in runtimes]
        weakref.finalize(self, _discard, stages, state.step)


def _discard(stages: list[Stage], step: int) -> None:
    for stage in stages:
        stage.discard(step)


def _connect(
    pipe: GPipe,
    runtimes: list[StageRuntime],
    backward_actions: list[Action],
    state: StepState,
    inputs: Any,
    outputs: list[Any],
) -> Any:
    """Gather the micro-batch outputs and tie them to the pipeline's backward."""
    input_leaves, _ = flatten(inputs)
    input_positions = [
        i for i, x in enumerate(input_leaves) if isinstance(x, Tensor) and x.requires_grad
    ]
    flat_outputs = [flatten(out) for out in outputs]
    output_spec = flat_outputs[0][1]
    num_leaves = len(flat_outputs[0][0])
    output_mb_sizes: list[list[int] | None] = []
    for i in range(num_leaves):
        leaf = flat_outputs[0][0][i]
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            output_mb_sizes.append([leaves[i].size(0) for leaves, _ in flat_outputs])
        else:
            output_mb_sizes.append(None)
    mb_sizes = [len(flatten(mb)[0]) for mb in state.inputs]
    run = _Run(
        runtimes,
        backward_actions,
        state,
        input_leaves,
        input_positions,
        mb_sizes,
        output_spec,
        output_mb_sizes,
    )
    state.outputs = {mb: out for mb, out in enumerate(outputs)}
    phony = torch.empty(0, requires_grad=True)
    grad_inputs = [input_leaves[i] for i in input_positions]
    results = iter(_PipelineBackward.apply(run, phony, *grad_inputs))
    # The gathered output's non-tensor leaves, with _TENSOR where _PipelineBackward's tensors go.
    leaves, run.output_leaves = run.output_leaves, []
    return unflatten([next(results) if x is _TENSOR else x for x in leaves], output_spec)


def _gather_leaves(outputs: list[Any]) -> list[Any]:
    leaves, _ = flatten(gather([_detached(out) for out in outputs]))
    return leaves


def _detached(batch: Any) -> Any:
    leaves, spec = flatten(batch)
    return unflatten([x.detach() if isinstance(x, Tensor) else x for x in leaves], spec)


class _PipelineBackward(torch.autograd.Function):
    """Outputs of the whole pipeline; its backward runs the schedule's backward actions."""

    @staticmethod
    def forward(ctx: Any, run: _Run, phony: Tensor, *grad_inputs: Tensor) -> Any:  # type: ignore[override]
        ctx.run = run
        outputs = [run.state.outputs[mb] for mb in range(run.state.num_microbatches)]
        run.state.outputs = {}
        leaves = _gather_leaves(outputs)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        if not tensors:
            raise TypeError("the pipeline's output holds no tensor")
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        ctx.num_tensors = len(tensors)
        ctx.tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        run.output_leaves = [_TENSOR if isinstance(x, Tensor) else x for x in leaves]
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> Any:
        run: _Run = ctx.run
        state = run.state
        num_microbatches = state.num_microbatches
        num_leaves = len(run.output_mb_sizes)
        per_mb: list[list[Tensor | None]] = [[None] * num_leaves for _ in range(num_microbatches)]
        for position, grad in zip(ctx.tensor_positions, grad_outputs, strict=True):
            if grad is None:
                continue
            sizes = run.output_mb_sizes[position]
            if sizes is None:  # a 0-dim output shared by all micro-batches: credit it once
                per_mb[0][position] = grad
                continue
            for mb, piece in enumerate(grad.split(sizes)):
                per_mb[mb][position] = piece
        for mb in range(num_microbatches):
            last_device = run.runtimes[-1].stage.device
            state.output_grads[mb] = [
                g.to(last_device) if g is not None else None for g in per_mb[mb]
            ]
        for action in run.backward_actions:
            run.runtimes[action.stage].run_action(action, state)
        # Gradients of the user's inputs: concatenate the micro-batch pieces.
        results: list[Tensor | None] = []
        for position in run.input_positions:
            leaf = run.input_leaves[position]
            pieces = [state.input_grads[mb][position] for mb in range(num_microbatches)]
            if leaf.dim() == 0:
                present = [p for p in pieces if p is not None]
                results.append(torch.stack(present).sum(0) if present else None)
                continue
            mb_inputs = [flatten(state.inputs[mb])[0][position] for mb in range(num_microbatches)]
            filled = [
                p if p is not None else torch.zeros_like(x)
                for p, x in zip(pieces, mb_inputs, strict=True)
            ]
            if all(p is None for p in pieces):
                results.append(None)
            else:
                results.append(torch.cat([f.to(leaf.device) for f in filled]))
        state.input_grads.clear()
        return (None, None, *results)
