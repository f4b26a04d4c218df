"""An AmoebaNet checkpoint, loaded: the checkpoint under a run's out_dir or step folder and its
config (:func:`find_checkpoint`), its weights in one process (:func:`load_model`), or this
rank's stage of a pipeline under torchrun (:func:`load_pipeline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gpipe_core as gp
from apps.amoebanet.commands import TRAIN_COMMAND
from apps.amoebanet.config import AmoebaNetConfig, build_model, load_amoebanet_config
from apps.amoebanet.data import shard_infos
from apps.harness.checkpoints import agree_on_checkpoint, require_app, resolve_checkpoint
from apps.harness.run import Run, setup_run

__all__ = ["find_checkpoint", "load_checkpoint_config", "load_model", "load_pipeline"]


def load_model(config: AmoebaNetConfig, checkpoint: Path, device: torch.device) -> nn.Module:
    """The plain ``nn.Sequential`` of ``config`` holding the checkpoint's merged shards."""
    model = build_model(config, device="meta")
    model.load_state_dict(gp.load_shards(checkpoint), assign=True)
    return model.to(device).eval()



def load_checkpoint_config(checkpoint: Path, overrides: Sequence[str] = ()) -> AmoebaNetConfig:
    """The config saved with ``checkpoint``, with ``--key=value`` overrides on top."""
    return load_amoebanet_config([f"--config={checkpoint / 'config.yaml'}", *overrides])


def find_checkpoint(ckpt: str | Path, split: str,
                    overrides: Sequence[str]) -> tuple[Path, AmoebaNetConfig]:
    """The AmoebaNet checkpoint under ``ckpt`` and its config with ``overrides``, whose
    dataset has ``split``; an error that says the fix if any of them is missing."""
    checkpoint = resolve_checkpoint(ckpt, train_command=TRAIN_COMMAND.format(out_dir=ckpt))
    require_app(checkpoint, "amoebanet")
    config = load_checkpoint_config(checkpoint, overrides)
    shard_infos(config, split)  # a missing dataset or split fails here, naming the command
    return checkpoint, config



def load_pipeline(checkpoint: Path, config: AmoebaNetConfig, *, num_stages: int,
                  device: str) -> tuple[gp.DistributedGPipe, Run, Path]:
    """Under torchrun: process groups (R replicas x ``num_stages`` stages) and this rank's stage
    of ``checkpoint``, built on the ``meta`` device by ``DistributedGPipe.from_checkpoint``: the
    checkpoint's recorded stage split (each rank reads only the shards of its layers), or the
    layers split by parameters for another number of stages or an older checkpoint. Returns the
    pipe, the run and the checkpoint all ranks agreed on (a run still training may have
    published another one while the ranks resolved it); it stays pinned until ``unpin``."""
    run = setup_run(num_stages=num_stages, device=device, timeout_s=config.timeout_s)
    checkpoint = agree_on_checkpoint(checkpoint)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    pipe = gp.DistributedGPipe.from_checkpoint(
        checkpoint, build_model(config, device="meta"), num_stages=num_stages,
        resplit=gp.balance_by_params, chunks=config.chunks, schedule="gpipe",
        deferred_batch_norm=False, loss_fn=loss_fn, group=run.pipeline_group,
        data_parallel_group=run.data_group if run.num_replicas > 1 else None,
        device=run.device, seed=config.seed, precision=config.precision,
    )
    return pipe, run, checkpoint
