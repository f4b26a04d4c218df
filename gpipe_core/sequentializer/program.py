"""One segment's code: the traced operations of one segment as a compiled Python function.

A segment's function is ``forward(self, device_, *incoming, *constants, *tensors)``:
``incoming`` are the values the previous segment sent (for the first segment, the user's
input leaves); ``tensors`` the segment's parameters and buffers, which the segment reads from
their modules at each call (so they follow ``.to()``, materialization and loading); ``self``
the segment module, for the layers called as modules (BatchNorm). It returns the tuple of
values the next segment needs (for the last, the output leaves).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .cuts import ASSERTS, Cutting, body_nodes, innermost
from .tracing import SequentializeError

__all__ = ["SegmentProgram", "build_programs", "value_bytes"]


@dataclass
class SegmentProgram:
    """A segment's compiled forward and what it reads and writes."""

    fn: Callable[..., tuple[Any, ...]]
    code: str
    incoming: list[str]  # names of the values it receives
    outgoing: list[str]  # names of the values it returns
    constants: list[str]  # names of the trace's constant tensors it reads
    tensors: list[str]  # paths of the parameters and buffers it reads, in the segment


def value_bytes(node: fx.Node, batch_size: int) -> int:
    """Bytes of a node's value at the example's batch size (0 for non-tensors)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    numel = 1
    for size in value.shape:
        if isinstance(size, torch.SymInt):
            hint = size.node.hint
            numel *= int(hint) if hint is not None else batch_size
        else:
            numel *= int(size)
    return numel * value.element_size()


def _write_targets(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values ``node`` updates in place (through views, their bases)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return []
    written = []
    for argument, value in zip(target._schema.arguments, node.args, strict=False):
        if argument.alias_info is not None and argument.alias_info.is_write and isinstance(
                value, fx.Node):
            written.append(_base(value))
    for name, value in node.kwargs.items():
        schema_arg = next((a for a in target._schema.arguments if a.name == name), None)
        if schema_arg is not None and schema_arg.alias_info is not None and (
                schema_arg.alias_info.is_write) and isinstance(value, fx.Node):
            written.append(_base(value))
    return written


def _base(node: fx.Node) -> fx.Node:
    """Follow views (ops whose output aliases their first input) back to the viewed value."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        arguments = node.target._schema.arguments
        if not (returns and returns[0].alias_info is not None and arguments
                and arguments[0].alias_info is not None
                and not arguments[0].alias_info.is_write
                and isinstance(node.args[0], fx.Node)):
            break
        node = node.args[0]
    return node


def check_in_place(graph: fx.Graph, cutting: Cutting, names: list[str]) -> None:
    """An in-place update of a value another segment made (or of a user input) would change
    the value a re-materialized forward reads again, and a received value is a leaf of
    autograd: refuse it, naming the node, the module and the fix."""
    for node in body_nodes(graph):
        segment = cutting.segment_of[node]
        for written in _write_targets(node):
            if written.op == "placeholder" and written.meta.get("sequentialize_param"):
                continue  # a buffer updated by its owner (a counter): the owner's own state
            source = cutting.segment_of.get(written, 0)
            from_user = written.op == "placeholder"
            if source == segment and not from_user:
                continue
            where = innermost(node) or "<top level>"
            origin = ("the model's input" if from_user else
                      f"segment {source} ({names[source]})")
            raise SequentializeError(
                f"in-place update across a cut: node {node.name!r} ({node.target}) in module "
                f"{where!r} (segment {segment}, {names[segment]}) updates {written.name!r}, "
                f"which comes from {origin}; write it out of place (y = x + 1 instead of "
                "x += 1, torch.relu instead of relu_) or change split_points so the value and "
                "its update fall in one segment"
            )


def _is_batchnorm_call(node: fx.Node, root: nn.Module) -> _BatchNorm | None:
    path = innermost(node)
    if not path:
        return None
    try:
        sub = root.get_submodule(path)
    except AttributeError:
        return None
    return sub if isinstance(sub, _BatchNorm) else None


def build_programs(graph: fx.Graph, cutting: Cutting, *, root: nn.Module,
                   param_path: dict[fx.Node, str], constant_of: dict[fx.Node, str],
                   user_inputs: list[fx.Node], trace_device: torch.device,
                   mode: str, ends: dict[fx.Node, dict[int, str]] | None = None
                   ) -> list[SegmentProgram]:
    """Each segment's graph copied out of ``graph`` and compiled.

    BatchNorm layers become calls of the module itself (``call_module``), so their running
    statistics follow the module's mode, GPipe's re-materialization (which switches the
    update off) and DeferredBatchNorm. Device literals of the trace become the device the
    segment runs on. ``ends``: placeholders of weights tied across the ends, read by each
    segment that uses them at its own path (segment -> path).
    """
    ends = ends or {}
    output = next(n for n in graph.nodes if n.op == "output")
    body = body_nodes(graph)
    programs = []
    for s in range(cutting.num_segments):
        g = fx.Graph()
        env: dict[fx.Node, Any] = {}
        device_node = g.placeholder("device_")
        incoming = user_inputs if s == 0 else cutting.crossing[s - 1]
        for node in incoming:
            env[node] = g.placeholder(node.name)
        constants = sorted({constant_of[n] for n in constant_of
                            if any(cutting.segment_of.get(u) == s for u in n.users)})
        for node, name in constant_of.items():
            if name in constants:
                env[node] = g.placeholder(f"const_{node.name}")
        tensor_paths = []
        for node, path in param_path.items():
            if node in ends:
                if s in ends[node] and any(cutting.segment_of.get(u) == s for u in node.users):
                    env[node] = g.placeholder(f"tensor_{node.name}")
                    tensor_paths.append(ends[node][s])
            elif cutting.segment_of[node] == s and node not in env:
                env[node] = g.placeholder(f"tensor_{node.name}")
                tensor_paths.append(path)

        def lookup(n: fx.Node, s: int = s, env: dict[fx.Node, Any] = env) -> Any:
            if n not in env:
                raise SequentializeError(
                    f"node {n.name!r} of module {innermost(n)!r} is needed in segment {s} but "
                    "was not sent to it; this is a bug of gp.sequentialize, please report it "
                    "with the model"
                )
            return env[n]

        for node in body:
            if cutting.segment_of[node] != s:
                continue
            bn = _is_batchnorm_call(node, root)
            if bn is not None:
                if node.target is torch.ops.aten.batch_norm.default:
                    source = node.args[0]
                    assert isinstance(source, fx.Node)
                    env[node] = g.call_module(innermost(node), (lookup(source),))
                    continue
                if node.target is torch.ops.aten.add_.Tensor:
                    continue  # num_batches_tracked += 1: the module does it
                raise SequentializeError(
                    f"node {node.name!r} ({node.target}) inside BatchNorm {innermost(node)!r} "
                    "is not the batch_norm operation gp.sequentialize knows how to hand back "
                    "to the module; use nn.BatchNorm*d or GroupNorm"
                )
            new = g.node_copy(node, lookup)
            def place(a: Any, d: fx.Node = device_node) -> Any:
                return _device(a, trace_device, d)

            new.args = fx.node.map_aggregate(new.args, place)
            new.kwargs = fx.node.map_aggregate(new.kwargs, place)
            env[node] = new
        if s + 1 < cutting.num_segments:
            outgoing = cutting.crossing[s]
            g.output(tuple(lookup(n) for n in outgoing))
            outgoing_names = [n.name for n in outgoing]
        else:
            results = output.args[0]
            g.output(fx.node.map_arg(tuple(results), lookup))
            outgoing_names = [r.name if isinstance(r, fx.Node) else repr(r) for r in results]
        g.eliminate_dead_code(is_impure_node=_impure)
        g.lint()
        code = g.python_code(root_module="self")
        filename = f"<gp.sequentialize segment {s} ({mode})>"
        linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
        namespace = dict(code.globals)
        exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102  # fx's own codegen
        programs.append(SegmentProgram(
            fn=namespace["forward"], code=code.src,
            incoming=[n.name for n in incoming], outgoing=outgoing_names,
            constants=[name for name in constant_of.values() if name in constants],
            tensors=tensor_paths,
        ))
    return programs


def _impure(node: fx.Node) -> bool:
    """Kept even when unused: a module call (BatchNorm updates its statistics) and what fx
    itself keeps (in-place and random operations, placeholders, the output)."""
    return node.op == "call_module" or node.is_impure()


def _device(value: Any, trace_device: torch.device, device_node: fx.Node) -> Any:
    if isinstance(value, torch.device) and value.type == trace_device.type:
        return device_node
    return value


__all__ += ["check_in_place", "ASSERTS"]
