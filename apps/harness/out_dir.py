"""A run's folder: one a process can write, and that one run at a time holds (``.lock``)."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

from apps.config import ConfigError


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
