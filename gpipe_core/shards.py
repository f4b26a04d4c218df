"""Weight shards: a model's state dict written as one file per stage, keyed by original names.

A *checkpoint* is a folder (``index.json`` plus files, see :mod:`gpipe_core.storage`); its
weights are *shards* ``shard-{i}-of-{n}.pt``, one per pipeline stage, each holding the stage's
part of the state dict under the original module's names. Shards written with any number of
stages load into the plain module, into ``GPipe`` and, key by key, into a ``DistributedGPipe``
with any other number of stages.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from .failure import collectives
from .storage import FileEntry, read_index, torch_load, verify_checkpoint, write_atomic, write_index

__all__ = ["shard_name", "save_shards", "load_shards", "save_stage_checkpoint"]


def shard_name(shard: int, num_shards: int) -> str:
    """File name of one shard of a checkpoint."""
    return f"shard-{shard:03d}-of-{num_shards:03d}.pt"


def save_shards(
    state_dict: dict[str, Tensor],
    directory: str | Path,
    *,
    shard: int = 0,
    num_shards: int = 1,
    index: bool = True,
) -> dict[str, FileEntry]:
    """Write one shard of a checkpoint: ``shard-{i}-of-{n}.pt`` holding original-name keys.

    The file is written atomically. With ``index`` (and a single shard) ``index.json`` records
    its size and SHA-256; with several shards the caller gathers the returned entries
    (``{name: {"bytes", "sha256"}}``) and writes the index (``DistributedGPipe.save_checkpoint``
    does). Shard 0 of several writes an index listing itself only, which loads unverified
    for the other shards.
    """
    directory = Path(directory)
    name = shard_name(shard, num_shards)
    entry = write_atomic(directory / name, {k: v.detach().cpu() for k, v in state_dict.items()})
    if index and shard == 0:
        write_index(directory, num_shards, {name: entry})
    return {name: entry}


def load_shards(directory: str | Path, *, keys: set[str] | None = None,
                shards: Iterable[int] | None = None) -> dict[str, Tensor]:
    """Merge the shards of a checkpoint into one state dict (optionally only ``keys``, read
    from only the shards numbered ``shards``).

    The result loads into the plain module, into ``GPipe`` and, key by key, into a
    ``DistributedGPipe`` with any number of stages. Each shard is checked against the size and
    SHA-256 in ``index.json`` first: a damaged one raises CheckpointCorruptError naming it.
    """
    directory = Path(directory)
    num_shards = int(read_index(directory)["num_shards"])
    merged: dict[str, Tensor] = {}
    for shard in sorted(set(shards)) if shards is not None else range(num_shards):
        path = directory / shard_name(shard, num_shards)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard {path} is missing")
        verify_checkpoint(directory, [path.name])
        part = torch_load(path, weights_only=True)
        merged.update({k: v for k, v in part.items() if keys is None or k in keys})
    if keys is not None and set(keys) - set(merged):
        raise KeyError(f"checkpoint {directory} lacks {sorted(set(keys) - set(merged))[:5]}")
    return merged


def save_stage_checkpoint(
    state_dict: dict[str, Tensor] | None,
    directory: Path,
    *,
    shard: int,
    num_shards: int,
    files: dict[str, Any] | None = None,
    pipeline: dict[str, Any] | None = None,
) -> None:
    """Collective over the world: every rank writes its shard (unless ``state_dict`` is None)
    and its ``files``; then global rank 0 writes ``index.json`` over all of them (with rank 0's
    ``pipeline`` layout, :mod:`gpipe_core.layout`), and all ranks wait until it exists."""
    entries: dict[str, FileEntry] = {}
    if state_dict is not None:
        entries.update(save_shards(state_dict, directory, shard=shard, num_shards=num_shards,
                                   index=False))
    for name, content in (files or {}).items():
        entries[name] = write_atomic(directory / name, content)
    gathered: list[Any] = [None] * dist.get_world_size()
    with collectives(f"save_checkpoint({directory.name})"):
        dist.all_gather_object(gathered, entries)
        if dist.get_rank() == 0:
            merged: dict[str, FileEntry] = {}
            for part in gathered:
                merged.update(part)
            write_index(directory, num_shards, merged, pipeline=pipeline)
        dist.barrier()
