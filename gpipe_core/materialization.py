"""Materializing layers built on the ``meta`` device, each initialised from its own seed.

A model built on ``meta`` has shapes but no memory, so a pipeline rank can allocate only its own
partition. To make a rank's values equal those of the whole model, initialisation must not
depend on which other layers were initialised before: layer ``i`` is initialised under the seed
``derive_seed(seed, -1, 0, i)``, whether alone on a rank or with all the others in one process.

Initialisation follows PyTorch's deferred-init convention (as FSDP's): after ``to_empty``,
``reset_parameters()`` is called on every submodule that defines it, innermost first, so a
layer's own ``reset_parameters`` (e.g. a scaled initialisation) has the last word. Pass
``init_fn(layer, layer_index)`` to initialise differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from .remat import derive_seed, fork_rng, seed_rng

__all__ = ["materialize", "materialize_layer", "is_meta", "InitFn"]

InitFn = Callable[[nn.Module, int], None]


def is_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` lives on the meta device."""
    tensors = list(module.parameters()) + list(module.buffers())
    return any(t.is_meta for t in tensors)


def _post_order(module: nn.Module) -> Iterable[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def materialize_layer(
    layer: nn.Module,
    layer_index: int,
    *,
    seed: int,
    device: torch.device,
    init_fn: InitFn | None = None,
) -> nn.Module:
    """Allocate ``layer`` on ``device`` and initialise it from its per-layer seed."""
    layer.to_empty(device=device)
    with fork_rng([device]):
        seed_rng(derive_seed(seed, -1, 0, layer_index), device)
        if init_fn is not None:
            init_fn(layer, layer_index)
            return layer
        initialised: set[int] = set()
        for module in _post_order(layer):
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
                initialised.update(id(t) for t in module.parameters())
                initialised.update(id(t) for t in module.buffers())
            # Modules without reset_parameters: their own tensors must be covered by a parent's.
        missing = [
            name
            for name, tensor in list(layer.named_parameters()) + list(layer.named_buffers())
            if id(tensor) not in initialised
        ]
        if missing:
            raise ValueError(
                f"layer {layer_index} ({type(layer).__name__}) was built on the meta device but "
                f"nothing initialises {missing}: give the module owning them a "
                "reset_parameters() method, or pass init_fn=(layer, layer_index) -> None"
            )
    return layer


def materialize(
    module: nn.Sequential,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    init_fn: InitFn | None = None,
) -> nn.Sequential:
    """Materialize a whole ``nn.Sequential`` built on meta exactly as pipeline ranks would."""
    device = torch.device(device)
    for index, layer in enumerate(module._modules.values()):
        assert layer is not None
        materialize_layer(layer, index, seed=seed, device=device, init_fn=init_fn)
    return module
