"""Cutting a module that is not an ``nn.Sequential`` into one that is: ``gp.sequentialize``.

The module's forward is traced with ``torch.export`` (a dynamic batch dimension, once in
training and once in evaluation mode), the traced operations are cut at split points, and each
piece becomes a layer (:class:`~gpipe_core.sequentializer.segment.Segment`) of an
``nn.Sequential`` that ``GPipe``, ``DistributedGPipe``, the balancers and the checkpoint
functions take unchanged::

    seq = gp.sequentialize(model, (), {"input_ids": ids, "attention_mask": mask})
    pipe = gp.GPipe(seq, gp.balance_by_params(seq, 2), chunks=4)
    out = pipe(seq.inputs(input_ids=ids, attention_mask=mask))   # {"logits": ...}

Every value live across a cut (residual stream, masks, rotary tables, a U-Net's skips, a
weight two modules share) travels in the tuple between layers; ``seq.cuts`` reports what and
how many bytes. Parameters keep their original names in ``state_dict()`` (see
:mod:`.segment`). See docs/SEQUENTIALIZE.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..partition import optimal_balance
from .cuts import (
    Cutting,
    SplitPoint,
    body_nodes,
    cut_graph,
    cut_positions,
    default_split_points,
    module_paths,
)
from .program import build_programs, check_in_place, value_bytes
from .segment import InputSpec, Segment, TensorTable, build_tree, install_naming_hooks
from .tracing import SequentializeError, Shared, export_module, unwrap_shared

__all__ = ["sequentialize", "Sequentialized", "Shared", "SequentializeError", "Cut"]


@dataclass(frozen=True)
class Cut:
    """The values sent from layer ``after`` to the next (in training mode), and their size
    for the example's batch."""

    after: int
    values: tuple[str, ...]
    bytes: int
    batch_size: int

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes / self.batch_size


class Sequentialized(nn.Sequential):
    """The ``nn.Sequential`` :func:`sequentialize` returns: one :class:`Segment` per layer,
    named ``seg0``, ``seg1``, ...; ``state_dict()`` keys are the original module's."""

    def __init__(self, segments: Sequence[Segment], cuts: Sequence[Cut],
                 input_spec: InputSpec, tied: tuple[str, str] | None = None) -> None:
        super().__init__(OrderedDict((segment.layer_name, segment) for segment in segments))
        self.cuts = list(cuts)
        self.input_spec = input_spec
        # with tied_weights="ends": (first layer's name, last layer's name) of the shared
        # weight, for DistributedGPipe(..., tied=seq.tied); else None
        self.tied = tied

    def inputs(self, *args: Any, **kwargs: Any) -> Any:
        """What to give the pipeline (``pipe(seq.inputs(...))``, ``pipe.step(seq.inputs(...),
        targets)``) for the call ``model(*args, **kwargs)``: the single tensor, the tuple of
        positional arguments, the dict of keyword arguments, or ``(args, kwargs)``, as the
        example was given."""
        return self.input_spec.pack(args, kwargs)

    def describe(self) -> str:
        """One line per layer: where it starts, its parameters, and the bytes it sends on."""
        lines = []
        for index, segment in enumerate(self):
            assert isinstance(segment, Segment)
            params = sum(p.numel() for p in segment.parameters())
            sent = ""
            if index < len(self.cuts):
                cut = self.cuts[index]
                sent = (f", sends {len(cut.values)} values, {cut.bytes} bytes "
                        f"({cut.bytes_per_sample:.0f} per sample)")
            lines.append(f"{segment.layer_name}: starts at {segment.label!r}, {params} "
                         f"parameters{sent}")
        return "\n".join(lines)


def sequentialize(
    module: nn.Module,
    example_args: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    split_points: Sequence[str] | None = None,
    parts: int | None = None,
    tied_weights: str = "carry",
) -> Sequentialized:
    """``module`` as an ``nn.Sequential`` of segments that computes what ``module`` does.

    Args:
        module: any module ``torch.export`` can trace (on any device, ``meta`` included; in
            the dtype it will run in). Its parameters are shared, not copied.
        example_args: positional arguments of one call (a tuple; a lone tensor is one
            argument). Tensors with at least one dimension have the batch along dim 0 and
            are split into micro-batches; wrap a tensor that has no batch dimension in
            :class:`Shared`. Non-tensor values are fixed by the trace.
        example_kwargs: keyword arguments of one call.
        split_points: module paths to cut before (``["transformer.h.2", "lm_head"]``).
            Default: before every block of the outermost repeated containers
            (``nn.ModuleList`` / ``nn.Sequential``) and after each such container.
        parts: merge the segments into this many layers, balanced by parameters.
        tied_weights: a tensor two modules share (GPT-2's ``wte`` and ``lm_head``) used in
            several layers. ``"carry"`` (default): the first layer using it holds it and sends
            it on with the activations, its gradient comes back the same way; works with
            GPipe and DistributedGPipe, any balance and schedule, at the cost of sending the
            weight across every cut per micro-batch. ``"ends"``: the first and the last layer
            each hold it under their own name, for ``DistributedGPipe(..., tied=seq.tied)``,
            which keeps the two copies equal and sums their gradients once per step (GPipe
            refuses a weight shared by two partitions).

    Raises :class:`SequentializeError` for what cannot be cut (data-dependent control flow,
    an in-place update of a value that crosses a cut, a module called again in another
    segment), naming the node, the module path and the fix.
    """
    if tied_weights not in ("carry", "ends"):
        raise ValueError(f"tied_weights={tied_weights!r} must be 'carry' or 'ends'")
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    install_naming_hooks()
    table = TensorTable(module)
    trace_device = _trace_device(module, (args, kwargs))
    batch_size = _batch_size((args, kwargs))
    programs = {mode: export_module(module, args, kwargs, training=mode)
                for mode in (True, False)}
    points = _split_points(module, split_points)
    train = _Traced(programs[True], table)
    kept = _kept_points(train, points, strict=split_points is not None)
    cutting, owners = _cut(train, kept, table)
    if parts is not None:
        kept = _merge(kept, cutting, owners, table, parts)
        cutting, owners = _cut(train, kept, table)
    num_segments = cutting.num_segments
    ghosts = set(table.aliases)  # second names of shared tensors, written as aliases
    tied: tuple[str, str] | None = None
    ends: dict[bool, dict[fx.Node, dict[int, str]]] = {True: {}, False: {}}
    if tied_weights == "ends":
        for canonical, by_segment in _tied_at_ends(train, cutting, table).items():
            ghosts -= set(by_segment.values())
            owners = {**{p: s for p, s in owners.items() if p != canonical},
                      **{path: s for s, path in by_segment.items()}}
            last = num_segments - 1
            tied = (f"seg0.{by_segment[0]}", f"seg{last}.{by_segment[last]}")
            node = next(n for n, p in train.param_key.items() if p == canonical)
            ends[True][node] = by_segment
        cutting = cut_graph(train.graph, [p for _, p in kept], owners, train.param_key,
                            local=ends[True])
    labels = [_label(train.body)] + [point[1] if point[0] == "before" else f"after {point[1]}"
                                         for point, _ in kept]
    names = [f"seg{i}" for i in range(num_segments)]
    _check_calls(train, cutting, labels)
    check_in_place(train.graph, cutting, labels)
    evaluation = _Traced(programs[False], table)
    for node, path in evaluation.param_key.items():
        for tied_node, by_segment in ends[True].items():
            if train.param_key[tied_node] == path:
                ends[False][node] = by_segment
    eval_positions = cut_positions(evaluation.body, [point for point, _ in kept], strict=False)
    if any(p is None for p in eval_positions) or eval_positions != sorted(eval_positions):  # type: ignore[type-var]
        raise SequentializeError(
            f"the split points {[point[1] for point, _ in kept]} fall at {eval_positions} in "
            "the evaluation-mode trace (None: the module does not run in evaluation mode); "
            "choose split_points at modules that run in both modes"
        )
    eval_cutting = cut_graph(evaluation.graph, [p for p in eval_positions if p is not None],
                             owners, evaluation.param_key, local=ends[False])
    check_in_place(evaluation.graph, eval_cutting, labels)
    compiled = {
        mode: build_programs(traced.graph, cut, root=module, param_path=traced.param_key,
                             constant_of=traced.constant_of, user_inputs=traced.user_inputs,
                             trace_device=trace_device, mode="training" if mode else "eval",
                             ends=ends[mode])
        for mode, traced, cut in ((True, train, cutting), (False, evaluation, eval_cutting))
    }
    input_spec = InputSpec(args, kwargs, _in_spec(args, kwargs))
    segments = []
    for s in range(num_segments):
        aliases = {alias: canonical for alias, canonical in table.aliases.items()
                   if alias in ghosts and owners.get(canonical) == s
                   and table.persistent.get(alias, True)}
        constants = {**train.constants, **evaluation.constants}
        segment = Segment(
            index=s, num_segments=num_segments, name=names[s], label=labels[s],
            programs={mode: compiled[mode][s] for mode in (True, False)},
            constants=constants, aliases=aliases,
            inputs=input_spec if s == 0 else None,
            output_spec=train.out_spec if s == num_segments - 1 else None,
        )
        build_tree(segment, module, "", ghosts, owners, s)
        segment.train(module.training)
        segments.append(segment)
    cuts = [Cut(after=s, values=tuple(n.name for n in cutting.crossing[s]),
                bytes=sum(value_bytes(n, batch_size) for n in cutting.crossing[s]),
                batch_size=batch_size)
            for s in range(num_segments - 1)]
    return Sequentialized(segments, cuts, input_spec, tied)


def _tied_at_ends(traced: _Traced, cutting: Cutting, table: TensorTable
                  ) -> dict[str, dict[int, str]]:
    """For ``tied_weights="ends"``: the tensor shared by a module of the first layer and one
    of the last, and the name each layer holds it under (canonical path -> {segment: path})."""
    last = cutting.num_segments - 1
    result: dict[str, dict[int, str]] = {}
    for node, canonical in traced.param_key.items():
        names = [canonical] + [a for a, c in table.aliases.items() if c == canonical]
        segments = sorted({cutting.segment_of[u] for u in node.users if u in cutting.segment_of})
        if len(names) < 2 or len(segments) < 2:
            continue
        if segments != [0, last]:
            raise SequentializeError(
                f"tied_weights='ends': the tensor {names} is used in layers {segments}, but "
                f"DistributedGPipe ties a weight between the first and the last layer (0 and "
                f"{last}) only; use tied_weights='carry'"
            )
        by_segment: dict[int, str] = {}
        for segment in (0, last):
            called = {path for u in node.users if cutting.segment_of.get(u) == segment
                      for _, path in module_paths(u)}
            owned = [n for n in names if n.rpartition(".")[0] in called]
            if not owned:
                raise SequentializeError(
                    f"tied_weights='ends': no module holding {names} runs in layer {segment}; "
                    "use tied_weights='carry'"
                )
            by_segment[segment] = owned[0]
        result[canonical] = by_segment
    if len(result) > 1:
        raise SequentializeError(
            f"tied_weights='ends': {len(result)} tied tensors ({sorted(result)}); "
            "DistributedGPipe ties one; use tied_weights='carry'"
        )
    return result


def _split_points(module: nn.Module, split_points: Sequence[str] | None) -> list[SplitPoint]:
    """The user's split points (checked to name submodules), or the default ones."""
    if split_points is not None:
        for path in split_points:
            try:
                module.get_submodule(path)
            except AttributeError:
                raise SequentializeError(
                    f"split point {path!r} is not a submodule of {type(module).__name__}; "
                    "give module paths as in named_modules(), e.g. 'transformer.h.2'"
                ) from None
        return [("before", p) for p in split_points]
    points = default_split_points(module)
    if not points:
        raise SequentializeError(
            f"{type(module).__name__} has no repeated blocks (an nn.ModuleList or "
            "nn.Sequential of two or more modules) to cut between; pass split_points=[...] "
            "naming the modules to cut before"
        )
    return points


def _kept_points(traced: _Traced, points: list[SplitPoint], *, strict: bool
                 ) -> list[tuple[SplitPoint, int]]:
    """The split points that cut somewhere (not at either end, not where another one cuts),
    with their positions; user split points out of program order are an error."""
    kept: list[tuple[SplitPoint, int]] = []
    positions = cut_positions(traced.body, points, strict=strict)
    for point, position in zip(points, positions, strict=True):
        if position is None or position <= 0 or position >= len(traced.body):
            continue
        if kept and position <= kept[-1][1]:
            if position < kept[-1][1]:
                raise SequentializeError(
                    f"split points out of program order: {point[1]!r} runs before "
                    f"{kept[-1][0][1]!r}; list split_points in the order the forward runs them"
                )
            continue
        kept.append((point, position))
    return kept


def _cut(traced: _Traced, kept: list[tuple[SplitPoint, int]], table: TensorTable
         ) -> tuple[Cutting, dict[str, int]]:
    """The graph cut at ``kept``, and the segment owning every tensor (unused ones too)."""
    positions = [p for _, p in kept]
    owners = table.owners(_used(traced, cut_graph(traced.graph, positions, None,
                                                  traced.param_key)))
    return cut_graph(traced.graph, positions, owners, traced.param_key), owners


class _Traced:
    """One exported program, read: its placeholders by kind, its operations in order."""

    def __init__(self, program: ExportedProgram, table: TensorTable) -> None:
        self.graph: fx.Graph = program.graph
        self.param_key: dict[fx.Node, str] = {}  # placeholder -> canonical path
        self.constant_of: dict[fx.Node, str] = {}
        self.constants: dict[str, Tensor] = {}
        self.user_inputs: list[fx.Node] = []
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        first_of: dict[str, fx.Node] = {}
        for spec in program.graph_signature.input_specs:
            node = placeholders[spec.arg.name]  # type: ignore[union-attr]
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                assert spec.target is not None
                path = table.aliases.get(spec.target, spec.target)
                if path in first_of:  # a second name of a shared tensor: one value
                    node.replace_all_uses_with(first_of[path])
                    continue
                first_of[path] = node
                self.param_key[node] = path
                node.meta["sequentialize_param"] = True
            elif spec.kind is InputKind.CONSTANT_TENSOR:
                assert spec.target is not None
                self.constant_of[node] = spec.target
                self.constants[spec.target] = program.constants[spec.target]  # type: ignore[assignment]
                node.meta["sequentialize_constant"] = True
            elif spec.kind is InputKind.USER_INPUT:
                self.user_inputs.append(node)
            else:
                raise SequentializeError(
                    f"the trace has an input {spec.arg.name!r} of kind {spec.kind.name}, which "
                    "gp.sequentialize does not support (script objects, effect tokens)"
                )
        for out in program.graph_signature.output_specs:
            if out.kind is not OutputKind.USER_OUTPUT:
                raise SequentializeError(
                    f"the traced forward writes {out.target!r} ({out.kind.name}); "
                    "gp.sequentialize supports forwards that only return values (and "
                    "BatchNorm's running statistics)"
                )
        self.out_spec = program.call_spec.out_spec
        self.body = body_nodes(self.graph)


def _used(traced: _Traced, cutting: Cutting) -> dict[str, int]:
    return {path: cutting.segment_of[node] for node, path in traced.param_key.items()
            if node.users}


def _merge(kept: list[tuple[SplitPoint, int]], cutting: Cutting, owners: dict[str, int],
           table: TensorTable, parts: int) -> list[tuple[SplitPoint, int]]:
    """Join adjacent segments into ``parts`` layers, balancing parameters."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts={parts!r} must be a positive integer")
    if parts > cutting.num_segments:
        raise SequentializeError(
            f"parts={parts} but the split points give only {cutting.num_segments} segments; "
            "ask for fewer parts or give more split_points"
        )
    costs = [0.0] * cutting.num_segments
    for path, segment in owners.items():
        costs[segment] += table.tensors[path].numel()
    sizes = optimal_balance(costs, parts)
    result = []
    boundary = 0
    for size in sizes[:-1]:
        boundary += size
        result.append(kept[boundary - 1])
    return result


def _check_calls(traced: _Traced, cutting: Cutting, labels: list[str]) -> None:
    """A module with parameters that is called again in another segment would need its
    parameters in two layers: refuse, naming the module, the nodes and the fix."""
    holders = {path.rsplit(".", 1)[0] if "." in path else "" for path in traced.param_key.values()}
    calls: dict[str, dict[str, tuple[int, str]]] = {}
    for node in traced.body:
        for key, path in module_paths(node):
            if path in holders:
                calls.setdefault(path, {}).setdefault(key, (cutting.segment_of[node], node.name))
    for path, by_call in calls.items():
        segments = {segment for segment, _ in by_call.values()}
        if len(by_call) > 1 and len(segments) > 1:
            where = ", ".join(f"node {name!r} in segment {s} ({labels[s]})"
                              for s, name in sorted(by_call.values()))
            raise SequentializeError(
                f"module {path!r} is called {len(by_call)} times across a cut ({where}); its "
                "parameters can live in one layer only: change split_points so that its calls "
                "fall in one segment, or give each call its own module (tie their weights "
                "explicitly if they must share them)"
            )


def _label(body: list[fx.Node]) -> str:
    """Where the first segment starts: the first module that runs."""
    for node in body:
        paths = [path for _, path in module_paths(node) if path]
        if paths:
            return paths[-1]
    return "<input>"


def _trace_device(module: nn.Module, inputs: Any) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for leaf in pytree.tree_leaves(unwrap_shared(inputs)):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")


def _batch_size(inputs: Any) -> int:
    for leaf in pytree.tree_leaves(inputs, is_leaf=lambda x: isinstance(x, Shared)):
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise SequentializeError(
        "the example has no tensor with a batch dimension (dim 0 of a tensor with at least "
        "one dimension); give one example batch of at least 2 samples"
    )


def _in_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> pytree.TreeSpec:
    return pytree.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, Shared))[1]
