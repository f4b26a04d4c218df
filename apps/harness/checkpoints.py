"""Checkpoint folders of a run: writing them, finding the one to resume or evaluate.

A run's ``out_dir`` holds ``step-NNNNNNN/`` checkpoint folders, a ``latest`` file naming the
newest complete one (written only after every rank's files are on disk), ``log.jsonl`` (one line
per training step) and ``wandb_id`` (so a resumed run continues the same wandb run).

Every checkpoint file is written atomically and fsynced, and the folder's ``index.json`` records
each file's size and SHA-256 (``gpipe_core.storage``). Evaluation refuses a damaged checkpoint,
naming the file; ``--resume`` falls back to the newest intact checkpoint and says so.
``check_resumable`` is the one rule for which config keys a ``--resume`` may change.

A run may be evaluated while it trains: the readers (``resolve_checkpoint``: the eval scripts,
translate, classify) pin the folder they verified before reading it
(``gpipe_core.storage.pin_checkpoint``), the trainer's rotation skips a pinned folder (it goes
at a later rotation), and a folder rotated away between listing and pinning makes the reader
look again and take the run's newest intact checkpoint, with a warning.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import gpipe_core as gp
from apps.config import ConfigError, config_yaml
from apps.harness.write_failures import failure_message
from gpipe_core.storage import (
    CheckpointGoneError,
    pin_checkpoint,
    remove_checkpoint,
    torch_load,
    unpin_checkpoint,
)

KEEP_CHECKPOINTS = 2  # step folders kept in out_dir, the newest: the apps' keep_checkpoints default
LATEST = "latest"


class CheckpointError(FileNotFoundError):
    """No checkpoint where one was expected; the message says which command writes one."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, quota, ...); the message says which one,
    the free space, which earlier checkpoint is intact, and the command that continues
    (``apps.harness.write_failures.failure_message``). ``same_on_every_rank``: the checkpoint's
    folder; every rank that fails on it says one failure, so only rank 0 prints it."""

    def __init__(self, message: str, *, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.same_on_every_rank = None if checkpoint is None else str(checkpoint)


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` optimizer steps."""
    return out_dir / f"step-{step:07d}"


def publish_checkpoint(out_dir: Path, path: Path, *, keep: int = KEEP_CHECKPOINTS) -> None:
    """Point ``latest`` at ``path`` (atomically) and delete all but the ``keep`` newest steps
    (``keep=0``: every step up to ``path`` stays, e.g. for a curve scored after the run).

    Call on one rank, after a barrier that follows every rank's writes. A folder an
    evaluation has pinned stays until a later call finds it released.
    """
    gp.write_atomic(out_dir / LATEST, path.name + "\n")
    steps = [p for p in out_dir.glob("step-*") if p.is_dir() and p != path]
    # folders past ``path`` are left from a timeline this run abandoned (a crash mid-checkpoint,
    # or a damaged checkpoint it resumed before): never the fallback of a later resume
    newer = [p for p in steps if p.name > path.name]
    older = sorted(p for p in steps if p.name < path.name) if keep > 0 else []
    for old in newer + older[: max(0, len(older) - (keep - 1))]:
        remove_checkpoint(old)  # kept while a reader pins it


def holds_run(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a run to resume: ``latest`` is valid or a step folder holds a
    checkpoint. A damaged ``latest`` alone (nothing to resume) does not count."""
    out_dir = Path(out_dir)
    name, _ = read_latest(out_dir)
    return name is not None or any((p / "index.json").is_file() for p in out_dir.glob("step-*"))


def refuse_existing_run(out_dir: Path) -> None:
    """A fresh run must not overwrite another's checkpoints (:func:`holds_run`): ask for
    --resume or a new out_dir. A new run replaces a damaged ``latest`` alone."""
    if holds_run(out_dir):
        raise ConfigError(
            f"out_dir={out_dir} already holds a run (see {out_dir / LATEST}); pass --resume to "
            "continue it, or another --out_dir"
        )


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
    keep: int = KEEP_CHECKPOINTS,
) -> Path:
    """Checkpoint after ``step``: the pipeline's shards and every rank's ``state`` (collective),
    then on rank 0 the config and ``files`` (name -> text); ``latest`` moves once all are on disk
    and all but the ``keep`` newest step folders go (0: none go).
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
            publish_checkpoint(out_dir, path, keep=keep)
    except OSError as error:  # a full disk, a quota, a lost mount: say what is still there
        kept = (f"the previous checkpoint {out_dir / previous} is intact and {LATEST} still "
                "names it" if previous else "there is no earlier checkpoint")
        raise CheckpointWriteError(
            failure_message(out_dir, f"checkpoint {path}", error, intact=(kept, bool(previous))),
            checkpoint=path,
        ) from error
    return path


def resolve_checkpoint(path: str | Path, *, train_command: str, verify: bool = True) -> Path:
    """The checkpoint folder behind ``path``: a step folder, or a run's out_dir (its newest
    checkpoint, as ``run_checkpoint`` finds it: ``latest`` if it is valid, else the newest intact
    step folder, with a warning).

    ``train_command`` is quoted in the error when there is none (how to write one). With
    ``verify`` every file is checked against ``index.json`` (gp.CheckpointCorruptError names a
    damaged one).

    The folder returned is pinned (a running trainer's rotation keeps it) until
    :func:`unpin` or the end of the process: evaluating a run while it trains reads one
    consistent checkpoint.
    """
    path = Path(path)
    if not (path / "index.json").is_file() and (
        (path / LATEST).exists() or any(path.glob("step-*"))
    ):
        return run_checkpoint(path, train_command=train_command, skip_damaged=False,
                              verbose=int(os.environ.get("RANK", "0")) == 0, pin=True)
    missing = CheckpointError(
        f"no checkpoint at {path} (neither {path / LATEST} nor {path / 'index.json'} "
        f"exists); train one with `{train_command}`"
    )
    if not (path / "index.json").is_file():
        raise missing
    try:
        pin_checkpoint(path)
    except CheckpointGoneError as gone:
        raise CheckpointError(f"{gone}; pass the run's out_dir ({path.parent}) to use its "
                              "newest checkpoint") from gone
    if verify:
        try:
            gp.verify_checkpoint(path)
        except BaseException:
            unpin(path)
            raise
    return path


def agree_on_checkpoint(checkpoint: Path) -> Path:
    """Under torchrun, once the process groups exist: the one checkpoint every rank loads.

    Each rank resolved (and pinned) its own; while the run being evaluated publishes a new one,
    they can differ. All take the oldest of them: the rank that chose it keeps it pinned until
    every rank has pinned it too (the barrier), so the trainer cannot remove it in between.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return checkpoint
    names: list[Any] = [None] * dist.get_world_size()
    with gp.collectives("agreeing on the checkpoint to evaluate"):
        dist.all_gather_object(names, str(checkpoint))
        chosen = Path(min(names, key=lambda name: Path(name).name))
        if chosen != checkpoint:
            pin_checkpoint(chosen)
        dist.barrier()
    if chosen != checkpoint:
        unpin_checkpoint(checkpoint)
    return chosen


def unpin(checkpoint: Path) -> None:
    """Let a running trainer's rotation remove ``checkpoint`` again (``resolve_checkpoint``
    pinned it); call once its files are loaded."""
    unpin_checkpoint(checkpoint)


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


_ROTATION_RETRIES = 20  # a trainer rotating every step, each look taking milliseconds


def what_is_intact(out_dir: Path) -> tuple[str, bool]:
    """(what a reader of the message may rely on, whether there is a checkpoint to resume)."""
    name, _ = read_latest(out_dir)
    if name is None:
        return "there is no checkpoint yet", False
    return f"the last checkpoint {out_dir / name} is intact and {LATEST} names it", True


def run_checkpoint(out_dir: Path, *, train_command: str, skip_damaged: bool,
                   verbose: bool, pin: bool = False) -> Path:
    """The checkpoint of a run's ``out_dir`` that ``--resume``, the eval scripts, translate and
    classify use (the one place that reads ``latest``).

    ``latest`` is a hint (``read_latest``): when it is valid, the step folders after it are
    ignored (left by a crash mid-checkpoint, or by a timeline a resume abandoned). When it is
    not, every step folder is a candidate, and the newest one whose files verify is taken with
    a warning (on stderr when ``verbose``) saying what was wrong. ``skip_damaged``: a damaged
    checkpoint named by a valid ``latest`` is skipped for an older intact one (``--resume``)
    rather than refused (evaluation, which must score the checkpoint it was asked for).
    Every rank reaches the same answer from the same files.

    ``pin`` (readers, not the trainer, whose own rotation must remove what it resumed from):
    each candidate is pinned before it is verified, so the folder returned stays until
    :func:`unpin`; a candidate that the run's rotation removes first is looked for again
    (``latest`` has moved on), and the checkpoint used instead is named in a warning.
    """
    rotated: list[str] = []
    for _ in range(_ROTATION_RETRIES):
        try:
            return _run_checkpoint(out_dir, train_command=train_command,
                                   skip_damaged=skip_damaged, verbose=verbose, pin=pin,
                                   rotated=rotated)
        except CheckpointGoneError as gone:
            rotated.append(str(gone))
    raise CheckpointError(
        f"every checkpoint of {out_dir} was removed by the run's rotation before it could be "
        f"opened, {_ROTATION_RETRIES} times ({rotated[-1]}); is another process deleting "
        "step folders? pass a step folder, or keep_checkpoints=0 in the training run"
    )


def _run_checkpoint(out_dir: Path, *, train_command: str, skip_damaged: bool, verbose: bool,
                    pin: bool, rotated: list[str]) -> Path:
    name, problem = read_latest(out_dir)
    candidates = sorted(
        (p for p in out_dir.glob("step-*")
         if p.is_dir() and _STEP_NAME.fullmatch(p.name) and (name is None or p.name <= name)),
        reverse=True,
    )
    if pin and name is not None and not (out_dir / name).is_dir():
        raise CheckpointGoneError(f"{out_dir / name} was removed by the run's rotation while "
                                  "being opened")
    problems = [problem] if problem else []
    damaged = False
    for candidate in candidates:
        try:
            if pin:
                try:
                    pin_checkpoint(candidate)
                except CheckpointGoneError:
                    if name is not None:  # latest has moved on: look again
                        raise
                    # no valid latest: verify names the folder without index.json, as before
            gp.verify_checkpoint(candidate)
        except (gp.CheckpointCorruptError, FileNotFoundError) as error:
            if isinstance(error, CheckpointGoneError):
                raise
            if pin:
                unpin_checkpoint(candidate)
            if candidate.name == name and not skip_damaged:
                raise
            problems.append(str(error))
            damaged = True
            continue
        if rotated and verbose:
            print(f"warning: {rotated[0]}; using the run's newest intact checkpoint "
                  f"{candidate} instead", file=sys.stderr, flush=True)
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


# config keys only one app has, and the command that evaluates that app's checkpoints
_APP_KEYS = {"genotype": "amoebanet", "num_heads": "nmt"}
_APPS = {"nmt": ("an NMT", "-m apps.nmt.evaluate"),
         "amoebanet": ("an AmoebaNet", "-m apps.amoebanet.evaluate")}


def require_app(checkpoint: Path, app: str) -> None:
    """CheckpointError if the config saved in ``checkpoint`` is another app's ("this is an NMT
    checkpoint: use python -m apps.nmt.evaluate") instead of a page of unknown-key errors."""
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
