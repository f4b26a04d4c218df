"""One builder per corpus directory: an exclusive lock beside it, held while it is prepared.

Runs started together (two seeds of a sweep, one process each) may each find the corpus missing
and start building it into the same directory; without a lock one reads shards the other is
writing. Whoever holds ``<out>.lock`` builds (or finds the corpus built and returns); the others
wait for it, then find the manifest written and reuse the corpus.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data.gettext_m2en.errors import PrepareError

__all__ = ["corpus_lock"]


@contextmanager
def corpus_lock(out: str | Path, *, timeout_s: float = 3600.0, poll_s: float = 0.5
                ) -> Iterator[None]:
    """Hold the exclusive lock of corpus directory ``out`` (the file ``<out>.lock``); wait at
    most ``timeout_s`` for another process holding it, then raise :class:`PrepareError`."""
    path = Path(f"{Path(out)}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(path, "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise PrepareError(
                        f"another process has held {path} for over {timeout_s:.0f} s while "
                        f"preparing {out}; wait for it to finish, or stop it (a lock whose "
                        "process has exited is released by the system)") from None
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
