"""Tracing a module with torch.export, once per mode, and naming what cannot be traced."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

__all__ = ["Shared", "SequentializeError", "export_module", "unwrap_shared"]


class SequentializeError(RuntimeError):
    """A module that :func:`~gpipe_core.sequentialize` cannot cut, with the node, the module
    path and the fix in the message."""


class Shared:
    """An input without a batch dimension that every micro-batch gets whole (a mask shared by
    all samples, a table): ``pipe(seq_inputs(ids, gp.Shared(mask)))``.

    Tensors with at least one dimension are split along dim 0 into micro-batches; wrap the
    ones that are not (in the example given to ``sequentialize`` and in every call). 0-dim
    tensors and non-tensor values are never split and need no wrapper. A shared input gets no
    gradient.
    """

    def __init__(self, value: Tensor) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"Shared wraps a tensor, got {type(value).__name__}")
        self.value = value

    def __repr__(self) -> str:
        return f"Shared({tuple(self.value.shape)}, dtype={self.value.dtype})"


def unwrap_shared(tree: Any) -> Any:
    """``tree`` with every :class:`Shared` replaced by its tensor."""
    return pytree.tree_map(lambda x: x.value if isinstance(x, Shared) else x, tree,
                           is_leaf=lambda x: isinstance(x, Shared))


def _dynamic_shapes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """dim 0 of every batched tensor input is one symbol, ``batch`` (micro-batches vary in
    size); shared inputs, 0-dim tensors and non-tensors are static."""
    batch = Dim("batch")

    def spec(value: Any) -> Any:
        if isinstance(value, Shared):
            return None
        if isinstance(value, Tensor) and value.dim() > 0:
            return {0: batch}
        return None

    def specs(tree: Any) -> Any:
        return pytree.tree_map(spec, tree, is_leaf=lambda x: isinstance(x, Shared))

    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise SequentializeError(
            f"example_args/example_kwargs do not fit {type(module).__name__}.forward"
            f"{inspect.signature(module.forward)}: {exc}; give the arguments one training "
            "step passes to the module"
        ) from None
    names = list(inspect.signature(module.forward).parameters.values())
    result: dict[str, Any] = {}
    for param in names:
        if param.name not in bound.arguments:
            continue
        value = bound.arguments[param.name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            result[param.name] = tuple(specs(v) for v in value)
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            result[param.name] = {k: specs(v) for k, v in value.items()}
        else:
            result[param.name] = specs(value)
    return result


@contextmanager
def _mode(module: nn.Module, training: bool) -> Iterator[None]:
    """Every submodule in ``training`` mode for the trace; each one's own mode restored after."""
    before = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, mode in before:
            m.training = mode


@contextmanager
def _module_stack(module: nn.Module) -> Iterator[list[str]]:
    """The paths of the submodules whose forward is running (innermost last)."""
    stack: list[str] = []
    handles = []
    for path, sub in module.named_modules():
        def pre(_m: nn.Module, _args: Any, path: str = path) -> None:
            stack.append(path)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            if stack:
                stack.pop()

        handles.append(sub.register_forward_pre_hook(pre))
        handles.append(sub.register_forward_hook(post))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def _user_frame(exc: BaseException) -> str:
    """The innermost frame of the traceback outside torch: the model's line that failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = str(torch.__file__).rsplit("/", 1)[0]
    user = [f for f in frames if not f.filename.startswith(torch_dir)
            and "/gpipe_core/sequentializer/" not in f.filename]
    if not user:
        return "(no frame outside torch)"
    frame = user[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def export_module(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                  training: bool) -> ExportedProgram:
    """``torch.export`` of ``module`` in training or evaluation mode, with a dynamic batch.

    Raises :class:`SequentializeError` naming the module path, the source line and the fix.
    """
    dynamic = _dynamic_shapes(module, args, kwargs)
    plain_args, plain_kwargs = unwrap_shared((args, kwargs))
    with _mode(module, training), _module_stack(module) as stack:
        try:
            return torch.export.export(module, tuple(plain_args), dict(plain_kwargs),
                                       dynamic_shapes=dynamic, strict=False)
        except Exception as exc:  # every failure of the trace becomes one named error
            where = stack[-1] if stack else ""
            raise _named_error(module, exc, where, training) from exc


def _named_error(module: nn.Module, exc: Exception, where: str, training: bool) -> SequentializeError:
    text = str(exc)
    path = f"module {where!r} ({type(module.get_submodule(where)).__name__})" if where else (
        f"the top-level module ({type(module).__name__})")
    line = _user_frame(exc)
    mode = "training" if training else "evaluation"
    if "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__:
        return SequentializeError(
            f"data-dependent control flow in {path} at {line} ({mode} mode): Python branches "
            "on a tensor's value, which a trace cannot follow; write the branch with "
            "torch.where or torch.cond, or compute the condition outside the model and pass it "
            "as an argument"
        )
    if "batch" in text and ("specialized" in text or "Constraints violated" in text):
        return SequentializeError(
            f"{path} at {line} needs a fixed batch size ({mode} mode), but micro-batches differ "
            "in size; remove the dependence on the batch size (e.g. view(-1, ...) rather than "
            "view(batch, ...)), or wrap inputs that have no batch dimension in gp.Shared. "
            f"torch.export said: {text.splitlines()[0] if text else type(exc).__name__}"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return SequentializeError(
        f"torch.export cannot trace {path} at {line} ({mode} mode): {type(exc).__name__}: "
        f"{first}; make the forward traceable (no Python-side effects or non-tensor outputs "
        "such as caches: e.g. pass use_cache=False to a Hugging Face model), or give "
        "gp.sequentialize a module that wraps the part to pipeline"
    )
