"""Where a traced graph is cut: split points, the segment of every node, the values that cross.

A *split point* is a rule on module paths: ``("before", "transformer.h.1")`` cuts before the
first operation that runs inside ``transformer.h.1``; ``("after", "transformer.h")`` cuts after
the last operation inside ``transformer.h``. The graph's operations are in program order, so a
rule is a position in that order and the positions split the operations into segments.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from .tracing import SequentializeError

__all__ = ["SplitPoint", "Cutting", "body_nodes", "default_split_points", "module_paths",
           "innermost", "cut_positions", "cut_graph"]

SplitPoint = tuple[str, str]  # ("before" | "after", module path)

# Operations the trace inserts to check shapes and metadata at run time: dropped, since
# micro-batches change the batch size and the pipeline moves tensors between devices.
ASSERTS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_async.msg,
}


def body_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The graph's operations in program order, without the trace's run-time checks."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target not in ASSERTS]


def default_split_points(module: nn.Module) -> list[SplitPoint]:
    """Cut before every block of the outermost repeated containers (``nn.ModuleList`` or
    ``nn.Sequential`` of two or more modules: ``transformer.h``, ``model.layers``, a ResNet's
    ``layer1`` ... ``layer4``) and after each container, so the stem and the head are
    segments of their own."""
    points: list[SplitPoint] = []

    def visit(path: str, sub: nn.Module) -> None:
        if isinstance(sub, nn.ModuleList | nn.Sequential) and len(sub) >= 2:
            for name, _ in sub.named_children():
                points.append(("before", f"{path}.{name}" if path else name))
            if path:
                points.append(("after", path))
            return
        for name, child in sub.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", module)
    return points


def module_paths(node: fx.Node) -> list[tuple[str, str]]:
    """``(call key, module path)`` of the modules whose forward ``node`` ran in, outermost
    first (the call key tells a module's second call, ``a@1``, from its first)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(key, value[0]) for key, value in stack.items()
            if not key.startswith("_empty_nn_module_stack")]


def innermost(node: fx.Node) -> str:
    paths = module_paths(node)
    return paths[-1][1] if paths else ""


def _inside(node_path: str, path: str) -> bool:
    return path == "" or node_path == path or node_path.startswith(path + ".")


@dataclass
class Cutting:
    """Every node of a graph assigned to a segment (placeholders of parameters to the segment
    that owns them, user inputs to the first), and the values live across each cut."""

    num_segments: int
    segment_of: dict[fx.Node, int]
    # crossing[s]: the values sent from segment s to segment s + 1, in graph order
    crossing: list[list[fx.Node]] = field(default_factory=list)


def cut_positions(body: Sequence[fx.Node], points: Sequence[SplitPoint], *,
                  strict: bool) -> list[int | None]:
    """The position in ``body`` of each split point (None: its module never runs)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, node in enumerate(body):
        for _, path in module_paths(node):
            parts = path.split(".")
            for depth in range(1, len(parts) + 1):
                prefix = ".".join(parts[:depth])
                first.setdefault(prefix, index)
                last[prefix] = index
    positions: list[int | None] = []
    for kind, path in points:
        if path not in first:
            if strict:
                raise SequentializeError(
                    f"split point {path!r}: no operation of the traced forward runs inside "
                    f"this module; name a module the forward calls (one of "
                    f"{sorted(first)[:12]} ...)"
                )
            positions.append(None)
            continue
        positions.append(first[path] if kind == "before" else last[path] + 1)
    return positions


def cut_graph(graph: fx.Graph, positions: Sequence[int], owners: dict[str, int] | None,
              param_of: dict[fx.Node, str], local: Collection[fx.Node] = ()) -> Cutting:
    """Assign nodes to segments cut at ``positions`` (sorted indices into the body).

    ``param_of`` maps the placeholders of parameters and buffers to a key of the tensor;
    ``owners`` (key -> segment) fixes their segment, else the first segment using them.
    ``local``: placeholders every segment using them reads itself (a weight tied across the
    ends, held by the first and the last layer), never sent.
    """
    body = body_nodes(graph)
    num_segments = len(positions) + 1
    segment_of: dict[fx.Node, int] = {}
    for index, node in enumerate(body):
        segment_of[node] = bisect.bisect_right(positions, index)
    for node in body:  # the parts of a multi-output op go with it
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            source = node.args[0]
            if source in segment_of:
                segment_of[node] = segment_of[source]
    for node in graph.nodes:
        if node.op == "placeholder":
            if node in param_of:
                key = param_of[node]
                users = [segment_of[u] for u in node.users if u in segment_of]
                if owners is not None and key in owners:
                    segment_of[node] = owners[key]
                else:
                    segment_of[node] = min(users) if users else 0
            else:
                segment_of[node] = 0
    output = next(n for n in graph.nodes if n.op == "output")
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        uses = [segment_of[u] for u in node.users if u in segment_of]
        if output in node.users:
            uses.append(num_segments - 1)
        if uses:
            last_use[node] = max(uses)
    crossing: list[list[fx.Node]] = [[] for _ in range(num_segments - 1)]
    for node, use in last_use.items():
        if node.op == "placeholder" and (node.meta.get("sequentialize_constant")
                                         or node in local):
            continue  # each segment reads it itself
        for s in range(segment_of[node], use):
            crossing[s].append(node)
    return Cutting(num_segments, segment_of, crossing)
