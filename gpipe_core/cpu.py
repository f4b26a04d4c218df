"""Running a stage well on a CPU host: its own cores, and memory that stays mapped.

Cores. On a CPU-only host every stage of a pipeline is a compute-bound process. Left to the
scheduler, the processes (and gloo's I/O threads) migrate between cores and preempt one
another, and a stage that loses its core for a time slice stalls every stage behind it.
:func:`bind_cpus` pins rank ``r`` of ``n`` on a host to the ``r``-th of ``n`` equal shares of
the usable cores and sets torch's intra-op threads to the share's size. Threads started
afterwards (gloo's) inherit the affinity, so bind before ``torch.distributed`` is initialised.

Memory. glibc hands large blocks (activations of a few hundred KB and up) back to the system
when they are freed, so every micro-batch touches fresh pages and pays a page fault for each
4 KB. :func:`hold_freed_memory` raises glibc's mmap and trim thresholds so freed blocks are
reused instead: the resident size stays at its peak, and the faults go away.

gloo's I/O thread. gloo serves every connection from one I/O thread per process
(``gloo_tcp_loop``) that takes the connection's lock for each event; a caller's send or posted
receive holds the same lock. When a message arrives while the caller holds it, the woken I/O
thread preempts the caller, fails to take the lock and polls again at once (epoll reports the
unread data again): on a core shared with the caller it spins until the scheduler's next tick,
2-4 ms, while the caller cannot finish its call. :class:`QuietIOThreads` marks the I/O threads
``SCHED_BATCH`` (no wake-up preemption) for the length of such a call and restores them after.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch

__all__ = ["cpu_share", "bind_cpus", "hold_freed_memory", "QuietIOThreads"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc malloc.h)


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


def hold_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Keep blocks below ``threshold_bytes`` in this process when they are freed (glibc only).

    Sets glibc's ``M_MMAP_THRESHOLD`` (blocks below it come from the heap, not from fresh
    mappings) and ``M_TRIM_THRESHOLD`` (the heap is not shrunk until that much is free at its
    top). Returns False, changing nothing, where the C library is not glibc.
    """
    if threshold_bytes <= 0:
        raise ValueError(f"threshold_bytes={threshold_bytes} must be positive")
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    # glibc caps the mmap threshold at HEAP_MAX/2 (32 MiB on 64-bit): ask for at most that.
    mmap_threshold = min(threshold_bytes, 32 << 20)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold))
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(threshold_bytes, 2**31 - 1)))
    return bool(ok)


_TASKS = Path("/proc/self/task")


class QuietIOThreads:
    """Keep this process's I/O threads named ``name`` from preempting the caller in a call.

    ``enter()`` before a call into the communication library, ``leave()`` after it (a context
    manager would cost more than the two system calls on this hot path). Does nothing where
    the OS lacks ``SCHED_BATCH`` or where the threads' policy cannot be changed.
    """

    def __init__(self, name: str = "gloo_tcp_loop") -> None:
        self.name = name
        self.enabled = hasattr(os, "SCHED_BATCH") and _TASKS.is_dir()
        # (policy in a call, policy otherwise); never used when not enabled
        self._policies = (os.SCHED_BATCH, os.SCHED_OTHER) if self.enabled else (0, 0)
        self._threads: list[int] = []
        self._tasks_seen = -1

    def refresh(self) -> list[int]:
        """Find the threads again when the process's thread count changed (new groups), or
        while none has been found (a new thread names itself after it starts)."""
        if not self.enabled:
            return []
        try:
            tasks = os.listdir(_TASKS)
            if len(tasks) != self._tasks_seen or not self._threads:
                self._tasks_seen = len(tasks)
                self._threads = [int(t) for t in tasks if _thread_name(t) == self.name]
        except OSError:
            self._threads = []
        return self._threads

    def enter(self) -> None:
        self._set(self._policies[0])

    def leave(self) -> None:
        self._set(self._policies[1])

    def _set(self, policy: int) -> None:
        if not self._threads:
            return
        param = os.sched_param(0)
        for tid in self._threads:
            try:
                os.sched_setscheduler(tid, policy, param)
            except OSError:  # the thread ended, or changing it is not allowed: stop trying
                self._threads = []
                self._tasks_seen = -1
                return


def _thread_name(tid: str) -> str:
    try:
        return (_TASKS / tid / "comm").read_text().strip()
    except OSError:
        return ""
