"""Re-materialization policy and the per-layer random streams that make recomputation exact.

With re-materialization a partition keeps only its input for each micro-batch; its forward runs
without autograd and is run again, with autograd, just before its backward. For the recomputed
forward to equal the first one, every random draw (dropout masks, drop-path, noise) must repeat.
Rather than saving and restoring generator states, each layer's forward on each micro-batch draws
from a generator seeded by ``derive_seed(seed, step, mb_index, layer_index)``. That makes results
independent of how the model is cut into partitions, of the checkpoint mode and of whether the
partitions live in one process or many.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch

__all__ = ["CheckpointMode", "CHECKPOINT_MODES", "check_pipeline_args", "checkpoint_stop", "derive_seed", "fork_rng",
           "layer_seeds", "seed_rng"]

CheckpointMode = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[str, ...] = ("always", "except_last", "never")

_MASK64 = (1 << 64) - 1


def checkpoint_stop(mode: str, num_microbatches: int) -> int:
    """Micro-batches with index below the returned value are re-materialized.

    ``except_last`` spares the last micro-batch: under fill-drain its backward runs right after
    its forward, so recomputing it would only cost time.
    """
    if mode == "always":
        return num_microbatches
    if mode == "except_last":
        return num_microbatches - 1
    if mode == "never":
        return 0
    raise ValueError(f"checkpoint={mode!r} is not one of {CHECKPOINT_MODES}")


def check_pipeline_args(*, chunks: int, checkpoint: str) -> None:
    """The arguments ``GPipe`` and ``DistributedGPipe`` share, checked once for both (and for
    the apps' configs): ``chunks`` a positive integer, ``checkpoint`` a known mode."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive integer (1 = no micro-batching)")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={checkpoint!r} is not one of {list(CHECKPOINT_MODES)}")


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
