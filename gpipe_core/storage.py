"""Checkpoint files on disk: atomic writes, and an index of sizes and hashes that loading verifies.

Every file goes to a temporary name in its own directory, is flushed and fsynced, replaces the
final name with ``os.replace`` (atomic on POSIX), and the directory is fsynced so the rename
survives a power cut. A reader therefore sees the old file or the new one, never a torn one.

A checkpoint folder's ``index.json`` records each file's size and SHA-256::

    {"num_shards": 2, "pipeline": {...}, "files": {"shard-000-of-002.pt": {"bytes": 5545,
                                                     "sha256": "..."}, ...}}

``pipeline`` (written by ``DistributedGPipe.save_checkpoint``) is the layout of the pipeline
that wrote it: stage split, placement, schedule, chunks (:mod:`gpipe_core.layout`).

:func:`verify_checkpoint` checks them and raises :class:`CheckpointCorruptError` naming the first
file that is missing, truncated or altered. An index without ``files`` (written before hashes
were recorded) verifies nothing, so old checkpoints still load.

A reader (an evaluation of a run that is still training) pins the folder it reads with
:func:`pin_checkpoint`: a shared ``flock`` on the folder's ``index.json``, held until
:func:`unpin_checkpoint` or the process ends (never stale). The trainer's rotation removes a
folder only through :func:`remove_checkpoint`, which takes the exclusive lock without waiting
and keeps a pinned folder for a later rotation::

    reader                                   trainer (publish_checkpoint)
    pin_checkpoint(step-27)  -> LOCK_SH      remove_checkpoint(step-27) -> LOCK_EX fails: kept
    verify, load ...                         ...
    unpin_checkpoint(step-27)                remove_checkpoint(step-27) -> removed next time

A reader that comes too late (the folder went between listing and pinning) gets
:class:`CheckpointGoneError` and looks again.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = [
    "INDEX",
    "CheckpointCorruptError",
    "CheckpointGoneError",
    "FileEntry",
    "pin_checkpoint",
    "read_index",
    "remove_checkpoint",
    "torch_load",
    "unpin_checkpoint",
    "verify_checkpoint",
    "write_atomic",
    "write_index",
]

INDEX = "index.json"
FileEntry = dict[str, Any]  # {"bytes": int, "sha256": str}
_CHUNK = 1 << 20


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated, altered or unreadable; the message names it."""


class CheckpointGoneError(FileNotFoundError):
    """A checkpoint folder was removed (a run's rotation) before it could be pinned."""


class _HashingWriter:
    """A binary file that hashes and counts what passes through it (for torch.save)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save hides it behind a RuntimeError

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename still happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, content: bytes | str | Any) -> FileEntry:
    """Write ``content`` to ``path`` atomically and durably; return its index entry.

    ``content``: bytes, text (UTF-8), or any other object, which is written with ``torch.save``.
    On a failed write (a full disk: ENOSPC, a size limit: EFBIG) the temporary file is removed,
    the file at ``path`` is as it was, and the OSError names ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as file:
            writer = _HashingWriter(file)
            if isinstance(content, str):
                writer.write(content.encode())
            elif isinstance(content, (bytes, bytearray)):
                writer.write(bytes(content))
            else:
                try:
                    torch.save(content, writer)  # type: ignore[arg-type]
                except RuntimeError:
                    if writer.error is not None:  # "unexpected pos 704 vs 598" means ENOSPC
                        raise writer.error from None
                    raise
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as error:  # e.g. ENOSPC from write or fsync, which name no file
        tmp.unlink(missing_ok=True)
        if error.filename is None and error.errno is not None:
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


def write_index(directory: str | Path, num_shards: int, files: dict[str, FileEntry], *,
                pipeline: dict[str, Any] | None = None) -> None:
    """Write ``index.json`` (atomically) recording every file's size and hash, and the
    ``pipeline`` layout when given."""
    index: dict[str, Any] = {"num_shards": num_shards}
    if pipeline is not None:
        index["pipeline"] = pipeline
    index["files"] = dict(sorted(files.items()))
    write_atomic(Path(directory) / INDEX, json.dumps(index, indent=1) + "\n")


def read_index(directory: str | Path) -> dict[str, Any]:
    """The parsed ``index.json`` of a checkpoint folder; CheckpointCorruptError if unreadable."""
    path = Path(directory) / INDEX
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no checkpoint ({INDEX} is missing)")
    try:
        index = json.loads(path.read_text())
        int(index["num_shards"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint index {path} is damaged ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(index, dict):
        raise CheckpointCorruptError(f"checkpoint index {path} is damaged (not a JSON object)")
    return index


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(directory: str | Path, names: Iterable[str] | None = None) -> None:
    """Check the files of a checkpoint folder (or only ``names``) against its ``index.json``.

    Raises CheckpointCorruptError naming the first file that is missing, has another size than
    recorded (truncated or extended) or another SHA-256 (altered). Files the index does not list
    are not checked (an index written before hashes were recorded lists none).
    """
    directory = Path(directory)
    files: dict[str, FileEntry] = read_index(directory).get("files") or {}
    for name in sorted(files) if names is None else names:
        entry = files.get(name)
        if entry is None:
            continue
        path = directory / name
        if not path.is_file():
            raise CheckpointCorruptError(f"checkpoint file {path} is missing (listed in {INDEX})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointCorruptError(
                f"checkpoint file {path} is damaged: {size} bytes, but {INDEX} recorded "
                f"{entry['bytes']} ({'truncated' if size < entry['bytes'] else 'extended'})"
            )
        if _sha256(path) != entry["sha256"]:
            raise CheckpointCorruptError(
                f"checkpoint file {path} is damaged: its SHA-256 differs from the one recorded "
                f"in {INDEX} (same size, altered bytes)"
            )


def torch_load(path: str | Path, *, weights_only: bool) -> Any:
    """``torch.load`` on CPU that names the file when it cannot be read."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointCorruptError(
            f"checkpoint file {path} is unreadable ({type(exc).__name__}: {exc})"
        ) from exc


# open index.json files holding a shared flock, by folder (released by unpin or at exit)
_PINS: dict[Path, int] = {}
_PIN_TRIES = 20  # a rotation holds its exclusive lock for one rmtree: milliseconds
_PIN_WAIT_S = 0.05


def pin_checkpoint(directory: str | Path) -> Path:
    """Keep ``directory`` from being removed by a run's rotation (:func:`remove_checkpoint`)
    until :func:`unpin_checkpoint` or the end of this process; returns the folder.

    Raises :class:`CheckpointGoneError` when the folder (its ``index.json``) is gone, or goes
    while being pinned. Pinning twice is one pin. Needs read access only (``flock`` works on a
    file opened for reading).
    """
    directory = Path(directory).resolve()
    if directory in _PINS:
        return directory
    index = directory / INDEX
    for _ in range(_PIN_TRIES):
        try:
            fd = os.open(index, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointGoneError(
                f"{directory} holds no checkpoint ({INDEX} is missing; removed by the run's "
                "rotation?)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # being removed right now: look again after it
            os.close(fd)
            time.sleep(_PIN_WAIT_S)
            continue
        except OSError:
            os.close(fd)
            raise
        try:
            same = os.stat(index).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # removed (or rewritten) between open and lock
            os.close(fd)
            raise CheckpointGoneError(
                f"{directory} was removed by the run's rotation while being opened")
        _PINS[directory] = fd
        return directory
    raise CheckpointGoneError(f"{directory} is being removed by the run's rotation")


def unpin_checkpoint(directory: str | Path) -> None:
    """Release :func:`pin_checkpoint`'s pin on ``directory`` (nothing if it holds none)."""
    fd = _PINS.pop(Path(directory).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor releases the flock


def remove_checkpoint(directory: str | Path) -> bool:
    """Delete a checkpoint folder unless a reader pinned it; return whether it was deleted.

    Never waits: a pinned folder stays, for the next rotation to delete once the reader is
    done. ``index.json`` goes first, under the exclusive lock, so a reader that opened it a
    moment before sees the folder gone rather than half of it.
    """
    directory = Path(directory)
    index = directory / INDEX
    try:
        fd = os.open(index, os.O_RDONLY)
    except OSError:  # no index: an incomplete folder, which no reader pins
        shutil.rmtree(directory, ignore_errors=True)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False  # a reader holds it
            raise
        index.unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
        return True
    finally:
        os.close(fd)
