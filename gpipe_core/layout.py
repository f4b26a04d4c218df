"""A pipeline's layout as a checkpoint records it: stage split, placement, schedule, chunks.

``DistributedGPipe.save_checkpoint`` writes it into the checkpoint's ``index.json`` (key
``"pipeline"``, see :mod:`gpipe_core.storage`)::

    "pipeline": {"balance": [3, 3], "placement": [0, 1], "num_ranks": 2, "schedule": "gpipe",
                 "chunks": 4, "checkpoint": "except_last", "loss_reduction": "mean",
                 "deferred_batch_norm": false, "tied": null, "seed": 0, "steps_done": 12}

and ``DistributedGPipe.from_checkpoint`` reads it back (:func:`read_layout`) to build the same
pipeline, or one of another number of stages: :meth:`PipelineLayout.merged_balance` joins
adjacent recorded stages when the new count divides the recorded one. A checkpoint written
before layouts were recorded has none (``read_layout`` returns None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .storage import INDEX, CheckpointCorruptError, read_index

__all__ = ["PipelineLayout", "read_layout", "stage_split"]


@dataclass(frozen=True)
class PipelineLayout:
    """How a pipeline was built when it wrote a checkpoint.

    ``balance``: layers per stage; ``placement[s]``: the pipeline rank that ran stage s;
    ``num_ranks``: the pipeline group's size; ``schedule``: the schedule's name (None when a
    factory built it: it cannot be rebuilt from a name); ``chunks``, ``checkpoint``,
    ``loss_reduction``, ``deferred_batch_norm``, ``tied`` and ``seed`` as given to
    ``DistributedGPipe``; ``steps_done``: training steps run (part of every layer's random
    seed, so a pipeline built from the checkpoint continues the random streams).
    """

    balance: tuple[int, ...]
    placement: tuple[int, ...]
    num_ranks: int
    schedule: str | None
    chunks: int
    checkpoint: str = "except_last"
    loss_reduction: str = "mean"
    deferred_batch_norm: bool = False
    tied: tuple[str, str] | None = None
    seed: int | None = None
    steps_done: int = 0

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    @property
    def stages_per_rank(self) -> int:
        """Virtual stages on each rank (1 for a schedule of one stage per rank)."""
        return max(1, self.num_stages // max(1, self.num_ranks))

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["balance"], record["placement"] = list(self.balance), list(self.placement)
        record["tied"] = list(self.tied) if self.tied is not None else None
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> PipelineLayout:
        tied = record.get("tied")
        return cls(
            balance=tuple(int(n) for n in record["balance"]),
            placement=tuple(int(r) for r in record["placement"]),
            num_ranks=int(record["num_ranks"]),
            schedule=record.get("schedule"),
            chunks=int(record["chunks"]),
            checkpoint=str(record.get("checkpoint", "except_last")),
            loss_reduction=str(record.get("loss_reduction", "mean")),
            deferred_batch_norm=bool(record.get("deferred_batch_norm", False)),
            tied=(str(tied[0]), str(tied[1])) if tied else None,
            seed=None if record.get("seed") is None else int(record["seed"]),
            steps_done=int(record.get("steps_done", 0)),
        )

    def merged_balance(self, num_stages: int) -> list[int] | None:
        """The recorded split as ``num_stages`` stages: as recorded, or each run of
        ``len(balance) // num_stages`` adjacent recorded stages joined into one; None when
        ``num_stages`` does not divide the recorded number of stages (a new split is needed).

        ``[2, 2, 2, 2]`` as 2 stages is ``[4, 4]``; as 3 stages it is None.
        """
        if num_stages < 1 or self.num_stages % num_stages:
            return None
        run = self.num_stages // num_stages
        return [sum(self.balance[i : i + run]) for i in range(0, self.num_stages, run)]


def read_layout(directory: str | Path) -> PipelineLayout | None:
    """The layout recorded in a checkpoint's ``index.json``; None for a checkpoint written
    before layouts were recorded (or by ``save_shards`` without a pipeline)."""
    record = read_index(directory).get("pipeline")
    if record is None:
        return None
    try:
        return PipelineLayout.from_json(record)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint index {Path(directory) / INDEX} has a damaged pipeline record "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def stage_split(
    directory: str | Path,
    layout: PipelineLayout | None,
    *,
    num_layers: int,
    num_ranks: int,
    num_stages: int | None = None,
    balance: Sequence[int] | None = None,
    resplit: Callable[[int], Sequence[int]] | None = None,
) -> list[int]:
    """The stage split of a pipeline of ``num_ranks`` built from the checkpoint ``directory``
    of ``layout`` (None: written before layouts were recorded), ``num_layers`` layers.

    ``balance`` when given; else the recorded split as ``num_stages`` stages (default: the
    recorded stages per rank times ``num_ranks``), joined if need be
    (:meth:`PipelineLayout.merged_balance`); else ``resplit(num_stages)``; else ValueError
    naming the values and the fix. ValueError too when the checkpoint's model has another
    number of layers.
    """
    if layout is not None and sum(layout.balance) != num_layers:
        raise ValueError(
            f"checkpoint {directory} holds a model of {sum(layout.balance)} layers "
            f"(balance {list(layout.balance)}), but module has {num_layers}; build the "
            "module with the configuration the checkpoint was trained with"
        )
    if num_stages is None:
        num_stages = num_ranks * (layout.stages_per_rank if layout is not None else 1)
    if balance is None and layout is not None:
        balance = layout.merged_balance(num_stages)
    if balance is None and resplit is not None:
        balance = resplit(num_stages)
    if balance is not None:
        return list(balance)
    fix = (f"pass balance= with {num_stages} entries that sum to {num_layers} (or "
           "resplit=gp.balance_by_params to split the layers anew)")
    if layout is None:
        raise ValueError(
            f"checkpoint {directory} was written before index.json recorded the pipeline's "
            f"stage split; {fix}: the split it was trained with, e.g. from its run.json, lets "
            "each rank read only its own shard")
    raise ValueError(
        f"checkpoint {directory} records {layout.num_stages} stages on {layout.num_ranks} ranks "
        f"(balance {list(layout.balance)}, schedule {layout.schedule!r}); this pipeline of "
        f"{num_ranks} ranks needs {num_stages} stages, and {layout.num_stages} stages cannot be "
        f"joined into {num_stages}; {fix}, or launch {layout.num_ranks} ranks")
