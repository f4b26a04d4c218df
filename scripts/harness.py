"""What every benchmark and reproduction shares: how its processes run, how it measures a step,
how it records a result.

- **Processes.** :func:`setup_process` is ``gpipe_core.launch``'s ``setup`` for measured ranks:
  one core each (``gp.bind_cpus``) and freed memory kept mapped (``gp.hold_freed_memory``).
- **A step.** :func:`timed_step` (seconds on the slowest rank), :func:`step_memory_mb`
  (resident memory from /proc: peak, and what the step added; :func:`rss_mb`,
  :func:`reset_peak_rss`) and :class:`LiveTensorBytes` (the tensors alive at once, the CPU
  analogue of ``torch.cuda.max_memory_allocated``).
- **A result.** :func:`provenance` (commit, torch, UTC time, machine, load), so that a number
  on a page can be traced to the code and the conditions that produced it; :func:`write_json`;
  :func:`pyplot` and :func:`save_figure` for the pictures beside it.

Scripts run from the repository root as ``python scripts/NAME.py`` or ``python -m
scripts.NAME``: both import ``scripts`` as the package the project's (editable) install
provides, so no script touches ``sys.path``.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import subprocess
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gpipe_core as gp
from gpipe_core.microbatch import flatten

ROOT = Path(__file__).resolve().parents[1]

# --- processes ------------------------------------------------------------------------------


def setup_process(rank: int, world_size: int, *, pin: bool = True, hold_memory: bool = True
                  ) -> None:
    """Before the process group (gpipe_core.launch's ``setup``): cores and allocator."""
    if pin:
        gp.bind_cpus(rank, world_size)  # one core per rank; torch threads = 1
    else:
        torch.set_num_threads(1)
    if hold_memory:
        gp.hold_freed_memory()  # for every measured configuration alike


# --- measuring a step -----------------------------------------------------------------------


def timed_step(fn: Callable[[], Any]) -> float:
    """Seconds of one step of ``fn`` on every rank: a step lasts as long as its slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def rss_mb(field: str) -> float | None:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in MB, from /proc (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Give cached free memory back to the system and restart the high-water mark ``VmHWM``."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def step_memory_mb(fn: Callable[[], Any]) -> tuple[float | None, float | None]:
    """Peak resident memory during one step, and how much of it the step itself added.

    Memory the allocator cached from earlier steps is first returned to the system
    (``malloc_trim``) and the high-water mark restarted (/proc/self/clear_refs), so the peak
    is this step's, and the part above the resident size before it counts what the step
    touches: activations kept for backward, gradients, messages.
    """
    try:
        reset_peak_rss()
    except OSError:
        return None, None
    before = rss_mb("VmRSS")
    timed_step(fn)
    peak = rss_mb("VmHWM")
    return peak, None if before is None or peak is None else peak - before


class LiveTensorBytes(TorchDispatchMode):
    """The CPU analogue of ``torch.cuda.max_memory_allocated``: bytes of tensor storage alive.

    Inside the context every storage an operator creates is counted until it is freed; the
    peak is the most that was alive at once. Storages that existed before (``existing``:
    parameters, buffers, the batch) are never counted, so the peak is what the step itself
    adds: activations kept for backward, gradients, temporaries and message buffers. Memory
    allocated outside torch's dispatcher (gloo's own buffers, the Python heap) is not seen, and
    nor is the allocator's slack, which resident-memory measurements include.
    """

    def __init__(self, existing: Any = ()) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        leaves = [t for t in flatten(existing)[0] if isinstance(t, Tensor)]
        self._ignored = {t.untyped_storage().data_ptr() for t in leaves}

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._live or key in self._ignored:
                continue
            self._live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


# --- recording a result ---------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# The CPU features that decide what a measurement on this host means: the vector width, and
# whether bf16 matrix products run in hardware (AVX512-BF16, AMX) or are emulated.
CPU_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                         "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


def cpu_identity(cpuinfo: str | None = None) -> dict[str, Any]:
    """``cpu_model`` (the kernel's "model name"), the flags of ``CPU_FLAGS_OF_INTEREST`` this
    CPU has, and the cores this process may use: what tells two machines apart in a result.
    Two results whose ``cpu_model`` or ``cpu_flags`` differ were measured on different
    machines and must not be compared unseen (see :func:`same_machine`)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = flags = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = value
    present = set(flags.split())
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpu_flags": [f for f in CPU_FLAGS_OF_INTEREST if f in present],
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
    }


def same_machine(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two provenance records (or results holding one under ``"provenance"``) name
    the same CPU model, flags and core count. A record without ``cpu_model`` counts as a
    different machine: it cannot show that it is the same one."""
    a, b = first.get("provenance", first), second.get("provenance", second)
    keys = ("cpu_model", "cpu_flags", "cpu_cores")
    return all(k in a and k in b for k in keys) and all(a[k] == b[k] for k in keys)


def cpu_times(stat: str | None = None) -> dict[str, int] | None:
    """The kernel's cumulative CPU time counters (``/proc/stat``'s "cpu" line, in clock
    ticks, all CPUs): None where there is no such file (not Linux)."""
    if stat is None:
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:
            return None
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
            return dict(zip(names, map(int, fields[1:9]), strict=False))
    return None


# The counters when the script imported this module: a result's provenance reports the CPU
# time of the host between then and its writing, so that a run slowed by its neighbours shows
CPU_TIMES_AT_START = cpu_times()


def host_cpu_shares(before: dict[str, int] | None,
                    after: dict[str, int] | None) -> dict[str, float] | None:
    """Shares of the host's CPU time between two :func:`cpu_times` readings: ``busy`` (user,
    nice, system, irq, softirq), ``idle`` (idle, iowait) and ``steal``, the time the
    hypervisor gave this virtual machine's CPUs to others while they had work. A steal share
    of several percent means the run was slowed by other tenants: timings from it and from a
    run without steal are not comparable even on the same CPU model."""
    if before is None or after is None:
        return None
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    total = sum(delta.values())
    if total <= 0:
        return None
    busy = sum(delta.get(k, 0) for k in ("user", "nice", "system", "irq", "softirq"))
    idle = delta.get("idle", 0) + delta.get("iowait", 0)
    return {"busy": busy / total, "idle": idle / total, "steal": delta.get("steal", 0) / total}


def provenance(load_before: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """The commit (and whether the tree had uncommitted changes), torch's version, the UTC
    time, the machine (:func:`cpu_identity`: CPU model, flags, cores), the load average
    (1, 5, 15 min) before the measurement and now, and the host's CPU time since the script
    started (:func:`host_cpu_shares`: the steal share tells a run slowed by other tenants)."""
    return {
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(uncommitted_files()),
        "torch": torch.__version__,
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **cpu_identity(),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "load_average_before": list(load_before) if load_before is not None else None,
        "load_average_after": list(os.getloadavg()),
        # the host's CPU time since this script started (busy, idle, stolen by other tenants)
        "host_cpu_since_start": host_cpu_shares(CPU_TIMES_AT_START, cpu_times()),
    }


# Published results live here; a result written here from a tree with uncommitted changes
# cannot be traced to the code that produced it (issue 40), so it is refused unless it is
# marked a draft: ``--draft`` on the scripts (:func:`add_draft_argument`) or GPIPE_DRAFT=1.
PUBLISHED = ROOT / "docs" / "reproduction"
DRAFT_ENV = "GPIPE_DRAFT"


class DirtyTreeError(RuntimeError):
    """A published result would be written from a tree with uncommitted changes."""


def uncommitted_files() -> list[str]:
    """Tracked files with uncommitted changes (``git status --porcelain``, untracked files
    not counted, as in :func:`provenance`), but for results (:func:`changed_code`)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return changed_code(out)


def changed_code(porcelain: str) -> list[str]:
    """The paths of ``git status --porcelain`` output but those under docs/reproduction/:
    a result just written there (a make target's first step, read by its next) does not make
    the code that measures the next one uncommitted."""
    published = PUBLISHED.relative_to(ROOT).as_posix() + "/"
    paths = [line[3:] for line in porcelain.splitlines() if line.strip()]
    return [p for p in paths if not p.strip('"').startswith(published)]


def is_draft(draft: bool | None = None) -> bool:
    """``draft`` if given, else whether GPIPE_DRAFT is set to something other than 0/empty."""
    if draft is not None:
        return draft
    return os.environ.get(DRAFT_ENV, "") not in ("", "0", "false", "no")


def refuse_dirty_tree(path: str | Path, *, draft: bool | None = None) -> None:
    """Raise :class:`DirtyTreeError` if ``path`` is a published result (under
    docs/reproduction/), the tree has uncommitted changes, and the result is not a draft.
    Scripts call it before measuring too, so that a long run is refused at its start."""
    path = Path(path).resolve()
    if PUBLISHED not in (path, *path.parents) or is_draft(draft):
        return
    changed = uncommitted_files()
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5
                                           else "")
        raise DirtyTreeError(
            f"refusing to write {path}: the tree has uncommitted changes "
            f"({shown}); commit them (or run from a clean worktree: git worktree add), or mark "
            f"the result a draft with --draft or {DRAFT_ENV}=1")


def add_draft_argument(parser: Any) -> None:
    """``--draft``: allow writing published results from a dirty tree (the result records
    ``"draft": true``)."""
    parser.add_argument("--draft", action="store_true",
                        help="write results even with uncommitted changes, marked as a draft "
                             f"(same as {DRAFT_ENV}=1)")


def set_draft(draft: bool) -> None:
    """After parsing ``--draft``: every write path of this process (and its children) sees it."""
    if draft:
        os.environ[DRAFT_ENV] = "1"


def write_json(path: str | Path, result: Any, *, draft: bool | None = None, **dumps: Any) -> Path:
    """Write ``result`` as indented JSON at ``path`` (its folder made as needed). A published
    result (under docs/reproduction/) from a tree with uncommitted changes is refused
    (:func:`refuse_dirty_tree`) unless it is a draft; a draft result records ``"draft": true``."""
    path = Path(path)
    refuse_dirty_tree(path, draft=draft)
    if is_draft(draft) and isinstance(result, dict):
        result = {**result, "draft": True}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, **dumps) + "\n")
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), imported on demand."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> None:
    """Lay out, write and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
