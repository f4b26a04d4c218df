"""Rank 0's record of a run: ``log.jsonl`` (one line per step) and wandb.

A write that fails (a full disk) stops the run with one line naming the file, the free space,
the intact checkpoint and the ``--resume`` command (``apps.harness.writes.RunWriteError``), and
``log.jsonl`` is left ending with a whole record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import gpipe_core as gp
from apps.harness.writes import append_record, guarded_write


class RunLogger:
    """Rank 0's sinks: ``log.jsonl`` (one record per step), wandb, nothing on other ranks.

    ``config`` is the app's config dataclass; it needs ``wandb_mode`` ("offline", "online" or
    "disabled") and ``wandb_project``. Offline becomes online when ``WANDB_API_KEY`` is set.
    On resume, records after the resumed step (written by a run that crashed after its last
    checkpoint) are dropped so the log reads as one uninterrupted run.
    """

    def __init__(self, config: Any, out_dir: Path, *, resume_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.run: Any = None
        if not enabled:
            return
        self.out_dir, self.path = out_dir, out_dir / "log.jsonl"
        with guarded_write(out_dir, self.path):
            if resume_step and self.path.exists():
                gp.write_atomic(self.path, "".join(line + "\n" for line in
                                                   self._records_until(resume_step)))
            elif self.path.exists():
                self.path.unlink()
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        mode: Any = config.wandb_mode
        if mode == "offline" and os.environ.get("WANDB_API_KEY"):
            mode = "online"  # a key means the user wants the run online
        if mode != "disabled":
            with guarded_write(out_dir, out_dir / "wandb_id"):
                run_id = wandb_run_id(out_dir)
            try:
                import wandb

                self.run = wandb.init(
                    project=config.wandb_project,
                    config=dataclasses.asdict(config),
                    dir=str(out_dir),
                    mode=mode,
                    resume="allow",
                    id=run_id,
                )
            except Exception as error:  # noqa: BLE001 - logging must not stop training
                print(f"warning: wandb disabled ({type(error).__name__}: {error})", file=sys.stderr)
                self.run = None

    def _records_until(self, resume_step: int) -> list[str]:
        """The lines of log.jsonl up to ``resume_step``. A line that is not a JSON record (the
        last one cut off by a crash or a full disk) is dropped with a warning: the log must not
        stop a resume, and the steps it lacks are in the checkpoint's counters."""
        kept, torn = [], []
        text = self.path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                torn.append(number)
                continue
            if isinstance(record, dict) and record.get("step", 0) <= resume_step:
                kept.append(line)
        if torn:
            print(f"warning: dropped line(s) {', '.join(map(str, torn))} of {self.path}: not "
                  "JSON records (cut off by a crash or a full disk?)", file=sys.stderr, flush=True)
        return kept

    def step(self, record: dict[str, Any]) -> None:
        """Append one step's record to log.jsonl, whole or not at all (a full disk: the
        RunWriteError says so, and the log ends with the step before)."""
        if self.enabled:
            with guarded_write(self.out_dir, self.path):
                append_record(self.fd, (json.dumps(record) + "\n").encode(), self.path)

    def metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Send metrics to wandb (if on)."""
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.enabled:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            if self.run is not None:
                self.run.finish()


def wandb_run_id(out_dir: Path) -> str:
    """One wandb run id per out_dir, so a resumed run continues the same wandb run."""
    path = out_dir / "wandb_id"
    if not path.exists():
        gp.write_atomic(path, secrets.token_hex(4))
    return path.read_text().strip()
