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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from apps.harness.checkpoints import what_is_intact
from apps.harness.write_failures import failure_message


class RunWriteError(RuntimeError):
    """A file of a run could not be written; the message names it, the free space, the
    checkpoint that is intact and the command that continues the run."""


@contextmanager
def guarded_write(out_dir: str | Path, path: str | Path) -> Iterator[None]:
    """Turn an OSError of the writes in the block into :class:`RunWriteError` naming ``path``."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno is not None:
            error = OSError(error.errno, error.strerror, str(path))
        raise RunWriteError(failure_message(Path(out_dir), str(path), error,
                                            intact=what_is_intact(Path(out_dir)))) from error


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
