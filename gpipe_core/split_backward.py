r"""A backward in two passes: the inputs' gradient now (I), the parameters' gradient later (W).

Zero-bubble schedules send the gradient of a stage's input as early as possible and compute the
parameters' gradient later, where it fills what would be a bubble. Autograd computes the first
alone when asked for the inputs only; the second must then start where the first pass left the
graph, or it would repeat the whole backward. While :func:`backward_input` runs, it captures
the gradient arriving at every *boundary*: a node on the path to the inputs (run by I) with an
edge towards parameters that leaves that path::

    roots (outputs or loss)
      |                                 *  on the path to the inputs: run by I
      * addmm ---> t ---> weight 2      boundary: a * node with an edge off the path (addmm);
      |      \---> bias 2                   I keeps the gradient that arrived at it
      * tanh                            W: from each boundary, with that gradient, along the
      |                                    edges off the path, to the parameters
      * addmm ---> t ---> weight 1
      |      \---> bias 1
      inputs

:meth:`PendingWeights.run` (W) goes from the boundaries to the parameters, one group at a time
(parameters reached from the same boundaries form a group), accumulating into ``.grad`` as a
fused backward does. Where every boundary of a group is a linear layer's matrix product or a
convolution, W computes their parameter outputs from what the node saved
(:mod:`gpipe_core.weight_grads`) and adds them to ``.grad`` directly: no autograd call, whose
engine would first walk the whole graph below the boundary (O(layers) per group, O(layers^2)
per W). Other groups take an autograd call from their boundaries (so that it does not walk the
input path from one boundary to another). Groups of vector parameters only (a norm's scale
and shift, a lone bias) are not worth W's time: I computes their gradient on its way (their
node is on the input path; the gradient is a reduction over the batch) and W skips them. Only
the boundary nodes run twice, and the second time only for their parameter outputs. Roots that do not lead to any input are boundaries too, with the roots' gradients. A
stage whose inputs need no gradient (the first) thus does nothing in I and its whole backward
in W.

Between I and W the stage keeps its autograd graph and the captured gradients (about one
activation per boundary).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from . import weight_grads

__all__ = ["PendingWeights", "backward_input"]

Grads = list[Tensor | None]


class _Group:
    """Parameters reached from the same boundaries, and where W starts for them."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.boundaries: list[Node] = []  # on the input path: gradients captured by I
        self.roots: list[tuple[GradientEdge, Tensor]] = []  # off the path: the roots' own
        self.branches: set[Node] = set()  # off the path, leading to the group's parameters
        self.starts: list[Node] = []  # the boundaries and roots, each once


class PendingWeights:
    """What W needs after I: boundaries with their gradients, grouped by parameters."""

    def __init__(self, groups: list[_Group], captured: dict[Node, tuple[Tensor | None, ...]]):
        self._groups = groups
        self._captured = captured

    def run(self) -> None:
        """Accumulate every parameter's gradient into ``.grad``; then forget the graph."""
        groups, captured = self._groups, self._captured
        self._groups, self._captured = [], {}
        for index, group in enumerate(groups):
            if _run_directly(group, captured):
                continue
            edges: list[GradientEdge] = [edge for edge, _ in group.roots]
            grads: list[Tensor] = [grad for _, grad in group.roots]
            for node in group.boundaries:
                for index, grad in enumerate(captured[node]):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue
            # A boundary reached from another boundary of the group would add that path's
            # share to the total it already captured: hand it exactly the captured total.
            handles = [
                node.register_prehook(lambda _, saved=captured[node]: saved)
                for node in group.boundaries
            ] if len(group.boundaries) > 1 else []
            try:
                # the last group's call may free the buffers of the nodes it runs, as B does
                torch.autograd.backward(edges, grads, inputs=group.params,
                                        retain_graph=index < len(groups) - 1)
            finally:
                for handle in handles:
                    handle.remove()


def backward_input(
    roots: Sequence[Tensor],
    root_grads: Sequence[Tensor | None],
    inputs: Sequence[Any],
    params: Sequence[Tensor],
) -> tuple[Grads, PendingWeights]:
    """Gradients of ``inputs`` (None where an input is not a tensor that requires grad), and
    the parameters' part for later.

    ``roots``: the stage's outputs (or loss) that require grad; ``root_grads``: their
    gradients (None: ones, as for a loss). The graph is kept for :meth:`PendingWeights.run`.
    """
    grads = [torch.ones_like(t) if g is None else g for t, g in zip(roots, root_grads, strict=True)]
    root_edges = [get_gradient_edge(t) for t in roots]
    if not any(isinstance(x, Tensor) and x.requires_grad for x in inputs):
        # No input needs a gradient (a first stage): I has nothing to do and W is the whole
        # backward, one autograd call from the roots; no analysis of the graph.
        whole = _Group()
        whole.params = list(params)
        whole.roots = list(zip(root_edges, grads, strict=True))
        return [None] * len(inputs), PendingWeights([whole] if roots else [], {})
    parents = _parents([edge.node for edge in root_edges])
    wanted = [(i, x) for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    input_nodes = [get_gradient_edge(x).node for _, x in wanted]
    on_path = _reaching(input_nodes, parents)
    groups, _ = _group_params(params, parents, on_path, root_edges, grads)
    runs_path = bool(wanted and on_path)
    now: list[_Group] = []  # computed by I on its way; the rest wait for W
    later: list[_Group] = []
    for group in groups:
        (now if runs_path and not _worth_deferring(group) else later).append(group)
    groups = later
    eager = [p for g in now for p in g.params]
    boundaries = list({node: None for g in groups for node in g.boundaries})
    captured: dict[Node, tuple[Tensor | None, ...]] = {}
    handles = [node.register_prehook(_capture(captured, node)) for node in boundaries]
    result: Grads = [None] * len(inputs)
    try:
        if runs_path:
            computed = torch.autograd.grad(
                list(roots), [x for _, x in wanted] + eager, grads, retain_graph=True,
                allow_unused=True
            )
            for (position, _), grad in zip(wanted, computed[:len(wanted)], strict=True):
                result[position] = grad
            with torch.no_grad():
                for param, grad in zip(eager, computed[len(wanted):], strict=True):
                    _accumulate(param, grad)
    finally:
        for handle in handles:
            handle.remove()
    missing = [node for node in boundaries if node not in captured]
    if missing:  # cannot happen: I runs every node on the path to the inputs
        raise RuntimeError(f"backward_input did not reach {missing}; please report this")
    return result, PendingWeights(groups, captured)


def _run_directly(group: _Group, captured: dict[Node, tuple[Tensor | None, ...]]) -> bool:
    """W for ``group`` without an autograd call at its boundaries, if every boundary is a node
    whose parameter outputs :mod:`gpipe_core.weight_grads` computes from what the node saved
    (a linear layer's addmm, a convolution): each output then goes into its branch (straight
    into ``.grad`` through an accumulator or a transpose, else an autograd call from the
    branch, which walks only the branch). False, having done nothing, for any other group."""
    if group.roots:
        return False
    plan = []
    branches = group.branches
    for node in group.boundaries:
        edges = node.next_functions
        wanted = [i for i, (child, _) in enumerate(edges)
                  if child is not None and child in branches]
        rule = weight_grads.rule_for(node, wanted)
        if rule is None:
            return False
        plan.append((node, edges, wanted, rule))
    targets = {id(p) for p in group.params}
    with torch.no_grad():
        for node, edges, wanted, rule in plan:
            grad = captured[node][0]
            if grad is None or not wanted:
                continue
            outputs = rule(node, grad, wanted)
            for index in wanted:
                child, input_nr = edges[index]
                assert child is not None  # a branch
                _into_branch(child, input_nr, outputs[index], targets, group.params)
    return True


def _into_branch(child: Node, input_nr: int, grad: Tensor, targets: set[int],
                 params: list[Tensor]) -> None:
    """Deliver ``grad`` along the edge into ``child``, as the engine would: into the
    parameter's ``.grad`` when ``child`` is its accumulator, or leads to it through a
    transpose and autocast's cast of the weight (``TBackward0``, ``ToCopyBackward0``), and the
    parameter has no hooks; else by an autograd call rooted at the edge. Runs under
    ``torch.no_grad()`` (the autograd call computes gradients there as anywhere)."""
    chain, accumulator = _pass_through(child)
    variable = getattr(accumulator, "variable", None)
    if variable is not None and id(variable) in targets and not _has_hooks(variable):
        if "TBackward0" not in chain and grad.shape != variable.shape:
            # a broadcast bias: the engine's sum_to, at the edge, in the dtype that arrives
            grad = grad.sum_to_size(variable.shape)
        if "TBackward0" in chain:
            grad = grad.t()
        if "ToCopyBackward0" in chain:  # autocast's cast: the gradient goes back to the
            grad = grad.to(variable.dtype)  # parameter's dtype
        _accumulate(variable, grad)
        return
    if grad.dim() and chain == ["ToCopyBackward0"] and variable is not None and (
            grad.shape != variable.shape):  # an autocast cast of a bias: sum_to at the edge
        grad = grad.sum_to_size(variable.shape)
    torch.autograd.backward([GradientEdge(child, input_nr)], [grad], inputs=params,
                            retain_graph=True)


# Nodes between a matrix product and a weight's accumulator that W may undo itself: a linear
# layer's transposed weight, and the cast of the weight that autocast inserts.
_PASS_THROUGH = ("TBackward0", "ToCopyBackward0")


def _pass_through(node: Node) -> tuple[list[str], Node | None]:
    """The pass-through nodes from ``node`` down (at most a transpose and a cast) and the node
    below them (a parameter's accumulator, or anything else)."""
    chain: list[str] = []
    below: Node | None = node
    while below is not None and below.name() in _PASS_THROUGH and len(chain) < 2:
        chain.append(below.name())
        below = below.next_functions[0][0]
    return chain, below


def _has_hooks(param: Tensor) -> bool:
    return bool(param._backward_hooks) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


def _worth_deferring(group: _Group) -> bool:
    """Whether W should compute this group's gradient rather than I. A matrix or a kernel
    (a parameter of two or more dimensions) has a gradient that is a product as large as its
    layer's forward: worth moving off the critical path. A group of vectors only (a norm's
    scale and shift, a bias alone) reduces over the batch, which costs less than the autograd
    call W would spend on it; and a group whose gradient does not start on the input path
    (the last stage's loss-only branches, a first stage's whole backward) stays in W, since I
    does not walk there."""
    return bool(group.roots) or not group.boundaries or any(p.dim() >= 2 for p in group.params)


def _accumulate(param: Tensor, grad: Tensor | None) -> None:
    """Add ``grad`` into ``param.grad`` as a fused backward's accumulation does."""
    if grad is None:
        return
    if param.grad is None:  # in the parameter's layout, as autograd's accumulator makes it
        param.grad = torch.empty_like(param).copy_(grad)
    else:
        param.grad += grad


def _capture(captured: dict[Node, tuple[Tensor | None, ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        captured[node] = grad_outputs

    return hook


def _parents(roots: Sequence[Node | None]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, mapped to the nodes with an edge into it."""
    parents: dict[Node, list[Node]] = {}
    queue: deque[Node] = deque()
    for node in roots:
        if node is not None and node not in parents:
            parents[node] = []
            queue.append(node)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _reaching(targets: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The nodes of the graph from which one of ``targets`` is reachable (targets included)."""
    found = {node for node in targets if node in parents}
    queue = deque(found)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


@functools.cache
def _accumulator_type() -> type:
    """The class of the autograd node that accumulates into a leaf's ``.grad``."""
    return type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)


def _group_params(
    params: Sequence[Tensor],
    parents: dict[Node, list[Node]],
    on_path: set[Node],
    root_edges: Sequence[GradientEdge],
    root_grads: Sequence[Tensor],
) -> tuple[list[_Group], list[Node]]:
    """Group the parameters by the boundaries W starts from; return the groups and the
    boundaries on the input path (whose gradients I must capture)."""
    roots_by_node: dict[Node, list[tuple[GradientEdge, Tensor]]] = {}
    for edge, grad in zip(root_edges, root_grads, strict=True):
        roots_by_node.setdefault(edge.node, []).append((edge, grad))
    group_of: dict[Node, _Group] = {}  # boundary or root node -> its group
    groups: dict[int, _Group] = {}  # by id, in the order they were made
    accumulators = {id(n.variable): n for n in parents  # type: ignore[attr-defined]
                    if type(n) is _accumulator_type()}
    for param in params:
        node = accumulators.get(id(param))
        if node is None:
            continue  # no gradient reaches it (as in a fused backward, .grad is untouched)
        starts: list[Node] = []  # the boundaries and off-path roots above this parameter
        seen = {node}
        queue = deque([node])
        while queue:
            current = queue.popleft()
            if current in on_path:
                starts.append(current)
                continue
            if current in roots_by_node:
                starts.append(current)
            for parent in parents[current]:
                if parent not in seen:
                    seen.add(parent)
                    queue.append(parent)
        merged = _Group()
        merged.params.append(param)
        merged.branches = {n for n in seen if n not in on_path}
        for start in starts:  # merge with the groups already starting there
            other = group_of.get(start)
            if other is not None and other is not merged:
                merged.params.extend(other.params)
                merged.branches |= other.branches
                for key in other.starts:
                    group_of[key] = merged
                merged.starts.extend(other.starts)
                del groups[id(other)]
            if group_of.get(start) is not merged:
                group_of[start] = merged
                merged.starts.append(start)
        groups[id(merged)] = merged
    for start, group in group_of.items():
        if start in on_path:
            group.boundaries.append(start)
        else:
            group.roots.extend(roots_by_node[start])
    return list(groups.values()), [node for node in group_of if node in on_path]
