"""Run ``apps.nmt.train`` as a real torchrun job and read what it wrote: the NMT experiments'
shared runner (``reproduce_stability.py``, ``reproduce_depth_width.py``).

A run is one ``python -m torch.distributed.run ... -m apps.nmt.train --key=value ...`` on
127.0.0.1 with its own ``out_dir``; its output goes to ``<out_dir>.out``. A run that fails (for
example a loss that became NaN, which the trainer stops on after logging it) is a result, not an
error: ``Run.returncode`` and the per-step ``log.jsonl`` say what happened.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """A finished training run: its settings, exit status, per-step records and summary."""

    name: str
    out_dir: Path
    settings: dict[str, Any]
    returncode: int
    wall_minutes: float
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    def series(self, key: str) -> list[float]:
        return [float(r.get(key, math.nan)) for r in self.records]


def train(
    name: str,
    out_dir: Path,
    settings: Mapping[str, Any],
    *,
    nproc: int = 2,
    timeout_s: float = 7200.0,
    fresh: bool = True,
) -> Run:
    """Train ``apps.nmt.train`` with ``--key=value`` for each of ``settings`` on ``nproc`` ranks.

    ``fresh`` deletes ``out_dir`` first (the trainer refuses to overwrite a run). Raises only if
    the job could not start or ran past ``timeout_s``.
    """
    out_dir = Path(out_dir)
    if fresh and out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    args = [f"--{key}={_format(value)}" for key, value in settings.items()]
    args.append(f"--out_dir={out_dir}")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:0", "-m", "apps.nmt.train", *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    log_path = out_dir.with_name(out_dir.name + ".out")
    print(f"[{name}] {' '.join(args)}", file=sys.stderr, flush=True)
    with log_path.open("w") as log:
        completed = subprocess.run(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    run = Run(name, out_dir, dict(settings), completed.returncode,
              (time.monotonic() - started) / 60)
    run.records = read_log(out_dir)
    summary_path = out_dir / "summary.json"
    if summary_path.exists():
        run.summary = json.loads(summary_path.read_text())
    status = "ok" if completed.returncode == 0 else f"exit {completed.returncode} (see {log_path})"
    print(f"[{name}] {status}, {len(run.records)} steps, {run.wall_minutes:.1f} min",
          file=sys.stderr, flush=True)
    return run


def _format(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def read_log(out_dir: Path) -> list[dict[str, Any]]:
    """The per-step records of ``out_dir/log.jsonl`` (NaN and Infinity parse as floats)."""
    path = Path(out_dir) / "log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# What a loss curve did


SPIKE_FACTOR = 1.5  # a spike: loss above 1.5x the median of the previous SPIKE_WINDOW steps
SPIKE_WINDOW = 50
SPIKE_MIN_HISTORY = 10  # steps of history before a spike can be called


def loss_spikes(losses: Sequence[float]) -> list[int]:
    """Steps (1-based) whose loss is above ``SPIKE_FACTOR`` times the running median of the
    previous ``SPIKE_WINDOW`` finite losses (once ``SPIKE_MIN_HISTORY`` exist); a non-finite
    loss is a spike too."""
    spikes = []
    for index, loss in enumerate(losses):
        history = [x for x in losses[max(0, index - SPIKE_WINDOW):index] if math.isfinite(x)]
        if not math.isfinite(loss):
            spikes.append(index + 1)
        elif len(history) >= SPIKE_MIN_HISTORY and loss > SPIKE_FACTOR * statistics.median(history):
            spikes.append(index + 1)
    return spikes


def divergence_step(losses: Sequence[float], *, after: int) -> int | None:
    """The first step (1-based) past step ``after`` (the warm-up) whose loss is NaN/inf or above
    the starting loss (the first step's), or None: the run diverged there."""
    if not losses:
        return None
    start = losses[0]
    for index, loss in enumerate(losses):
        if not math.isfinite(loss):
            return index + 1
        if index + 1 > after and loss > start:
            return index + 1
    return None
