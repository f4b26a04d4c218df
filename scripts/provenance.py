"""Where and when a published number was measured: commit, torch, UTC time, machine and load.

Every script that writes a result JSON under docs/ puts :func:`provenance` in it, so that a
number on a page can be traced to the code and the conditions that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(load_before: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """The commit (and whether the tree had uncommitted changes), torch's version, the UTC
    time, the machine, and the load average (1, 5, 15 min) before the measurement and now."""
    return {
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__,
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "load_average_before": list(load_before) if load_before is not None else None,
        "load_average_after": list(os.getloadavg()),
    }
