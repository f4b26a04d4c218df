"""This rank's place in a run under torchrun: process groups, its device, the CPU knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import gpipe_core as gp


@dataclass
class Run:
    """Where this process sits in a run under torchrun, and on which device it computes.

    The world is ``num_stages`` pipeline ranks times R data-parallel replicas, pipeline-major
    (as ``gp.init_process_groups`` lays it out): ranks ``r*K ... r*K+K-1`` are replica r.
    """

    pipeline_group: Any
    data_group: Any
    rank: int  # global rank
    world_size: int
    num_stages: int
    device: torch.device  # collectives need device tensors under NCCL

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.num_stages

    @property
    def replica(self) -> int:
        return self.rank // self.num_stages

    @property
    def first_rank(self) -> int:
        """Global rank of this replica's first stage."""
        return self.replica * self.num_stages

    @property
    def master(self) -> bool:
        """Global rank 0: the one that prints, logs, evaluates and writes shared files."""
        return self.rank == 0

    def say(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0; nothing elsewhere."""
        if self.master:
            print(*args, **kwargs)

    def broadcast_from_first_stage(self, tensor: Tensor | None, like: Tensor) -> Tensor:
        """The replica's first stage's ``tensor``, on every rank of its pipeline (the others
        pass None; ``like`` gives them shape and dtype)."""
        buffer = (tensor if tensor is not None else like).to(self.device)
        if self.num_stages > 1:
            dist.broadcast(buffer, src=self.first_rank, group=self.pipeline_group)
        return buffer


def setup_run(*, num_stages: int, device: str = "auto", num_threads: int = 1,
              timeout_s: float, pin_cpus: bool = False, hold_memory: bool = False) -> Run:
    """Start a run under torchrun: torch threads, process groups (gloo on CPU, NCCL with
    CUDA), this rank's ``Run``.

    ``device``: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available). ``num_threads``: torch
    intra-op threads per rank (on CPU the stages are the parallelism). Every collective fails
    within ``timeout_s``, naming the rank that hangs. The CPU knobs (``gpipe_core.cpu``):
    ``pin_cpus`` gives each local rank its own share of the cores (``gp.bind_cpus``, gloo's
    threads included; ``num_threads`` still sets the thread count) and ``hold_memory`` keeps
    freed blocks mapped (``gp.hold_freed_memory``).
    """
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    pipeline_group, data_group = gp.init_process_groups(
        num_stages, backend="nccl" if use_cuda else "gloo", timeout_s=timeout_s,
        pin_cpus=pin_cpus, hold_memory=hold_memory,
    )
    torch.set_num_threads(num_threads)  # after pinning, which sets it to the share's size
    return Run(
        pipeline_group=pipeline_group,
        data_group=data_group,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        num_stages=num_stages,
        device=torch.device("cuda", torch.cuda.current_device()) if use_cuda
        else torch.device("cpu"),
    )


def end_run() -> None:
    """Every rank waits for the others, then leaves the process groups: a rank that exits while
    gloo's threads still serve a neighbour can abort ("terminate called without an active
    exception"), so one-shot commands under torchrun end with this."""
    if dist.is_initialized():
        with gp.collectives("the end of the command"):
            dist.barrier()
        dist.destroy_process_group()
