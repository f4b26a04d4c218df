"""``apps.nmt.train`` under torchrun, recording at every evaluation how many parameters each
process holds (a helper of ``tests/apps/test_nmt_train.py``)::

    torchrun --nproc-per-node 2 -m tests.apps.nmt_census --out_dir=DIR [--key=value ...]

The training run is the real one; the only addition is a census taken each time the evaluation
has translated the dev sentences, while whatever model it translated with is still alive: the
elements of every ``nn.Parameter`` object in the process that has storage (not on ``meta``), from
the garbage collector's list of live objects. Each rank that evaluates appends one line to
``DIR/census-rankNNN.jsonl``. A rank holding only its stage counts exactly that stage's
parameters; one that also built the whole model counts more than the whole model's.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import apps.nmt.scoring as nmt_scoring
from apps.config import parse_overrides
from apps.nmt import train


def materialized_parameters() -> int:
    """Elements of all live ``nn.Parameter`` objects of this process that have storage."""
    gc.collect()
    # type(...) is, not isinstance: some live objects warn when asked isinstance
    return sum(obj.numel() for obj in gc.get_objects()
               if type(obj) is torch.nn.Parameter and not obj.is_meta)


def main() -> None:
    argv = sys.argv[1:]
    out_dir = Path(parse_overrides(argv)[1]["out_dir"])
    rank = int(os.environ["RANK"])
    translate = nmt_scoring.translate

    def translate_and_count(*args: Any, **kwargs: Any) -> list[str]:
        hypotheses = translate(*args, **kwargs)
        out_dir.mkdir(parents=True, exist_ok=True)
        with (out_dir / f"census-rank{rank:03d}.jsonl").open("a") as file:
            file.write(json.dumps({"parameters": materialized_parameters()}) + "\n")
        return hypotheses

    nmt_scoring.translate = translate_and_count  # scoring.evaluate() calls the module's translate
    train.main(argv)


if __name__ == "__main__":
    main()
