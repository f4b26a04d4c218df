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

from apps.harness.checkpoints import holds_run
from gpipe_core.launch import torchrun_command

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
    resumed: bool = False  # continued from a checkpoint: wall_minutes is this part's only

    def series(self, key: str) -> list[float]:
        return [float(r.get(key, math.nan)) for r in self.records]

    @property
    def seconds_per_step(self) -> float | None:
        """Training seconds per step: the trainer's own clock (``summary.json``'s
        ``train_minutes``, carried across resumes, without start-up and evaluation) where it
        wrote one; else this part's wall time over the steps logged, which understates a
        resumed run (its earlier part is not in ``wall_minutes``)."""
        if self.summary and self.summary.get("train_minutes") and self.summary.get("steps"):
            return 60 * self.summary["train_minutes"] / self.summary["steps"]
        return 60 * self.wall_minutes / len(self.records) if self.records else None


def train(
    name: str,
    out_dir: Path,
    settings: Mapping[str, Any],
    *,
    nproc: int = 2,
    timeout_s: float = 7200.0,
    fresh: bool = True,
    resume: bool = False,
) -> Run:
    """Train ``apps.nmt.train`` with ``--key=value`` for each of ``settings`` on ``nproc`` ranks.

    ``fresh`` deletes ``out_dir`` first (the trainer refuses to overwrite a run). ``resume``
    instead continues a run that was stopped (a sweep killed mid-run) from its newest
    checkpoint, if ``out_dir`` holds one (``--resume``: the same batches, the log cut back to
    the checkpoint's step); without a checkpoint the run starts fresh. Raises only if the job
    could not start or ran past ``timeout_s``.
    """
    out_dir = Path(out_dir)
    resuming = resume and holds_run(out_dir)
    if (fresh or resume) and not resuming and out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    args = [f"--{key}={_format(value)}" for key, value in settings.items()]
    args.append(f"--out_dir={out_dir}")
    command = torchrun_command("apps.nmt.train", args + ["--resume"] * resuming, nproc=nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    log_path = out_dir.with_name(out_dir.name + ".out")
    print(f"[{name}] {' '.join(args)}{' --resume' if resuming else ''}", file=sys.stderr,
          flush=True)
    with log_path.open("a" if resuming else "w") as log:
        completed = subprocess.run(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    run = Run(name, out_dir, dict(settings), completed.returncode,
              (time.monotonic() - started) / 60, resumed=resuming)
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


# ---------------------------------------------------------------------------------------------
# Statistics over seeds, and which runs may be compared at all (issue 39)

# Two-sided 95% quantiles of Student's t, t_{0.975, df}, for df = 1..30 (the standard table;
# scipy is not a dependency). Beyond 30 the Cornish-Fisher expansion below is used.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z_975 = 1.959964


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the table for df <= 30, else the Cornish-Fisher expansion of the normal
    quantile (error below 1e-3 there)."""
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least two values")
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2))


def t_interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean and 95% t interval of ``values`` (seeds, or per-seed paired differences):
    mean +- t_{0.975, n-1} * sd / sqrt(n). With 3 seeds the bootstrap percentile interval
    cannot reach beyond the observed values; the t interval does, as the sampling of 3 values
    demands (t_{0.975, 2} = 4.303). One value has no interval (``ci95`` None)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "ci95": None, "method": "t"}
    mean = sum(values) / n
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "ci95": None, "method": "t",
                "note": "one value: no interval"}
    sd = statistics.stdev(values)
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half],
            "t_975": t_quantile_975(n - 1), "method": "t"}


MACHINES_JSON = REPO / "docs" / "reproduction" / "machines.json"
MACHINE_KEYS = ("cpu_model", "cpu_flags", "cpu_cores")


def machine_records(path: Path = MACHINES_JSON) -> dict[str, Any]:
    """``machines.json``: for result files written before provenance recorded the CPU, the
    machine each ran on as far as the evidence (commit messages) shows, keyed
    ``<folder>/<name>``."""
    path = Path(path)
    return json.loads(path.read_text())["runs"] if path.exists() else {}


def machine_of(result: Mapping[str, Any], key: str | None = None,
               records: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The machine of a result: its own ``cpu_model``/``cpu_flags``/``cpu_cores`` where it
    recorded them (in itself or under ``"provenance"``), else ``records[key]`` (the machine
    ``machines.json`` assigns to an older result), else an empty record, which
    ``scripts.harness.same_machine`` pairs with nothing."""
    own = result.get("provenance", result)
    if all(k in own for k in MACHINE_KEYS):
        return {k: own[k] for k in MACHINE_KEYS}
    entry = (records or {}).get(key or "") if key else None
    if entry:
        return {k: entry[k] for k in MACHINE_KEYS}
    return {}


def comparable(first: Mapping[str, Any], second: Mapping[str, Any], *,
               keys: tuple[str | None, str | None] = (None, None),
               records: Mapping[str, Any] | None = None) -> bool:
    """Whether two results may be compared: they ran on the same machine by
    ``scripts.harness.same_machine`` (runs with identical settings drift apart across a
    machine change, so a difference across machines is not the setting's)."""
    from scripts.harness import same_machine

    return same_machine(machine_of(first, keys[0], records), machine_of(second, keys[1], records))


# ---------------------------------------------------------------------------------------------
# One result JSON per run, so that a sweep resumes where it stopped (issue 21)


def provenance(seed: int) -> dict[str, Any]:
    """What every result JSON records (``scripts.harness.provenance`` in the sweeps' own
    format): commit (``+dirty`` with uncommitted changes), torch version, UTC time, the
    machine's 1/5/15-minute load averages and core count, the CPU model and flags, and the
    seed."""
    import datetime

    from scripts.harness import provenance as recorded

    record = recorded()
    utc = datetime.datetime.fromisoformat(record["utc"])
    return {
        "commit": record["commit"] + ("+dirty" if record["uncommitted_changes"] else ""),
        "torch": record["torch"],
        "utc": utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "loadavg": [round(x, 2) for x in record["load_average_after"]],
        "cpu_count": record["machine"]["cpus"],
        "cpu_model": record["cpu_model"],
        "cpu_flags": record["cpu_flags"],
        "cpu_cores": record["cpu_cores"],
        "seed": seed,
    }


def to_json(value: Any, indent: int = 0) -> str:
    """JSON with one key per line, but a list that holds no mapping on one line (a run's
    per-sentence statistics and trajectories are long lists of numbers: one line each, not
    one line per number)."""
    if isinstance(value, Mapping) and value:
        pad = " " * (indent + 1)
        items = (f"{pad}{json.dumps(str(k), ensure_ascii=False)}: {to_json(v, indent + 1)}"
                 for k, v in value.items())
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
        pad = " " * (indent + 1)
        items = (pad + to_json(v, indent + 1) for v in value)
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=True)


def write_result(path: Path, result: Mapping[str, Any]) -> None:
    """Write a run's result JSON (:func:`to_json`) atomically (a sweep killed mid-write leaves
    no half file, so the resumed sweep reruns that run rather than skipping it). Published
    results from a dirty tree are refused unless a draft (``scripts.harness.refuse_dirty_tree``)."""
    from scripts.harness import is_draft, refuse_dirty_tree

    refuse_dirty_tree(path)
    if is_draft() and isinstance(result, Mapping):
        result = {**result, "draft": True}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(to_json(result) + "\n")
    partial.replace(path)


def read_results(folder: Path) -> list[dict[str, Any]]:
    """Every result JSON in ``folder`` (not the summary files, which start with ``_``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))
            if not p.name.startswith("_")]


def run_pending(names: Sequence[str], folder: Path, work: Any, *, jobs: int) -> list[str]:
    """Call ``work(name)`` for each name without ``folder/<name>.json``, ``jobs`` at a time
    (threads, each waiting on its own training process); the names it ran, in order."""
    from concurrent.futures import ThreadPoolExecutor

    pending = [n for n in names if not (Path(folder) / f"{n}.json").exists()]
    skipped = len(names) - len(pending)
    if skipped:
        print(f"{skipped} of {len(names)} runs already have results in {folder}: skipped",
              file=sys.stderr, flush=True)
    if jobs <= 1:
        for name in pending:
            work(name)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(work, pending))
    return pending


def stopped_as_diverged(run: Run) -> bool:
    """Whether the trainer stopped the run on its divergence rule (apps.harness.guards.check_loss)."""
    log_path = run.out_dir.with_name(run.out_dir.name + ".out")
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return run.returncode != 0 and ("DivergenceError" in text or "the run diverged" in text
                                    or "loss is nan" in text or "loss is inf" in text)


def drop_checkpoints(out_dir: Path) -> None:
    """Delete a finished run's checkpoints (its log.jsonl, summary and config stay)."""
    for step_dir in Path(out_dir).glob("step-*"):
        shutil.rmtree(step_dir, ignore_errors=True)


def train_in_process(name: str, out_dir: Path, settings: Mapping[str, Any]) -> Run:
    """One single-process run of ``apps.nmt.train`` inside this interpreter: the same training
    code as ``train(..., nproc=1)`` without starting torchrun and a worker (each imports torch:
    seconds per run, tens of seconds on a loaded machine). For the scripts' ``--quick``
    settings; a sweep runs its jobs as processes (two at a time, and a crash stays contained).
    Its output goes to ``<out_dir>.out``; an error is a result (``returncode`` 1), as there."""
    import contextlib
    import signal
    import socket

    import torch.distributed as dist

    from apps.nmt import train as nmt_train

    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    args = [f"--{key}={_format(value)}" for key, value in settings.items()]
    args.append(f"--out_dir={out_dir}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved_env = {key: os.environ.get(key) for key in env}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    log_path = out_dir.with_name(out_dir.name + ".out")
    print(f"[{name}] (in process) {' '.join(args)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    returncode = 0
    os.environ.update(env)
    try:
        with log_path.open("w") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            try:
                nmt_train.main(args)
            except (Exception, SystemExit) as error:  # noqa: BLE001 - a failed run is a result
                print(f"{type(error).__name__}: {error}", file=log, flush=True)
                returncode = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    run = Run(name, out_dir, dict(settings), returncode, (time.monotonic() - started) / 60)
    run.records = read_log(out_dir)
    summary_path = out_dir / "summary.json"
    if summary_path.exists():
        run.summary = json.loads(summary_path.read_text())
    print(f"[{name}] {'ok' if returncode == 0 else f'failed (see {log_path})'}, "
          f"{len(run.records)} steps, {run.wall_minutes:.2f} min", file=sys.stderr, flush=True)
    return run


def parse_settings(pairs: Sequence[str]) -> dict[str, str]:
    """``--set key=value ...`` of the experiment scripts as a dict."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"error: --set {pair!r}: expected key=value (e.g. --set max_tokens=512)")
        settings[key.strip().lstrip("-")] = value
    return settings
