"""The parameter outputs of one autograd node, computed from what it saved, without the engine.

A split backward's W (:mod:`gpipe_core.split_backward`) needs, at each boundary node, only the
gradients that leave it towards parameters: a linear layer's weight and bias at its
``AddmmBackward0``, a convolution's weight and bias at its ``ConvolutionBackward0``. An autograd
call from the boundary gets them too, but the engine first walks everything reachable from its
root (the whole graph below the boundary), so a stage of n layers pays O(n) per call and O(n^2)
per W. Here each output is the formula autograd itself uses (``derivatives.yaml``), applied to
the node's saved tensors: one matrix product per weight, nothing walked.

:func:`rule_for` gives the formula for a node's class and outputs, or None; for the others the
caller uses the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node

__all__ = ["rule_for"]

# A node of a given class, with the ``_saved_*`` attributes autograd generates for that class.
SavedNode = Any
Rule = Callable[[SavedNode, Tensor, Sequence[int]], dict[int, Tensor]]


def _times(t: Tensor, scalar: complex | float | bool) -> Tensor:
    """autograd's ``maybe_multiply``: no multiplication by one."""
    return t if scalar == 1 else t * scalar


def _mm_second(grad: Tensor, first: Tensor, sizes: Sequence[int], strides: Sequence[int],
               alpha: complex | float | bool) -> Tensor:
    """The gradient of ``second`` in ``first @ second`` (``mm_mat2_backward``): column-major
    when ``second`` was (a linear layer's ``weight.t()``), so that its transpose is contiguous."""
    if strides[0] == 1 and strides[1] == sizes[0]:
        return _times(grad.t().mm(first.conj()).t(), alpha)
    return _times(first.t().conj().mm(grad), alpha)


def _addmm(node: SavedNode, grad: Tensor, wanted: Sequence[int]) -> dict[int, Tensor]:
    """``addmm(self, mat1, mat2, beta, alpha)``: outputs self (a bias; the engine sums it to
    its shape) and mat2 (a weight, transposed)."""
    out: dict[int, Tensor] = {}
    if 0 in wanted:
        out[0] = _times(grad, node._saved_beta)
    if 2 in wanted:
        out[2] = _mm_second(grad, node._saved_mat1, node._saved_mat2_sym_sizes,
                            node._saved_mat2_sym_strides, node._saved_alpha)
    return out


def _mm(node: SavedNode, grad: Tensor, wanted: Sequence[int]) -> dict[int, Tensor]:
    """``mm(self, mat2)``: output mat2 (a weight on the right, or transposed)."""
    return {1: _mm_second(grad, node._saved_self, node._saved_mat2_sym_sizes,
                          node._saved_mat2_sym_strides, 1)}


def _convolution(node: SavedNode, grad: Tensor, wanted: Sequence[int]) -> dict[int, Tensor]:
    """``convolution(input, weight, bias, ...)``: outputs weight and bias."""
    mask = [False, 1 in wanted, 2 in wanted]
    _, weight, bias = torch.ops.aten.convolution_backward(
        grad, node._saved_input, node._saved_weight, node._saved_bias_sym_sizes_opt,
        node._saved_stride, node._saved_padding, node._saved_dilation, node._saved_transposed,
        node._saved_output_padding, node._saved_groups, mask)
    return {i: t for i, t in ((1, weight), (2, bias)) if i in wanted}


# Per node class: the outputs a rule computes (never the one towards the input path) and the rule.
RULES: dict[str, tuple[frozenset[int], Rule]] = {
    "AddmmBackward0": (frozenset({0, 2}), _addmm),
    "MmBackward0": (frozenset({1}), _mm),
    "ConvolutionBackward0": (frozenset({1, 2}), _convolution),
}


def rule_for(node: Node, wanted: Sequence[int]) -> Rule | None:
    """The rule computing outputs ``wanted`` of ``node`` (call it under ``torch.no_grad()``
    as ``rule(node, grad, wanted)``), or None where there is none."""
    entry = RULES.get(node.name())
    return entry[1] if entry is not None and entry[0].issuperset(wanted) else None
