"""Giving each local rank its own CPU cores.

On a CPU-only host every stage of a pipeline is a compute-bound process. Left to the scheduler,
the processes (and gloo's I/O threads) migrate between cores and preempt one another, and a
stage that loses its core for a time slice stalls every stage behind it. Pinning rank ``r`` of
``n`` on a host to the ``r``-th of ``n`` equal shares of the usable cores removes that, and
sets torch's intra-op threads to the share's size. Threads started afterwards (gloo's) inherit
the affinity, so bind before ``torch.distributed`` is initialised.
"""

from __future__ import annotations

import os

import torch

__all__ = ["cpu_share", "bind_cpus"]


def cpu_share(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores of ``local_rank``'s share when ``cores`` are split into equal contiguous shares.

    With fewer cores than ranks, ranks share cores round-robin (one core each).
    """
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"local_rank={local_rank} must be in [0, local_world_size={local_world_size})"
        )
    if not cores:
        raise ValueError("no CPU cores to share")
    cores = sorted(cores)
    if len(cores) < local_world_size:
        return [cores[local_rank % len(cores)]]
    per_rank = len(cores) // local_world_size
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def bind_cpus(local_rank: int | None = None, local_world_size: int | None = None) -> list[int]:
    """Pin this process to its share of the cores it may use; return the share.

    ``local_rank`` and ``local_world_size`` default to torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``. Also sets ``torch.set_num_threads`` to the share's size.
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not hasattr(os, "sched_setaffinity"):  # not Linux: leave placement to the OS
        return []
    share = cpu_share(sorted(os.sched_getaffinity(0)), local_rank, local_world_size)
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))
    return share
