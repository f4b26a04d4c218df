"""What the apps ask of gpipe_core to build their pipeline: valid options, the balance."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import gpipe_core as gp
from apps.config import ConfigError
from gpipe_core.microbatch import map_tensors
from gpipe_core.precision import check_precision
from gpipe_core.remat import check_pipeline_args


def check_pipeline_options(*, schedule: str, checkpoint: str, num_stages: int,
                           chunks: int, precision: str = "fp32") -> None:
    """ConfigError, with gpipe_core's own message, unless the library runs ``schedule``
    (``gpipe``, ``1f1b``, ``1f1b_slackN``, ...) with ``num_stages`` x ``chunks`` and knows the
    re-materialization mode ``checkpoint`` and the ``precision``. The apps keep no list of
    their own."""
    try:
        gp.get_schedule(schedule, num_stages, chunks)
    except ValueError as error:
        raise ConfigError(f"schedule={schedule!r}: {error}") from None
    try:
        check_pipeline_args(chunks=chunks, checkpoint=checkpoint)
        check_precision(precision)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def choose_balance(build_meta: Callable[[], torch.nn.Sequential], sample: Any, num_stages: int,
                   *, seed: int, device: torch.device, max_parameters: int) -> list[int]:
    """Layers per stage by the measured forward+backward time of each layer on ``sample`` (one
    micro-batch); by parameters for models over ``max_parameters``, too large to time whole.

    Parameter counts mislead both apps: AmoebaNet's early cells work on large maps with few
    parameters, and the Transformer's embedding holds many parameters for little compute while
    its output projection does much (a 4k x d vocabulary matmul per token). Timing differs
    between processes, so global rank 0 times a plain copy (then drops it) and every rank gets
    its result.
    """
    model = build_meta()
    if sum(p.numel() for p in model.parameters()) > max_parameters:
        return list(gp.balance_by_params(model, num_stages))
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        plain = gp.materialize(build_meta(), seed=seed, device=device)
        sample = map_tensors(sample, lambda t: t.to(device))
        result[0] = list(gp.balance_by_time(plain, sample, num_stages))
        del plain
    with gp.collectives("choosing the balance"):
        dist.broadcast_object_list(result, src=0)
    return list(result[0])
