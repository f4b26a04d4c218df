"""Pieces both apps' train scripts share: run setup, resume checks, logging, checkpoint folders.

``setup_run`` starts a run under torchrun (process groups, this rank's place, its device, the
CPU knobs) and returns a ``Run``; ``check_pipeline_options`` asks gpipe_core whether a schedule
name and re-materialization mode are valid, so the apps accept exactly what the library runs;
``check_resumable`` is the one rule for which config keys a ``--resume`` may change.

A run's ``out_dir`` holds ``step-NNNNNNN/`` checkpoint folders, a ``latest`` file naming the
newest complete one (written only after every rank's files are on disk), ``log.jsonl`` (one line
per training step) and ``wandb_id`` (so a resumed run continues the same wandb run).

Every checkpoint file is written atomically and fsynced, and the folder's ``index.json`` records
each file's size and SHA-256 (``gpipe_core.storage``). Evaluation refuses a damaged checkpoint,
naming the file; ``--resume`` falls back to the newest intact checkpoint and says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import gpipe_core as gp
from apps.config import ConfigError, config_yaml
from gpipe_core.microbatch import map_tensors
from gpipe_core.remat import check_pipeline_args
from gpipe_core.storage import torch_load

KEEP_CHECKPOINTS = 2  # step folders kept in out_dir (the newest ones)
LATEST = "latest"


# ---------------------------------------------------------------------------------------------
# Run setup: this rank's place in the world, its device, the CPU knobs


def check_pipeline_options(*, schedule: str, checkpoint: str, num_stages: int,
                           chunks: int) -> None:
    """ConfigError, with gpipe_core's own message, unless the library runs ``schedule``
    (``gpipe``, ``1f1b``, ``1f1b_slackN``, ...) with ``num_stages`` x ``chunks`` and knows the
    re-materialization mode ``checkpoint``. The apps keep no list of their own."""
    try:
        gp.get_schedule(schedule, num_stages, chunks)
    except ValueError as error:
        raise ConfigError(f"schedule={schedule!r}: {error}") from None
    try:
        check_pipeline_args(chunks=chunks, checkpoint=checkpoint)
    except ValueError as error:
        raise ConfigError(str(error)) from None


@dataclass
class Run:
    """Where this process sits in a run under torchrun, and on which device it computes.

    The world is ``num_stages`` pipeline ranks times R data-parallel replicas, pipeline-major
    (as ``gp.init_process_groups`` lays it out): ranks ``r*K ... r*K+K-1`` are replica r.
    """

    pipeline_group: Any
    data_group: Any
    rank: int  # global rank
    world_size: int
    num_stages: int
    device: torch.device  # collectives need device tensors under NCCL

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.num_stages

    @property
    def replica(self) -> int:
        return self.rank // self.num_stages

    @property
    def first_rank(self) -> int:
        """Global rank of this replica's first stage."""
        return self.replica * self.num_stages

    @property
    def master(self) -> bool:
        """Global rank 0: the one that prints, logs, evaluates and writes shared files."""
        return self.rank == 0

    def say(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0; nothing elsewhere."""
        if self.master:
            print(*args, **kwargs)

    def broadcast_from_first_stage(self, tensor: Tensor | None, like: Tensor) -> Tensor:
        """The replica's first stage's ``tensor``, on every rank of its pipeline (the others
        pass None; ``like`` gives them shape and dtype)."""
        buffer = (tensor if tensor is not None else like).to(self.device)
        if self.num_stages > 1:
            dist.broadcast(buffer, src=self.first_rank, group=self.pipeline_group)
        return buffer


def setup_run(*, num_stages: int, device: str = "auto", num_threads: int = 1,
              timeout_s: float, pin_cpus: bool = False, hold_memory: bool = False) -> Run:
    """Start a run under torchrun: torch threads, process groups (gloo on CPU, NCCL with
    CUDA), this rank's ``Run``.

    ``device``: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available). ``num_threads``: torch
    intra-op threads per rank (on CPU the stages are the parallelism). Every collective fails
    within ``timeout_s``, naming the rank that hangs. The CPU knobs (``gpipe_core.cpu``):
    ``pin_cpus`` gives each local rank its own share of the cores (``gp.bind_cpus``, gloo's
    threads included; ``num_threads`` still sets the thread count) and ``hold_memory`` keeps
    freed blocks mapped (``gp.hold_freed_memory``).
    """
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    pipeline_group, data_group = gp.init_process_groups(
        num_stages, backend="nccl" if use_cuda else "gloo", timeout_s=timeout_s,
        pin_cpus=pin_cpus, hold_memory=hold_memory,
    )
    torch.set_num_threads(num_threads)  # after pinning, which sets it to the share's size
    return Run(
        pipeline_group=pipeline_group,
        data_group=data_group,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        num_stages=num_stages,
        device=torch.device("cuda", torch.cuda.current_device()) if use_cuda
        else torch.device("cpu"),
    )


def end_run() -> None:
    """Every rank waits for the others, then leaves the process groups: a rank that exits while
    gloo's threads still serve a neighbour can abort ("terminate called without an active
    exception"), so one-shot commands under torchrun end with this."""
    if dist.is_initialized():
        with gp.collectives("the end of the command"):
            dist.barrier()
        dist.destroy_process_group()


def choose_balance(build_meta: Callable[[], torch.nn.Sequential], sample: Any, num_stages: int,
                   *, seed: int, device: torch.device, max_parameters: int) -> list[int]:
    """Layers per stage by the measured forward+backward time of each layer on ``sample`` (one
    micro-batch); by parameters for models over ``max_parameters``, too large to time whole.

    Parameter counts mislead both apps: AmoebaNet's early cells work on large maps with few
    parameters, and the Transformer's embedding holds many parameters for little compute while
    its output projection does much (a 4k x d vocabulary matmul per token). Timing differs
    between processes, so global rank 0 times a plain copy (then drops it) and every rank gets
    its result.
    """
    model = build_meta()
    if sum(p.numel() for p in model.parameters()) > max_parameters:
        return list(gp.balance_by_params(model, num_stages))
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        plain = gp.materialize(build_meta(), seed=seed, device=device)
        sample = map_tensors(sample, lambda t: t.to(device))
        result[0] = list(gp.balance_by_time(plain, sample, num_stages))
        del plain
    with gp.collectives("choosing the balance"):
        dist.broadcast_object_list(result, src=0)
    return list(result[0])


def check_resumable(saved: Any, config: Any, *, may_change: Collection[str],
                    checkpoint: Path) -> None:
    """ConfigError unless ``config`` equals ``saved`` (the config stored in ``checkpoint``) in
    every key but those in ``may_change``: keys that touch neither the model, its partitioning
    nor the training stream. An allow-list, so a key added to a config must match on resume
    until someone decides that changing it is safe.
    """
    old, new = dataclasses.asdict(saved), dataclasses.asdict(config)
    unknown = set(may_change) - set(old)
    assert not unknown, f"may_change names keys the config lacks: {sorted(unknown)}"
    differ = {k: (old[k], new[k]) for k in old if k not in may_change and old[k] != new[k]}
    if differ:
        raise ConfigError(
            f"--resume from {checkpoint}: the config differs in {differ} (saved, given); "
            "resume with the saved settings or start a new out_dir"
        )


# ---------------------------------------------------------------------------------------------
# Checkpoint folders


class CheckpointError(FileNotFoundError):
    """No checkpoint where one was expected; the message says which command writes one."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, quota, ...); the message says which one,
    which earlier checkpoint is intact, and how to continue."""


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` optimizer steps."""
    return out_dir / f"step-{step:07d}"


def publish_checkpoint(out_dir: Path, path: Path, *, keep: int = KEEP_CHECKPOINTS) -> None:
    """Point ``latest`` at ``path`` (atomically) and delete all but the ``keep`` newest steps.

    Call on one rank, after a barrier that follows every rank's writes.
    """
    gp.write_atomic(out_dir / LATEST, path.name + "\n")
    steps = [p for p in out_dir.glob("step-*") if p.is_dir() and p != path]
    # folders past ``path`` are left from a timeline this run abandoned (a crash mid-checkpoint,
    # or a damaged checkpoint it resumed before): never the fallback of a later resume
    newer = [p for p in steps if p.name > path.name]
    older = sorted(p for p in steps if p.name < path.name)
    for old in newer + older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def refuse_existing_run(out_dir: Path) -> None:
    """A fresh run must not overwrite another's checkpoints: ask for --resume or a new out_dir.

    A run is there when ``latest`` is valid or a step folder holds a checkpoint; a damaged
    ``latest`` alone (nothing to resume) does not stop a new run, which replaces it.
    """
    name, _ = read_latest(out_dir)
    if name is not None or any((p / "index.json").is_file() for p in out_dir.glob("step-*")):
        raise ConfigError(
            f"out_dir={out_dir} already holds a run (see {out_dir / LATEST}); pass --resume to "
            "continue it, or another --out_dir"
        )


def check_out_dir(out_dir: Path) -> None:
    """ConfigError unless ``out_dir`` is a folder this process can write (created if missing).

    Every rank calls it before the process groups exist, so a file in the way or a folder
    without write permission is one line from every rank at once, not a traceback on rank 0
    that the others report as a hang. A real write is tried (``os.access`` says yes to root on
    a read-only filesystem)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"out_dir={out_dir} is a file, not a folder; pass another --out_dir "
                          "(or move the file away)")
    probe = out_dir / f".write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        where = f" at {error.filename}" if error.filename else ""
        raise ConfigError(
            f"out_dir={out_dir} cannot be written ({error.strerror or error}{where}); pass "
            "another --out_dir, or make it writable for this user"
        ) from None


_HELD_LOCKS: dict[Path, Any] = {}  # out_dir -> its open lock file, released at exit


def lock_out_dir(out_dir: Path) -> None:
    """Hold ``out_dir/.lock`` (``flock``) until this process exits, so two runs never write one
    out_dir at once: the second gets a ConfigError naming the pid and host of the first.

    Call on global rank 0 only (``on_rank0``). The lock dies with its process (a crash or a
    SIGKILL leaves no stale lock); the file stays, holding the last holder's pid and host.
    ``flock`` holds across nodes on a shared filesystem that supports it (NFSv4 does, through
    byte-range locks); a filesystem without locks fails here with its error.
    """
    import fcntl

    path = (out_dir / ".lock").resolve()
    if path in _HELD_LOCKS:  # this process again (a resume in the same test process)
        return
    file = open(path, "a+")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "a process that has not written its pid yet"
        file.close()
        raise ConfigError(
            f"out_dir={out_dir} is in use by another run ({holder}; see {path}); wait for it "
            "to end or stop it, or pass another --out_dir"
        ) from None
    file.seek(0)
    file.truncate()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    file.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {started}\n")
    file.flush()
    _HELD_LOCKS[path] = file


def train_state_path(checkpoint: Path, rank: int) -> Path:
    """Where ``rank`` keeps its optimizer, counters and data position in a checkpoint."""
    return checkpoint / f"train-state-rank{rank:03d}.pt"


def load_train_state(checkpoint: Path, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's train state from ``checkpoint``; a clear error if the world size changed."""
    path = train_state_path(checkpoint, rank)
    if not path.is_file():
        raise ConfigError(
            f"--resume: {path} is missing; resume with the world size the checkpoint was "
            f"written with (this run has {world_size} ranks)"
        )
    gp.verify_checkpoint(checkpoint, [path.name])
    state: dict[str, Any] = torch_load(path, weights_only=False)
    return state


def write_checkpoint(
    out_dir: Path,
    step: int,
    pipe: Any,
    state: dict[str, Any],
    config: Any,
    *,
    rank: int,
    files: dict[str, str],
) -> Path:
    """Checkpoint after ``step``: the pipeline's shards and every rank's ``state`` (collective),
    then on rank 0 the config and ``files`` (name -> text); ``latest`` moves once all are on disk.
    """
    path = checkpoint_dir(out_dir, step)
    own: dict[str, Any] = {train_state_path(path, rank).name: state}
    if rank == 0:
        own["config.yaml"] = config_yaml(config)
        own.update(files)
    previous, _ = read_latest(out_dir)
    try:
        pipe.save_checkpoint(path, files=own)  # atomic files, then index.json; all ranks wait
        if rank == 0:
            publish_checkpoint(out_dir, path)
    except OSError as error:  # a full disk, a quota, a lost mount: say what is still there
        kept = (f"the previous checkpoint {out_dir / previous} is intact and {LATEST} still "
                "names it" if previous else "there is no earlier checkpoint")
        raise CheckpointWriteError(
            f"could not write checkpoint {path}: {error}; {kept}; free space (or fix out_dir) "
            "and continue with --resume"
        ) from error
    return path


def resolve_checkpoint(path: str | Path, *, train_command: str, verify: bool = True) -> Path:
    """The checkpoint folder behind ``path``: a step folder, or a run's out_dir (its newest
    checkpoint, as ``run_checkpoint`` finds it: ``latest`` if it is valid, else the newest intact
    step folder, with a warning).

    ``train_command`` is quoted in the error when there is none (how to write one). With
    ``verify`` every file is checked against ``index.json`` (gp.CheckpointCorruptError names a
    damaged one).
    """
    path = Path(path)
    if not (path / "index.json").is_file() and (
        (path / LATEST).exists() or any(path.glob("step-*"))
    ):
        return run_checkpoint(path, train_command=train_command, skip_damaged=False,
                              verbose=int(os.environ.get("RANK", "0")) == 0)
    if not (path / "index.json").is_file():
        raise CheckpointError(
            f"no checkpoint at {path} (neither {path / LATEST} nor {path / 'index.json'} "
            f"exists); train one with `{train_command}`"
        )
    if verify:
        gp.verify_checkpoint(path)
    return path


_STEP_NAME = re.compile(r"step-\d{7}")


def read_latest(out_dir: Path) -> tuple[str | None, str | None]:
    """What ``out_dir/latest`` says, as a hint: ``(name, None)`` when it names a step folder of
    this run that holds an ``index.json``; ``(None, why)`` when it exists but cannot be used
    (not text, empty, not a step folder name -- a path to another run is refused too -- or a
    folder that holds no checkpoint); ``(None, None)`` when there is no ``latest``.

    A torn or hand-edited ``latest`` must not lose a run whose step folders are intact, nor
    send an evaluation to another run's checkpoint.
    """
    path = out_dir / LATEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as error:
        return None, f"{path} is unreadable ({error.strerror or error})"
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return None, f"{path} holds {len(data)} bytes that are not a step folder name (not text)"
    if not text:
        return None, f"{path} is empty"
    if not _STEP_NAME.fullmatch(text):
        shown = text if len(text) <= 200 else text[:197] + "..."
        return None, (f"{path} holds {shown!r}, not the name of one of this run's step-NNNNNNN "
                      "folders")
    if not (out_dir / text / "index.json").is_file():
        return None, f"{path} names {text}, which holds no complete checkpoint"
    return text, None


def run_checkpoint(out_dir: Path, *, train_command: str, skip_damaged: bool,
                   verbose: bool) -> Path:
    """The checkpoint of a run's ``out_dir`` that ``--resume``, the eval scripts, translate and
    classify use (the one place that reads ``latest``).

    ``latest`` is a hint (``read_latest``): when it is valid, the step folders after it are
    ignored (left by a crash mid-checkpoint, or by a timeline a resume abandoned). When it is
    not, every step folder is a candidate, and the newest one whose files verify is taken with
    a warning (on stderr when ``verbose``) saying what was wrong. ``skip_damaged``: a damaged
    checkpoint named by a valid ``latest`` is skipped for an older intact one (``--resume``)
    rather than refused (evaluation, which must score the checkpoint it was asked for).
    Every rank reaches the same answer from the same files.
    """
    name, problem = read_latest(out_dir)
    candidates = sorted(
        (p for p in out_dir.glob("step-*")
         if p.is_dir() and _STEP_NAME.fullmatch(p.name) and (name is None or p.name <= name)),
        reverse=True,
    )
    problems = [problem] if problem else []
    damaged = False
    for candidate in candidates:
        try:
            gp.verify_checkpoint(candidate)
        except (gp.CheckpointCorruptError, FileNotFoundError) as error:
            if candidate.name == name and not skip_damaged:
                raise
            problems.append(str(error))
            damaged = True
            continue
        if problems and verbose:
            verb = "resuming from" if skip_damaged else "using"
            print(f"warning: {'; '.join(problems)}; {verb} the newest intact checkpoint "
                  f"{candidate} instead", file=sys.stderr, flush=True)
        return candidate
    if damaged:
        raise gp.CheckpointCorruptError(
            f"no intact checkpoint in {out_dir}: {'; '.join(problems)}"
        )
    why = f" ({'; '.join(problems)})" if problems else ""
    raise CheckpointError(
        f"no checkpoint in {out_dir}{why}; train one with `{train_command}`"
    )


# config keys only one app has, and the script that evaluates that app's checkpoints
_APP_KEYS = {"genotype": "amoebanet", "num_heads": "nmt"}
_APPS = {"nmt": ("an NMT", "scripts/eval_bleu.py"),
         "amoebanet": ("an AmoebaNet", "scripts/eval_top1.py")}


def require_app(checkpoint: Path, app: str) -> None:
    """CheckpointError if the config saved in ``checkpoint`` is another app's ("this is an NMT
    checkpoint: use scripts/eval_bleu.py") instead of a page of unknown-key errors."""
    try:
        import yaml

        keys = yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}
    except Exception:  # noqa: BLE001 - no readable config: the app's own loader will say so
        return
    found = {_APP_KEYS[k] for k in keys if k in _APP_KEYS} if isinstance(keys, dict) else set()
    if len(found) == 1 and app not in found:
        other = found.pop()
        article, script = _APPS[other]
        raise CheckpointError(
            f"{checkpoint} is {article} checkpoint, not {_APPS[app][0]} one: use "
            f"`python {script} --ckpt {checkpoint}`"
        )


def resume_checkpoint(out_dir: Path, *, train_command: str, verbose: bool) -> Path:
    """The newest intact checkpoint of a run: ``latest`` if it is valid and every file
    verifies, else the newest older ``step-*`` folder that does (``run_checkpoint``, with a
    warning naming what was wrong when ``verbose``)."""
    return run_checkpoint(out_dir, train_command=train_command, skip_damaged=True,
                          verbose=verbose)


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
        self.path = out_dir / "log.jsonl"
        if resume_step and self.path.exists():
            gp.write_atomic(self.path, "".join(line + "\n" for line in
                                               self._records_until(resume_step)))
        elif self.path.exists():
            self.path.unlink()
        self.file = self.path.open("a")
        mode: Any = config.wandb_mode
        if mode == "offline" and os.environ.get("WANDB_API_KEY"):
            mode = "online"  # a key means the user wants the run online
        if mode != "disabled":
            try:
                import wandb

                self.run = wandb.init(
                    project=config.wandb_project,
                    config=dataclasses.asdict(config),
                    dir=str(out_dir),
                    mode=mode,
                    resume="allow",
                    id=wandb_run_id(out_dir),
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
        """Append one step's record to log.jsonl."""
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Send metrics to wandb (if on)."""
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.run is not None:
                self.run.finish()


def wandb_run_id(out_dir: Path) -> str:
    """One wandb run id per out_dir, so a resumed run continues the same wandb run."""
    path = out_dir / "wandb_id"
    if not path.exists():
        gp.write_atomic(path, secrets.token_hex(4))
    return path.read_text().strip()


# ---------------------------------------------------------------------------------------------
# Failures: divergence, interrupts, one clear line per error


class DivergenceError(FloatingPointError):
    """The training loss is not finite, or beyond the divergence bound; the message says the fix."""


def check_loss(loss: float, *, step: int, num_classes: int, factor: float, fix: str) -> None:
    """Stop a run whose loss diverged (the rule both apps document).

    A loss that is NaN or infinite, or larger than ``factor * ln(num_classes)``: ``ln(C)`` is the
    cross-entropy of a uniform guess over C classes (the loss of an untrained model), so a loss
    ``factor`` (1000 by default) times larger means the weights have blown up, although the
    number is still finite. ``factor=0`` keeps only the non-finite rule.
    """
    if not math.isfinite(loss):
        raise DivergenceError(f"loss is {loss} at step {step}; {fix}")
    bound = factor * math.log(max(num_classes, 2))
    if factor and loss > bound:
        raise DivergenceError(
            f"loss {loss:.4g} at step {step} exceeds max_loss_factor={factor:g} x "
            f"ln({num_classes}) = {bound:.4g} (a uniform guess's loss): the run diverged; {fix} "
            "(max_loss_factor=0 turns this rule off)"
        )


class Interrupt:
    """SIGINT / SIGTERM set a flag instead of killing the process, so the training loop can agree
    with the other ranks on a step, checkpoint it and exit cleanly (``signal_name`` says which).

    torchrun forwards SIGTERM to its workers and kills them 30 s later: the checkpoint must fit.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.reason = "a signal on another rank"  # what stopped the run, said by rank 0
        self.parent = os.getppid()
        self.previous = {sig: signal.signal(sig, self._handle)
                         for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.reason = self.signal_name
            if os.getppid() != self.parent:  # gp.init_process_groups' watch of torchrun
                self.reason = f"{self.signal_name}: this rank's torchrun agent died (lost node?)"

    def stop(self, *, step: int, checkpoint: Path, master: bool) -> Interrupted:
        """The exception to raise once the checkpoint of ``step`` is on disk; rank 0 (and a rank
        whose agent died) says why it stopped and how to continue."""
        message = ""
        if master or os.getppid() != self.parent:
            message = (f"interrupted ({self.reason}) at step {step}: checkpoint {checkpoint}; "
                       "continue with --resume")
        return Interrupted(self.signal_name or "SIGTERM", message)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Interrupted(Exception):
    """Raised after the checkpoint of an interrupted run is on disk (exit status 128 + signal)."""

    def __init__(self, signal_name: str, message: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + int(signal.Signals[signal_name])


CLEAR_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, CheckpointError, CheckpointWriteError, gp.CheckpointCorruptError,
    gp.PipelineFailure, DivergenceError,
)


def run_main(main: Callable[[], Any], *, command: str,
             errors: tuple[type[BaseException], ...] = ()) -> None:
    """A train script's entry point under torchrun: an error the user can fix (``CLEAR_ERRORS``
    and ``errors``) prints one line, once for the run rather than once per rank, and exits with
    status 1 instead of a traceback per rank; it is also recorded in the c10d store, so the
    other ranks name it (see gp.report_failure). ``command`` is how to launch it with torchrun.
    """
    if not all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        print(f"error: this script runs one process per pipeline stage under torchrun: "
              f"`{command}`", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except Interrupted as stop:
        if str(stop):
            _close_progress_bars()
            print(str(stop), file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except (*CLEAR_ERRORS, *errors) as error:
        gp.report_failure(error)
        if _first_to_say(error):
            _close_progress_bars()
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as error:
        # a bug: its traceback follows, but the other ranks name it rather than a hang
        gp.report_failure(error)
        raise


def _close_progress_bars() -> None:
    """End tqdm's open bars, so that a message starts on a line of its own."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", [])):
            bar.close()
    except Exception:  # noqa: BLE001 - cosmetic
        pass


def _first_to_say(error: BaseException) -> bool:
    """Rank 0 says its error; another rank only one that rank 0 does not say as well."""
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(error, gp.PipelineFailure):
        return True  # each survivor says where it stopped
    text = f"{type(error).__name__}: {error}"
    try:
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001
        store = None
    if store is None:
        return rank == 0  # before the process group: every rank read the same config
    try:
        store.set(f"apps/error/{rank}", text)
        if rank == 0:
            return True
        store.wait(["apps/error/0"], datetime.timedelta(seconds=2))
        return bool(store.get("apps/error/0").decode() != text)
    except Exception:  # noqa: BLE001 - rank 0 said nothing (or no store): say it here
        return True


def on_rank0(work: Callable[[], Any], *, what: str, timeout_s: float = 4 * 3600,
             workers: Collection[int] = (0,), silence_s: float | None = None) -> None:
    """Run ``work`` on global rank 0 while the other ranks wait for it in the c10d store.

    For long one-rank jobs (preparing a corpus): a barrier would be bounded by the process
    group's timeout, which is kept short so that a hung rank fails the run quickly. If ``work``
    raises, the other ranks stop naming rank 0's error.

    Two bounds: the job may take up to ``timeout_s``; and while it runs, rank 0 beats a
    heartbeat in the store every second from a thread, so a waiting rank that sees no beat for
    ``silence_s`` (default: the process group's timeout) stops, naming rank 0: a rank 0 that
    hangs (stopped, a stuck disk) or died fails the run within that bound however long the job
    (the store lives in torchrun's agent, not in rank 0). A job that holds the GIL longer than
    ``silence_s`` would be taken for a hang: the apps' jobs are torch, tar and SentencePiece
    calls of seconds, against a default of 300 s.

    ``workers``: the global ranks that run ``work`` together (rank 0 among them), e.g. the
    ranks of the first replica's pipeline evaluating through it; the rest wait until rank 0's
    part is done. A worker other than rank 0 that fails makes rank 0's part fail too (its
    collectives with that rank do, within the process group's timeout).
    """
    import threading

    if 0 not in workers:
        raise ValueError(f"workers={sorted(workers)} must include rank 0, which reports")
    store = dist.distributed_c10d._get_default_store()
    key = f"apps/on_rank0/{what}"
    beat_key = f"{key}/heartbeat"
    rank = dist.get_rank()
    if rank in workers:
        done = threading.Event()
        if rank == 0:
            def beat() -> None:
                count = 0
                while not done.wait(1.0):
                    count += 1
                    try:
                        store.set(beat_key, str(count))
                    except Exception:  # noqa: BLE001 - the waiters then see silence and say so
                        return

            store.set(beat_key, "0")
            threading.Thread(target=beat, name="gpipe-on-rank0-heartbeat", daemon=True).start()
        try:
            work()
        except BaseException as error:
            if rank == 0:
                store.set(key, f"{type(error).__name__}: {error}")
            raise
        finally:
            done.set()
        if rank == 0:
            store.set(key, "ok")
        return
    silence = gp.group_timeout_s() if silence_s is None else silence_s
    if not wait_for_rank0(store, key, what=what, rank=rank, silence_s=silence,
                          timeout_s=timeout_s):
        raise SystemExit(1)  # rank 0 says why (one message for the run, not one per rank)


def wait_for_rank0(store: Any, key: str, *, what: str, rank: int, silence_s: float,
                   timeout_s: float) -> bool:
    """Wait until rank 0 records ``key`` (True if it recorded "ok"), watching its heartbeat
    (``<key>/heartbeat``, any value that changes): :class:`PipelineFailure` naming rank 0 after
    ``silence_s`` without a change, or when the job takes longer than ``timeout_s``."""
    import time

    beat_key = f"{key}/heartbeat"
    begin = last_change = time.monotonic()
    last_beat = None
    while not store.check([key]):
        now = time.monotonic()
        beat = store.get(beat_key) if store.check([beat_key]) else None
        if beat != last_beat:
            last_beat, last_change = beat, now
        elif now - last_change > silence_s:
            raise gp.PipelineFailure(
                f"rank {rank} stops: rank 0 gave no sign of life for {silence_s:g} s while "
                f"{what} (that rank hangs or died)")
        if now - begin > timeout_s:
            raise gp.PipelineFailure(
                f"rank {rank} stops: rank 0 did not finish {what} within {timeout_s:g} s")
        time.sleep(0.25)
    return bool(store.get(key).decode() == "ok")
