"""A segment: one layer of the sequentialized model, owning its parameters under their
original paths, and the state-dict naming that keeps the original module's keys.

Inside a segment, parameters sit at the paths they have in the original module (a segment
holding ``transformer.h.0`` has the attribute path ``transformer.h.0.attn.c_attn.weight``),
so a segment's own state-dict keys are the original keys. A container (the sequentialized
``nn.Sequential``, ``GPipe``, ``DistributedGPipe``) adds the segment's name in front; a hook
on the segment takes it off again when saving, and a hook on the container puts it back when
loading. A weight two modules share (a tied embedding and output projection) lives in the
first segment that uses it and rides to the others with the activations; its second name
is written by the state dict as an alias of the first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .program import SegmentProgram
from .tracing import SequentializeError, Shared

__all__ = ["Segment", "TensorTable", "install_naming_hooks"]


class TensorTable:
    """Every parameter and buffer of the original module: its first (canonical) path, the
    other paths of the same tensor (aliases), and whether a buffer is persistent."""

    def __init__(self, root: nn.Module) -> None:
        self.canonical: dict[int, str] = {}
        self.aliases: dict[str, str] = {}  # alias path -> canonical path
        self.persistent: dict[str, bool] = {}  # path -> in the state dict
        self.tensors: dict[str, Tensor] = {}  # canonical path -> tensor
        for module_path, module in root.named_modules(remove_duplicate=False):
            entries: list[tuple[str, Tensor | None, bool]] = [
                (name, p, True) for name, p in module._parameters.items()]
            entries += [(name, b, name not in module._non_persistent_buffers_set)
                        for name, b in module._buffers.items()]
            for name, tensor, persistent in entries:
                if tensor is None:
                    continue
                path = f"{module_path}.{name}" if module_path else name
                self.persistent[path] = persistent
                if id(tensor) in self.canonical:
                    if path != self.canonical[id(tensor)]:
                        self.aliases[path] = self.canonical[id(tensor)]
                else:
                    self.canonical[id(tensor)] = path
                    self.tensors[path] = tensor

    def owners(self, used: dict[str, int]) -> dict[str, int]:
        """The segment of every canonical path: where it is first used, or for an unused one
        the first segment of the used tensors of its nearest enclosing module (else 0)."""
        result = dict(used)
        for path in self.tensors:
            if path in result:
                continue
            parts = path.split(".")[:-1]
            owner = 0
            for depth in range(len(parts), -1, -1):
                prefix = ".".join(parts[:depth])
                near = [s for p, s in used.items()
                        if prefix == "" or p.startswith(prefix + ".")]
                if near:
                    owner = min(near)
                    break
            result[path] = owner
        return result


def build_tree(shell: nn.Module, module: nn.Module, path: str, ghosts: Collection[str],
               owners: dict[str, int], segment: int) -> None:
    """Give ``shell`` (the segment, then its empty sub-modules) what ``segment`` owns of
    ``module``: whole sub-modules where every tensor is the segment's and no second name of
    a shared tensor (``ghosts``) is inside, else an empty module at the same path holding the
    segment's tensors one by one. ``owners``: path -> segment, for every path registered."""
    for name, child in module.named_children():
        child_path = f"{path}.{name}" if path else name
        inside = [p for p in owners if p.startswith(child_path + ".")]
        segments = {owners[p] for p in inside}
        aliased = any(a.startswith(child_path + ".") for a in ghosts)
        if segments == {segment} and not aliased:
            shell.add_module(name, child)
        elif segment in segments:
            sub = nn.Module()
            shell.add_module(name, sub)
            build_tree(sub, child, child_path, ghosts, owners, segment)
    for name, param in module._parameters.items():
        full = f"{path}.{name}" if path else name
        if param is not None and owners.get(full) == segment:
            shell.register_parameter(name, param)
    for name, buffer in module._buffers.items():
        full = f"{path}.{name}" if path else name
        if buffer is not None and owners.get(full) == segment:
            shell.register_buffer(name, buffer,
                                  persistent=name not in module._non_persistent_buffers_set)


class Segment(nn.Module):
    """Layer ``index`` of a sequentialized model: the traced operations between two cuts.

    Its forward takes what the previous segment returned (the first: the model's inputs, in
    the structure of the example) and returns a tuple of the values live across the next
    cut (the last: the model's output, a Hugging Face ``ModelOutput`` as a plain dict). It
    runs the program traced in training mode or the one traced in evaluation mode, following
    its own ``training`` flag (``pipe.train()`` / ``pipe.eval()``).
    """

    def __init__(self, *, index: int, num_segments: int, name: str, label: str,
                 programs: dict[bool, SegmentProgram], constants: dict[str, Tensor],
                 aliases: dict[str, str], inputs: InputSpec | None,
                 output_spec: pytree.TreeSpec | None) -> None:
        super().__init__()
        self.index = index
        self.num_segments = num_segments
        self.layer_name = name  # its name in the sequential container
        self.label = label  # the module path where it starts, for messages
        self.programs = programs
        self._constants = constants
        self._placed: dict[tuple[str, torch.device], Tensor] = {}
        self.alias_keys = aliases  # alias key -> canonical key, both held by this segment
        self.input_spec = inputs
        self.output_spec = output_spec
        self._keys: list[str] | None = None
        # (module, "_parameters" or "_buffers", name) of each tensor a program reads
        self._slots: dict[bool, list[tuple[nn.Module, str, str]]] = {}
        self._renaming = True
        self.register_state_dict_post_hook(_original_keys)
        self.register_load_state_dict_pre_hook(_drop_aliases)

    def local_keys(self) -> list[str]:
        """This segment's own state-dict keys: the original module's keys of what it holds,
        aliases not included (fixed once the segment is built)."""
        if self._keys is None:
            self._renaming = False
            try:
                self._keys = list(self.state_dict(keep_vars=True).keys())
            finally:
                self._renaming = True
        return self._keys

    def _tensor_slots(self, training: bool) -> list[tuple[nn.Module, str, str]]:
        """Where each tensor the program reads lives: found once, read at every call (a
        module's tensors are replaced in place by ``.to()``, ``to_empty`` and loading)."""
        if training not in self._slots:
            slots = []
            for path in self.programs[training].tensors:
                owner_path, _, name = path.rpartition(".")
                owner = self.get_submodule(owner_path)
                kind = "_parameters" if name in owner._parameters else "_buffers"
                slots.append((owner, kind, name))
            self._slots[training] = slots
        return self._slots[training]

    def _device(self, tensors: list[Tensor], values: Any) -> torch.device:
        if tensors:
            return tensors[0].device
        for param in self.parameters():
            return param.device
        for buffer in self.buffers():
            return buffer.device
        for leaf in pytree.tree_leaves(values):
            if isinstance(leaf, Tensor):
                return leaf.device
            if isinstance(leaf, Shared):
                return leaf.value.device
        return torch.device("cpu")

    def _constant(self, name: str, device: torch.device) -> Tensor:
        key = (name, device)
        if key not in self._placed:
            value = self._constants[name]
            if value.is_meta and device.type != "meta":
                raise SequentializeError(
                    f"constant {name!r} of segment {self.index} ({self.label}) was traced on "
                    "the meta device and has no value; trace on a real device, or make it a "
                    "buffer of the module"
                )
            self._placed[key] = value.to(device)
        return self._placed[key]

    def forward(self, inputs: Any) -> Any:
        program = self.programs[self.training]
        tensors = [getattr(owner, kind)[name] for owner, kind, name
                   in self._tensor_slots(self.training)]
        device = self._device(tensors, inputs)
        if self.index == 0:
            assert self.input_spec is not None
            values = self.input_spec.leaves(inputs, device)
        else:
            values = inputs
            if not isinstance(values, tuple) or len(values) != len(program.incoming):
                raise TypeError(
                    f"segment {self.index} ({self.label}) expects the {len(program.incoming)} "
                    f"values segment {self.index - 1} sends ({program.incoming[:6]} ...); run "
                    "the segments in order, as the sequential model does"
                )
        constants = [self._constant(name, device) for name in program.constants]
        out = program.fn(self, device, *values, *constants, *tensors)
        if self.index == self.num_segments - 1:
            assert self.output_spec is not None
            return _plain(pytree.tree_unflatten(list(out), self.output_spec))
        return tuple(out)

    def extra_repr(self) -> str:
        program = self.programs[self.training]
        return (f"index={self.index}, starts at {self.label!r}, receives "
                f"{len(program.incoming)}, sends {len(program.outgoing)}")


def _plain(value: Any) -> Any:
    """Dicts (a Hugging Face ModelOutput among them) as plain dicts, which the pipeline's
    micro-batch gathering rebuilds as plain dicts anyway."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is tuple or type(value) is list:
        return type(value)(_plain(v) for v in value)
    return value


class InputSpec:
    """How the model's inputs arrive at the first segment: the call's structure (one tensor,
    positional arguments, keyword arguments, or both) and the traced leaves."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 spec: pytree.TreeSpec) -> None:
        if kwargs and args:
            self.style = "both"
        elif kwargs:
            self.style = "kwargs"
        elif len(args) == 1 and isinstance(args[0], Tensor | Shared):
            self.style = "single"
        else:
            self.style = "args"
        self.spec = spec
        self.keys = list(kwargs)
        self.defaults = {k: v for k, v in kwargs.items() if not _has_tensor(v)}
        leaves = pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, Shared))
        self.constant_leaves = {i: leaf for i, leaf in enumerate(leaves)
                                if not isinstance(leaf, Tensor | Shared)}
        self.shared = {i for i, leaf in enumerate(leaves) if isinstance(leaf, Shared)}
        # the traced shape of every tensor leaf; dim 0 of a batched one is free (None)
        self.shapes = {
            i: ((leaf.value.shape if isinstance(leaf, Shared) else
                 (None, *leaf.shape[1:]) if leaf.dim() > 0 else leaf.shape), leaf_dtype(leaf))
            for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor | Shared)}

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The object to give the pipeline for a call ``model(*args, **kwargs)``."""
        if self.style == "single":
            return args[0]
        if self.style == "args":
            return tuple(args)
        if self.style == "kwargs":
            return dict(kwargs)
        return (tuple(args), dict(kwargs))

    def unpack(self, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.style == "single":
            return (inputs,), {}
        if self.style == "args":
            return tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,), {}
        if self.style == "kwargs":
            return (), self._ordered(inputs)
        args, kwargs = inputs
        return tuple(args), self._ordered(kwargs)

    def _ordered(self, kwargs: Any) -> dict[str, Any]:
        """The keyword arguments in the example's order, non-tensor ones defaulting to the
        example's values."""
        if not isinstance(kwargs, dict):
            raise TypeError(f"expected the dict of keyword arguments {self.keys}, got "
                            f"{type(kwargs).__name__}; build the inputs with seq.inputs(...)")
        merged = {**self.defaults, **kwargs}
        unknown = sorted(set(merged) - set(self.keys))
        missing = [k for k in self.keys if k not in merged]
        if unknown or missing:
            raise TypeError(
                f"keyword arguments {sorted(kwargs)} do not match the example's {self.keys} "
                f"(unknown {unknown}, missing {missing}); pass the keyword arguments the model "
                "was sequentialized with"
            )
        return {k: merged[k] for k in self.keys}

    def leaves(self, inputs: Any, device: torch.device) -> list[Any]:
        """The leaves the first segment's program takes, checked against the trace."""
        args, kwargs = self.unpack(inputs)
        leaves, spec = pytree.tree_flatten((args, kwargs),
                                           is_leaf=lambda x: isinstance(x, Shared))
        if spec != self.spec:
            raise TypeError(
                f"the inputs have the structure {spec}, but the model was sequentialized "
                f"with {self.spec}; call the pipeline with seq.inputs(*args, **kwargs) built "
                "like the example given to gp.sequentialize"
            )
        out = []
        for i, (shape, dtype) in self.shapes.items():
            tensor = leaves[i].value if isinstance(leaves[i], Shared) else leaves[i]
            if not isinstance(tensor, Tensor):
                raise TypeError(f"input leaf {i} is {type(tensor).__name__}, but the example's "
                                "was a tensor")
            got = (None, *tensor.shape[1:]) if shape and shape[0] is None else tensor.shape
            if tuple(got) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(
                    f"input leaf {i} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, "
                    f"but the model was traced with {tuple(shape)} and {dtype} (None: the "
                    "batch, which may vary); every other size is fixed by the trace: call "
                    "gp.sequentialize again with an example of this shape"
                )
        for i, leaf in enumerate(leaves):
            if i in self.shared:
                if not isinstance(leaf, Shared):
                    raise TypeError(f"input leaf {i} was gp.Shared in the example; wrap it in "
                                    "gp.Shared in every call too")
                out.append(leaf.value.to(device))
            elif i in self.constant_leaves:
                if leaf != self.constant_leaves[i]:
                    raise ValueError(
                        f"input leaf {i} is {leaf!r}, but the model was traced with "
                        f"{self.constant_leaves[i]!r} (a non-tensor value is fixed by the "
                        "trace); call gp.sequentialize again with this value, or pass it as a "
                        "0-dim tensor"
                    )
                out.append(leaf)
            else:
                if isinstance(leaf, Shared):
                    raise TypeError(f"input leaf {i} is gp.Shared, but the example's was not")
                out.append(leaf)
        return out


def leaf_dtype(leaf: Tensor | Shared) -> torch.dtype:
    return leaf.value.dtype if isinstance(leaf, Shared) else leaf.dtype


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, Tensor | Shared)
               for leaf in pytree.tree_leaves(value, is_leaf=lambda x: isinstance(x, Shared)))


def _original_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   local_metadata: Any) -> None:
    """Saving: ``<container prefix><segment name>.<key>`` becomes ``<container prefix><key>``
    (the original key), with the aliases of shared weights added."""
    assert isinstance(module, Segment)
    if not module._renaming:
        return
    own = module.layer_name + "."
    outer = prefix[: -len(own)] if prefix.endswith(own) else prefix
    if outer != prefix:
        for key in module.local_keys():
            if prefix + key in state_dict:
                state_dict[outer + key] = state_dict.pop(prefix + key)
    for alias, canonical in module.alias_keys.items():
        if outer + canonical in state_dict:
            state_dict[outer + alias] = state_dict[outer + canonical]


def _drop_aliases(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Loading into a segment directly: an alias of a shared weight is the same tensor as its
    canonical key, loaded once."""
    assert isinstance(module, Segment)
    for alias in module.alias_keys:
        state_dict.pop(prefix + alias, None)


def _segment_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  *args: Any) -> None:
    """Loading into a container of segments: each original key goes to the segment that
    holds it (``<segment name>.<key>``); aliases of shared weights are dropped."""
    for name, child in module._modules.items():
        if not isinstance(child, Segment):
            continue
        for key in child.local_keys():
            if prefix + key in state_dict:
                state_dict[f"{prefix}{name}.{key}"] = state_dict.pop(prefix + key)
        for alias in child.alias_keys:
            state_dict.pop(prefix + alias, None)


_HOOKED = "_gp_sequentialize_load_hook"
_registration: Any = None


def _on_register(parent: nn.Module, name: str, submodule: nn.Module | None) -> None:
    if isinstance(submodule, Segment) and not getattr(parent, _HOOKED, False):
        parent.register_load_state_dict_pre_hook(_segment_keys)
        object.__setattr__(parent, _HOOKED, True)


def install_naming_hooks() -> Callable[..., Any]:
    """Whenever a segment is added to a container (the sequential model, GPipe,
    DistributedGPipe, ...), the container learns to load original keys into it.

    ``torch.nn``'s module-registration hook is process-wide; it acts on segments only and is
    installed once, by the first ``sequentialize`` call.
    """
    global _registration
    if _registration is None:
        _registration = nn.modules.module.register_module_module_registration_hook(
            _on_register)
    return _registration
