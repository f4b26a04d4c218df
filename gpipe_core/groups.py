"""Process groups for pipeline x data parallelism, initialised from torchrun's environment."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from .cpu import bind_cpus, hold_freed_memory

__all__ = ["init_process_groups", "default_device", "group_timeout_s"]

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _watch_launcher(poll_s: float = 1.0) -> None:
    """Under torchrun, send this worker SIGTERM when its agent dies (a lost node).

    A worker whose agent was killed would otherwise run on as an orphan, and the agent of the
    other node would count the job a success. A daemon thread polls the parent's pid; SIGTERM
    lets a training loop checkpoint and stop (see apps.harness.guards.Interrupt), and its peers see the
    stop too.
    """
    global _launcher_watched
    if "TORCHELASTIC_RUN_ID" not in os.environ or _launcher_watched:
        return
    _launcher_watched = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gpipe-launcher-watch", daemon=True).start()


_launcher_watched = False


def init_process_groups(
    num_stages: int,
    *,
    backend: str | None = None,
    timeout_s: float = 60.0,
    pin_cpus: bool = False,
    hold_memory: bool = False,
) -> tuple[Any, Any]:
    """Initialise torch.distributed from torchrun's environment and build the two groups.

    Ranks are laid out pipeline-major: with world size ``W`` and ``K = num_stages`` there are
    ``W / K`` replicas; replica ``r`` holds ranks ``r*K ... r*K + K-1`` (its stages in order).
    Returns ``(pipeline_group, data_parallel_group)`` of the calling rank; the data-parallel
    group links the ranks that hold the same stage. Backend: NCCL with CUDA, else gloo.
    ``pin_cpus``: first give each local rank its own share of the CPU cores
    (:func:`~gpipe_core.bind_cpus`); ``hold_memory``: keep freed blocks mapped
    (:func:`~gpipe_core.hold_freed_memory`). Both are worth it when stages compute on the CPU.

    ``timeout_s`` bounds every wait: the default group's collectives and both groups built here
    (``new_group`` without a timeout would wait torch's default, 30 minutes with gloo), and the
    pipeline's point-to-point messages, since :class:`~gpipe_core.DistributedGPipe` takes its
    timeout from its group (:func:`group_timeout_s`). A rank whose peer stops answering fails
    within ``timeout_s`` plus at most :data:`~gpipe_core.failure.NAMING_S` seconds, spent finding
    out which rank failed so that the error can name it.
    """
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    if not dist.is_initialized() and not all(k in os.environ for k in _TORCHRUN_ENV):
        missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
        raise RuntimeError(
            f"not launched by torchrun ({', '.join(missing)} unset): start one process per "
            f"stage with `python -m torch.distributed.run --nproc-per-node {num_stages} "
            "<script>` (or call dist.init_process_group yourself first)"
        )
    _watch_launcher()
    if pin_cpus:
        bind_cpus()
    if hold_memory:
        hold_freed_memory()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % num_stages != 0:
        raise ValueError(
            f"world size {world} is not a multiple of num_stages={num_stages}; launch "
            f"torchrun with --nproc-per-node a multiple of {num_stages}"
        )
    replicas = world // num_stages
    pipeline_group = data_group = None
    # new_group must be called by every rank for every group, in the same order; each gets the
    # same bound as the default group (torch's default for a new group is 30 minutes).
    timeout = datetime.timedelta(seconds=timeout_s)
    for replica in range(replicas):
        ranks = list(range(replica * num_stages, (replica + 1) * num_stages))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            pipeline_group = group
    for stage in range(num_stages):
        ranks = [replica * num_stages + stage for replica in range(replicas)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            data_group = group
    return pipeline_group, data_group


def default_device() -> torch.device:
    """Where a rank's stage lives by default: its current CUDA device with NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_timeout_s(group: Any = None) -> float:
    """The timeout, in seconds, of ``group``'s collectives (default: the whole world's).

    It is the bound the group was created with (``init_process_groups(timeout_s=...)``,
    ``dist.init_process_group(timeout=...)`` or ``dist.new_group(timeout=...)``), read back from
    the process group itself so that callers never keep a second copy of it.

    torch has no public reader for it: this reads ``ProcessGroup._get_backend(device)
    .options._timeout``. Where that is missing (another torch, another backend) it raises
    rather than guess: torch's default (30 minutes with gloo) would silently stretch every
    bound the pipeline promises. ``tests/test_groups.py`` holds the reading against torch.
    """
    pg: Any = group if group is not None else dist.group.WORLD
    backend = dist.get_backend(group)
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    return _backend_timeout_s(pg, device, backend)


def _backend_timeout_s(pg: Any, device: torch.device, backend: str) -> float:
    try:
        timeout = pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError) as error:
        raise RuntimeError(
            f"cannot read the timeout of a {backend!r} process group from torch "
            f"{torch.__version__} (ProcessGroup._get_backend({device.type!r}).options._timeout: "
            f"{error}); pass the bound explicitly (DistributedGPipe(..., timeout_s=...)) and "
            "update gpipe_core.groups.group_timeout_s to this torch") from error
    return float(timeout.total_seconds())
