"""An NMT checkpoint, loaded: its config, the corpus's tokenizer (checked against the
fingerprint the checkpoint was trained with) and its weights, in one process
(:func:`load_checkpoint`) or as this rank's stage of a pipeline under torchrun
(:func:`load_pipeline`).

Every error says the fix: no checkpoint (the train command, ``apps.nmt.commands``), a damaged
one, another app's, a missing corpus (its prepare command), a tokenizer that is not the one the
checkpoint was trained with (:class:`TokenizerMismatch`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

import gpipe_core as gp
from apps.config import ConfigError
from apps.harness import checkpoints
from apps.harness.checkpoints import CheckpointError
from apps.nmt.commands import TRAIN_COMMAND, prepare_command
from apps.nmt.config import NMTConfig, build_model, load_nmt_config
from apps.nmt.data import CorpusError, Tokenizer, load_manifest, load_tokenizer

if TYPE_CHECKING:
    from apps.harness.run import Run

__all__ = ["LOAD_ERRORS", "LoadedCheckpoint", "TokenizerMismatch", "load_checkpoint",
           "load_model", "load_pipeline", "resolve_checkpoint"]


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory behind ``path``: a run's out_dir (its ``latest``) or a step dir."""
    return checkpoints.resolve_checkpoint(path, train_command=f"{TRAIN_COMMAND} --out_dir={path}")


def load_model(config: NMTConfig, checkpoint_dir: str | Path, device: torch.device) -> nn.Sequential:
    """The plain ``nn.Sequential`` of ``config`` with the weights of a (sharded) checkpoint."""
    model = build_model(config, device="meta")
    state = gp.load_shards(checkpoint_dir)
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


class TokenizerMismatch(ValueError):
    """The corpus's tokenizer is not the one the checkpoint was trained with."""


# What :func:`load_checkpoint` raises for a checkpoint, corpus or option the user can fix: a
# command prints it as one ``error:`` line
LOAD_ERRORS: tuple[type[Exception], ...] = (
    CheckpointError, gp.CheckpointCorruptError, CorpusError, ConfigError, TokenizerMismatch)


@dataclass
class LoadedCheckpoint:
    """What translating with a checkpoint needs: its folder, config, tokenizer and model."""

    path: Path
    config: NMTConfig
    tokenizer: Tokenizer
    model: nn.Sequential | None


def load_checkpoint(ckpt: str | Path, *, data_dir: str | None = None,
                    device: torch.device | None = None, model: bool = True) -> LoadedCheckpoint:
    """The NMT checkpoint under ``ckpt`` (a run's out_dir or a step folder), in one process.

    Checks, each with an error that says the fix: a checkpoint exists (CheckpointError naming
    the train command) and is intact (gp.CheckpointCorruptError), it is an NMT one (not
    AmoebaNet's), its config loads, the corpus (``data_dir``, default the config's) is prepared
    (CorpusError naming the prepare command), and the corpus's tokenizer has the fingerprint
    the checkpoint was trained with (TokenizerMismatch). ``model=False`` skips the weights.

    The folder stays pinned (``checkpoints.resolve_checkpoint``) until its weights are loaded:
    with ``model=False``, call ``checkpoints.unpin(loaded.path)`` after loading them.
    """
    path = resolve_checkpoint(ckpt)
    checkpoints.require_app(path, "nmt")
    config_path = path / "config.yaml"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.yaml; was it written by apps.nmt.train?")
    overrides = [f"--config={config_path}"]
    if data_dir is not None:
        overrides.append(f"--data_dir={data_dir}")
    try:
        config = load_nmt_config(overrides)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from error
    try:
        load_manifest(config.data_dir)
    except CorpusError as error:
        raise CorpusError(
            f"no prepared corpus at {config.data_dir} for checkpoint {path}; build it with "
            f"`{prepare_command(config)}` (or pass --data-dir)"
        ) from error
    tokenizer = load_tokenizer(config.data_dir)
    trained_with = json.loads((path / "tokenizer.json").read_text())
    if trained_with["fingerprint"] != tokenizer.fingerprint:
        raise TokenizerMismatch(
            f"checkpoint {path} was trained with tokenizer {trained_with['fingerprint']} "
            f"({trained_with.get('data_dir')}), but {config.data_dir} holds tokenizer "
            f"{tokenizer.fingerprint}; use the corpus it was trained on "
            f"(--data-dir), or rebuild that corpus with `{prepare_command(config)}`"
        )
    weights = None
    if model:
        weights = load_model(config, path, device or torch.device("cpu"))
        checkpoints.unpin(path)  # in memory now: a running trainer may rotate it away
    return LoadedCheckpoint(path, config, tokenizer, weights)


def load_pipeline(loaded: LoadedCheckpoint, *, device: str = "cpu",
                  num_stages: int | None = None) -> tuple[gp.DistributedGPipe, Run]:
    """Under torchrun: process groups and this rank's stage of the checkpoint's model, one
    pipeline of ``num_stages`` (default: the world size), one stage per rank, built on the
    ``meta`` device by ``DistributedGPipe.from_checkpoint``: the stage split the checkpoint
    records (its stages joined when ``num_stages`` divides their number; each rank then reads
    only the shards holding its layers), else, for another number of stages or a checkpoint
    written before the split was recorded, the layers split by parameters.
    """
    from apps.harness.run import setup_run  # the process groups: only under torchrun

    config = loaded.config
    num_stages = num_stages or int(os.environ["WORLD_SIZE"])
    run = setup_run(num_stages=num_stages, device=device, timeout_s=config.timeout_s)
    # a run still training may have published another checkpoint while the ranks resolved
    loaded.path = checkpoints.agree_on_checkpoint(loaded.path)
    pipe = gp.DistributedGPipe.from_checkpoint(
        loaded.path, build_model(config, device="meta"), num_stages=num_stages,
        resplit=gp.balance_by_params, schedule="gpipe", chunks=1, device=run.device,
        group=run.pipeline_group, seed=config.seed)
    return pipe, run
