"""A write of a run that fails (a full disk, a quota, a size limit): one line that says what now.

Every file a training run writes in ``out_dir`` (``log.jsonl``, ``config.yaml``, ``wandb_id``,
``summary.json``, reports and plots, checkpoints) fails with :class:`RunWriteError`::

    could not write <out_dir>/log.jsonl: [Errno 28] No space left on device: '<out_dir>/log.jsonl'
    (0 bytes free on its filesystem); the last checkpoint <out_dir>/step-0000004 is intact and
    latest names it; free space (or fix out_dir) and continue with --resume:
    `python -m torch.distributed.run --standalone --nproc-per-node 2 -m apps.nmt.train ... --resume`

``log.jsonl`` grows by whole records only (:func:`append_record`): a record that does not fit
is cut back off, so a resume never meets a torn line.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class RunWriteError(RuntimeError):
    """A file of a run could not be written; the message names it, the free space, the
    checkpoint that is intact and the command that continues the run."""


def free_space(path: Path) -> str:
    """The space left on ``path``'s filesystem (the nearest existing folder), for a message."""
    for folder in (path, *path.parents):
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            continue
        return f"{_bytes(free)} free on its filesystem"
    return "free space unknown"


def _bytes(count: int) -> str:
    if count < 1000:
        return f"{count} bytes"
    for unit in ("kB", "MB", "GB", "TB"):
        count_f = count / 1000
        if count_f < 1000 or unit == "TB":
            return f"{count_f:.1f} {unit}"
        count = int(count_f)
    return f"{count} bytes"  # unreachable


def resume_command() -> str:
    """This training command again with ``--resume``: the launcher torchrun gave this process
    (``-m`` module, this node's process count) and the same options."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    module = spec.name if spec is not None else "apps.<app>.train"
    args = [arg for arg in sys.argv[1:] if not arg.startswith("--resume")]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    launcher = ("--standalone" if local == world
                else f"--nnodes {max(world // max(local, 1), 1)} <rendezvous options, on every node>")
    return (f"python -m torch.distributed.run {launcher} --nproc-per-node {local} -m {module} "
            + shlex.join([*args, "--resume"]))


def what_is_intact(out_dir: Path) -> tuple[str, bool]:
    """(what a reader of the message may rely on, whether there is a checkpoint to resume)."""
    from apps.harness.checkpoints import LATEST, read_latest

    name, _ = read_latest(out_dir)
    if name is None:
        return "there is no checkpoint yet", False
    return f"the last checkpoint {out_dir / name} is intact and {LATEST} names it", True


def failure_message(out_dir: Path, what: str, error: OSError, *,
                    intact: tuple[str, bool] | None = None) -> str:
    """``could not write <what>: <error> (<free space>); <what is intact>; <what to do>``.
    ``intact``: :func:`what_is_intact`'s answer, when the caller knows better (a checkpoint
    being written, whose ``latest`` may not be the previous one yet)."""
    said, resumable = intact if intact is not None else what_is_intact(out_dir)
    if resumable:
        todo = f"free space (or fix out_dir) and continue with --resume: `{resume_command()}`"
    else:
        command = resume_command().removesuffix(" --resume")
        todo = f"free space (or fix out_dir) and start the run again: `{command}`"
    return f"could not write {what}: {error} ({free_space(out_dir)}); {said}; {todo}"


@contextmanager
def guarded_write(out_dir: str | Path, path: str | Path) -> Iterator[None]:
    """Turn an OSError of the writes in the block into :class:`RunWriteError` naming ``path``."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno is not None:
            error = OSError(error.errno, error.strerror, str(path))
        raise RunWriteError(failure_message(Path(out_dir), str(path), error)) from error


def append_record(fd: int, record: bytes, path: Path) -> None:
    """Append ``record`` (one line) to the file open at ``fd`` whole or not at all: a write that
    fails part way (a full disk) is cut back off, and the OSError names ``path``."""
    size = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(record)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as error:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        raise OSError(error.errno, error.strerror, str(path)) from error
