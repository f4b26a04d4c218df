"""Re-materialization policy and the per-layer random streams that make recomputation exact.

With re-materialization a partition keeps only its input for each micro-batch; its forward runs
without autograd and is run again, with autograd, just before its backward. For the recomputed
forward to equal the first one, every random draw (dropout masks, drop-path, noise) must repeat.
Rather than saving and restoring generator states, each layer's forward on each micro-batch draws
from a generator seeded by ``derive_seed(seed, step, mb_index, layer_index)``. That makes results
independent of how the model is cut into partitions, of the checkpoint mode and of whether the
partitions live in one process or many.

The choice of what to recompute is either a mode for every stage (``"always"``,
``"except_last"``, ``"never"``: whole partitions, by micro-batch) or a :class:`Remat`: per
stage, the layers whose activations are kept; the others are recomputed in backward, each run
of them from its own input (the nearest kept boundary), for every micro-batch::

    gp.GPipe(model, balance=[4, 4], chunks=8, checkpoint=[{0, 1}, {0, 1, 2, 3}])
    # stage 0 keeps layers 0 and 1 (of its own, counted from 0) and recomputes 2 and 3;
    # stage 1 keeps everything (as "never")
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["CheckpointMode", "CHECKPOINT_MODES", "Checkpoint", "Remat", "as_checkpoint",
           "check_pipeline_args", "checkpoint_stop", "derive_seed", "fork_rng", "layer_seeds",
           "seed_rng"]

CheckpointMode = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[str, ...] = ("always", "except_last", "never")

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Remat:
    """Selective re-materialization: ``keep[s]`` holds the layers of stage s (indices within
    the stage, from 0) whose activations are kept from forward to backward; every other layer
    runs without autograd in forward and again, with it, in backward, each maximal run of such
    layers from the input it received (the only tensor the run keeps). Applies to every
    micro-batch. ``Remat([set(), set()])`` recomputes as ``"always"`` does; a stage that
    keeps all its layers runs as ``"never"``. Written as text (a checkpoint's ``index.json``)
    ``keep:[[0, 1], []]``, which :func:`as_checkpoint` reads back.
    """

    keep: tuple[frozenset[int], ...]

    def __init__(self, keep: Iterable[Iterable[int]]) -> None:
        if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
            raise TypeError(f"Remat(keep={keep!r}) takes one collection of layer indices per "
                            "stage, e.g. Remat([{0, 1}, set()])")
        stages = []
        for s, layers in enumerate(keep):
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
                raise TypeError(f"Remat keep[{s}]={layers!r} is not a collection of layer "
                                "indices; give a set such as {0, 2} (or set() to recompute all)")
            indices = list(layers)
            bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or i < 0]
            if bad:
                raise ValueError(f"Remat keep[{s}] has {bad}: layer indices are integers >= 0, "
                                 "counted from each stage's first layer")
            stages.append(frozenset(indices))
        if not stages:
            raise ValueError("Remat(keep=[]) names no stage; give one set of kept layers per "
                             "stage")
        object.__setattr__(self, "keep", tuple(stages))

    @property
    def num_stages(self) -> int:
        return len(self.keep)

    def check(self, balance: Sequence[int]) -> None:
        """ValueError unless this choice fits a pipeline of ``balance`` layers per stage."""
        if len(self.keep) != len(balance):
            raise ValueError(f"checkpoint gives kept layers for {len(self.keep)} stages but "
                             f"balance={list(balance)} has {len(balance)}; give one set per "
                             "stage")
        for s, (layers, count) in enumerate(zip(self.keep, balance, strict=True)):
            outside = sorted(i for i in layers if i >= count)
            if outside:
                raise ValueError(f"checkpoint keeps layers {outside} of stage {s}, which has "
                                 f"{count} layers (0..{count - 1}); indices count from each "
                                 "stage's first layer")

    def runs(self, stage_index: int, num_layers: int) -> list[tuple[int, int, bool]]:
        """Stage ``stage_index``'s layers as maximal runs ``(start, stop, kept)``."""
        kept = self.keep[stage_index]
        result: list[tuple[int, int, bool]] = []
        for i in range(num_layers):
            if result and result[-1][2] == (i in kept):
                start, _, flag = result[-1]
                result[-1] = (start, i + 1, flag)
            else:
                result.append((i, i + 1, i in kept))
        return result

    def __str__(self) -> str:
        return "keep:" + json.dumps([sorted(layers) for layers in self.keep])


Checkpoint = str | Remat


def as_checkpoint(value: Any) -> Checkpoint:
    """A ``checkpoint=`` argument in its one form: a mode name, or a :class:`Remat` from a
    ``Remat``, a sequence of per-stage sets of kept layers, or its text ``keep:[[...], ...]``."""
    if isinstance(value, Remat):
        return value
    if isinstance(value, str):
        if value.startswith("keep:"):
            try:
                return Remat(json.loads(value[len("keep:"):]))
            except json.JSONDecodeError as error:
                raise ValueError(f"checkpoint={value!r} is not keep: followed by a JSON list "
                                 "of per-stage lists of layer indices") from error
        if value not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint={value!r} is not one of {list(CHECKPOINT_MODES)}, a "
                             "gp.Remat or one set of kept layer indices per stage")
        return value
    if isinstance(value, Iterable):
        return Remat(value)
    raise TypeError(f"checkpoint={value!r} must be one of {list(CHECKPOINT_MODES)}, a gp.Remat "
                    "or one set of kept layer indices per stage")


def checkpoint_stop(mode: Checkpoint, num_microbatches: int) -> int:
    """Micro-batches with index below the returned value are re-materialized (with a
    :class:`Remat`: every one, each as far as the choice says).

    ``except_last`` spares the last micro-batch: under fill-drain its backward runs right after
    its forward, so recomputing it would only cost time.
    """
    if isinstance(mode, Remat) or mode.startswith("keep:"):
        return num_microbatches
    if mode == "always":
        return num_microbatches
    if mode == "except_last":
        return num_microbatches - 1
    if mode == "never":
        return 0
    raise ValueError(f"checkpoint={mode!r} is not one of {CHECKPOINT_MODES}")


def check_pipeline_args(*, chunks: int, checkpoint: Any,
                        balance: Sequence[int] | None = None) -> Checkpoint:
    """The arguments ``GPipe`` and ``DistributedGPipe`` share, checked once for both (and for
    the apps' configs): ``chunks`` a positive integer, ``checkpoint`` a known mode or a
    per-stage choice (:func:`as_checkpoint`) that fits ``balance``; returns the choice."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive integer (1 = no micro-batching)")
    choice = as_checkpoint(checkpoint)
    if isinstance(choice, Remat) and balance is not None:
        choice.check(balance)
    return choice


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


_MULTIPLIER = 0x9E3779B97F4A7C15  # odd, so the polynomial below mixes every part


def derive_seed(seed: int, step: int, mb_index: int, layer_index: int) -> int:
    """A 63-bit seed for one layer's forward on one micro-batch of one training step.

    The parts are combined as a polynomial in a large odd multiplier (mod 2^64), then scrambled
    once by splitmix64: cheap enough to run for every layer of every micro-batch.
    """
    return layer_seeds(seed, step, mb_index, layer_index, 1)[0]


def layer_seeds(seed: int, step: int, mb_index: int, first_layer: int, count: int) -> list[int]:
    """``derive_seed`` for layers ``first_layer ... first_layer + count - 1`` at once."""
    value = seed & _MASK64
    for part in (step, mb_index):
        value = (value * _MULTIPLIER + (part & _MASK64)) & _MASK64
    value = (value * _MULTIPLIER) & _MASK64
    return [
        _splitmix64((value + (layer & _MASK64)) & _MASK64) >> 1
        for layer in range(first_layer, first_layer + count)
    ]


@contextmanager
def fork_rng(devices: Sequence[torch.device]) -> Iterator[None]:
    """Save the CPU generator (and CUDA generators of ``devices``) and restore them on exit.

    A pipeline's forward thus leaves the caller's random stream exactly where it was.
    """
    cpu_state = torch.get_rng_state()
    cuda_states = [
        (d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda"
    ]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        for device, state in cuda_states:
            torch.cuda.set_rng_state(state, device)


def seed_rng(seed: int, device: torch.device) -> None:
    """Seed the generators a layer on ``device`` draws from (CPU always, CUDA when used)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
