"""The pipeline layout a checkpoint records, and the stage split chosen from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpipe_core as gp
from gpipe_core.layout import PipelineLayout, stage_split

LAYOUT = PipelineLayout(balance=(2, 2, 2, 2), placement=(0, 1, 0, 1), num_ranks=2,
                        schedule="interleaved_1f1b", chunks=4, tied=("0.weight", "7.weight"),
                        seed=3, steps_done=9)


def test_a_layout_survives_json_and_the_index(tmp_path: Path) -> None:
    assert PipelineLayout.from_json(json.loads(json.dumps(LAYOUT.to_json()))) == LAYOUT
    gp.storage.write_index(tmp_path, 2, {}, pipeline=LAYOUT.to_json())
    assert gp.read_layout(tmp_path) == LAYOUT
    gp.storage.write_index(tmp_path, 2, {})  # as before layouts were recorded
    assert gp.read_layout(tmp_path) is None
    gp.storage.write_index(tmp_path, 2, {}, pipeline={"balance": [2, 2]})
    with pytest.raises(gp.CheckpointCorruptError, match="damaged pipeline record"):
        gp.read_layout(tmp_path)


def test_stages_are_joined_when_the_new_count_divides_the_recorded_one() -> None:
    assert LAYOUT.stages_per_rank == 2
    assert LAYOUT.merged_balance(4) == [2, 2, 2, 2]
    assert LAYOUT.merged_balance(2) == [4, 4]
    assert LAYOUT.merged_balance(1) == [8]
    assert LAYOUT.merged_balance(3) is None
    # on 1 rank: the recorded 2 stages per rank, joined from 4 to 2
    assert stage_split("ckpt", LAYOUT, num_layers=8, num_ranks=1) == [4, 4]
    assert stage_split("ckpt", LAYOUT, num_layers=8, num_ranks=2, num_stages=2) == [4, 4]
    assert stage_split("ckpt", LAYOUT, num_layers=8, num_ranks=3,
                       resplit=lambda n: [3, 3, 2][:n] if n == 3 else [1] * n) == [1] * 6


def test_a_split_that_cannot_be_reused_names_the_values_and_the_fix() -> None:
    with pytest.raises(ValueError) as error:
        stage_split("runs/x", LAYOUT, num_layers=8, num_ranks=3)
    assert str(error.value) == (
        "checkpoint runs/x records 4 stages on 2 ranks (balance [2, 2, 2, 2], schedule "
        "'interleaved_1f1b'); this pipeline of 3 ranks needs 6 stages, and 4 stages cannot be "
        "joined into 6; pass balance= with 6 entries that sum to 8 (or "
        "resplit=gp.balance_by_params to split the layers anew), or launch 2 ranks")
    with pytest.raises(ValueError, match="written before index.json recorded"):
        stage_split("runs/x", None, num_layers=8, num_ranks=2)
    assert stage_split("runs/x", None, num_layers=8, num_ranks=2, balance=[5, 3]) == [5, 3]
    with pytest.raises(ValueError, match="holds a model of 8 layers .* but module has 9"):
        stage_split("runs/x", LAYOUT, num_layers=9, num_ranks=2)
