"""A report file of an evaluation command that cannot be written (a full disk, a read-only
folder, a folder where the file should be): one line that names the file, the free space, what
is intact, and what to do, in the shape of a training run's write failure
(``apps.harness.writes``)::

    could not write runs/nmt/test_bleu.json: [Errno 21] Is a directory: 'runs/nmt/test_bleu.json'
    (1.2 GB free on its filesystem); the checkpoint is untouched; free space there, or give the
    command another --out path

The commands (``python -m apps.nmt.evaluate``, ``python -m apps.amoebanet.evaluate``) wrap
their report writes in :func:`report_write` and print the :class:`ReportWriteError` as one
``error:`` line with exit status 1; the library's ``write_report`` functions raise the plain
OSError, which a training run turns into its own message (``apps.harness.writes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from apps.harness.write_failures import free_space

__all__ = ["ReportWriteError", "report_write"]


class ReportWriteError(RuntimeError):
    """A report file could not be written; the message names it, the free space and the fix."""


@contextmanager
def report_write(path: str | Path) -> Iterator[None]:
    """Turn an OSError of the writes in the block into :class:`ReportWriteError` naming
    ``path`` (the file being written) and the free space there."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno is not None:
            error = OSError(error.errno, error.strerror, str(path))
        raise ReportWriteError(
            f"could not write {path}: {error} ({free_space(Path(path))}); the checkpoint is "
            "untouched; free space there, or give the command another --out path"
        ) from error
