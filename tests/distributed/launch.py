"""The tests' launcher: ``gpipe_core.launch`` run from the repository, which is on the import path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpipe_core import launch
from gpipe_core.launch import spawn, torchrun_command

__all__ = ["REPO", "spawn", "torchrun", "torchrun_command"]

REPO = Path(__file__).resolve().parents[2]


def torchrun(module: str, args: Sequence[str], *, nproc: int = 2, timeout_s: float = 150.0) -> str:
    """``python -m torch.distributed.run -m module args`` on 127.0.0.1; returns its output.

    Raises quoting the end of the output on a non-zero exit status.
    """
    return launch.torchrun(module, args, nproc=nproc, timeout_s=timeout_s, cwd=REPO,
                           env={"PYTHONPATH": str(REPO)})
