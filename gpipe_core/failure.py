"""Failure reporting through the c10d store: a failing rank is named, never a bare timeout.

The first rank that fails records its error under one store key (``report_failure``); others
that then fail waiting on it quote that record instead of their own timeout. Around blocks of
collectives (``collectives``) every rank also records which block it entered, so a rank that
hangs or died before a block is named by the ranks that wait in it.

The bound: every wait of a pipeline (a message, a collective) ends after the process group's
timeout; naming the failed rank then takes at most ``NAMING_S`` seconds more (waiting for a rank
that raised to record its error, or for the marks of ranks that time out a moment later). So a
rank whose peer died or hangs raises :class:`PipelineFailure` within ``timeout_s + NAMING_S``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["NAMING_S", "PipelineFailure", "collectives", "first_failure", "report_failure",
           "default_store"]


class PipelineFailure(RuntimeError):
    """Another rank of the pipeline failed; the message names it and its error."""


def default_store() -> Any:
    """The c10d store of the default process group (None without one)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - the store is a best-effort side channel
        return None


_FAILURE_KEY = "gpipe/first_failure"
_MARK_KEY = "gpipe/mark/{rank}"  # the `collectives` block each rank last entered (or failed in)
_sections = itertools.count()  # blocks entered by this process, in order
NAMING_S = 5.0  # the most a failing rank spends, after its wait timed out, naming who failed
_GRACE_S = 2.0  # how long a failing rank waits for others' marks to settle before naming them


def report_failure(exc: BaseException, *, where: str | None = None) -> None:
    """Record ``exc`` in the c10d store as the run's first failure (if none was recorded yet).

    Other ranks that then fail waiting for this one name it and its error instead of a timeout.
    Call it from a script's top-level error handler; DistributedGPipe does for its own steps.
    """
    if isinstance(exc, PipelineFailure) or not dist.is_initialized():
        return
    store = default_store()
    if store is None:
        return
    where = where or f"rank {dist.get_rank()}"
    try:
        # compare_set writes only if nobody failed before us: the first failure wins.
        store.compare_set(_FAILURE_KEY, "", f"{where}: {type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001
        pass


def first_failure(store: Any, wait_s: float) -> str | None:
    """The first failure recorded in the store, waiting up to ``wait_s`` for one."""
    # polls with check(): store.wait() would print a warning from c10d when it times out
    deadline = time.monotonic() + wait_s
    try:
        while not store.check([_FAILURE_KEY]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        first: str = store.get(_FAILURE_KEY).decode()
        return first or None
    except Exception:  # noqa: BLE001
        return None


def _set_mark(store: Any, rank: int, section: int, what: str, state: str) -> None:
    global _marks_off
    if _marks_off:
        return
    mark = json.dumps({"section": section, "what": what, "state": state})
    try:
        store.set(_MARK_KEY.format(rank=rank), mark)
    except Exception:  # noqa: BLE001 - the store is a side channel; the collective still runs
        _marks_off = True  # its host is gone (a lost node): stop asking, and warning, each time


_marks_off = False


def _get_marks(store: Any, world: int) -> dict[int, dict[str, Any]]:
    marks = {}
    for rank in range(world):
        key = _MARK_KEY.format(rank=rank)
        try:
            if store.check([key]):
                marks[rank] = json.loads(store.get(key).decode())
        except Exception:  # noqa: BLE001
            continue
    return marks


@contextlib.contextmanager
def collectives(what: str) -> Iterator[None]:
    """A block of collectives outside ``step()`` that fails, naming the rank, instead of hanging.

    Every rank of the world must enter the same blocks in the same order (a collective needs all
    its ranks anyway). A collective waits at most the process group's timeout
    (``init_process_groups(timeout_s=...)``, the same bound as the pipeline's); when one fails
    (a rank stopped answering, or died), the block raises :class:`PipelineFailure` naming the
    rank(s) that did not get there: each rank records in the c10d store which block it entered
    (and that it failed there), and the ranks still behind, or inside the block without having
    failed within a short grace, are named.
    A rank that raised instead is named with its error (:func:`report_failure`).
    """
    store = default_store() if dist.is_initialized() else None
    if store is None:
        yield
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    section = next(_sections)
    _set_mark(store, rank, section, what, "in")
    try:
        yield
    except PipelineFailure:
        raise
    except RuntimeError as exc:
        if not _is_communication_error(exc):
            raise  # a bug in the block, not a peer: its own error and traceback
        _set_mark(store, rank, section, what, "failed")
        raise _collective_failure(store, rank, world, section, what, exc) from exc
    # no mark on the way out (one store round trip per block is enough): a rank that left this
    # block and hangs before the next one is found behind by whoever waits in the next one


_COMMUNICATION_WORDS = ("gloo", "nccl", "timed out", "connection", "socket", "peer")


def _is_communication_error(exc: BaseException) -> bool:
    """Whether a collective failed for want of a peer (gloo raises plain RuntimeErrors: timed
    out, connection reset or closed), as opposed to an error in the caller's own code."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(word in text for word in _COMMUNICATION_WORDS)


def _collective_failure(store: Any, rank: int, world: int, section: int, what: str,
                        exc: BaseException) -> PipelineFailure:
    where = f"rank {rank} stops"
    first = first_failure(store, 0.5)
    if first:
        return PipelineFailure(f"{where}: the run failed at {first}")

    def stuck(marks: dict[int, dict[str, Any]]) -> dict[int, str]:
        found = {}
        for other in range(world):
            mark = marks.get(other)
            if other == rank:
                continue
            if mark is None:
                found[other] = "never entered a collective block"
            elif mark["section"] < section:
                found[other] = f"is still at {mark['what']!r}"
            elif mark["section"] == section and mark["state"] == "in":
                found[other] = "is inside it and has not failed"
        return found

    deadline = time.monotonic() + _GRACE_S  # ranks that time out a moment after us drop out
    found = stuck(_get_marks(store, world))
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = stuck(_get_marks(store, world))
    first = first_failure(store, 0.1)
    if first:
        return PipelineFailure(f"{where}: the run failed at {first}")
    error = " ".join(str(exc).split())[:300]
    if not found:
        return PipelineFailure(f"{where}: a collective in {what!r} failed ({error})")
    names = "; ".join(f"rank {r} {why}" for r, why in found.items())
    return PipelineFailure(
        f"{where}: a collective in {what!r} got no answer ({names}; that rank hangs or died; "
        f"{error})"
    )


def peer_failure(where: str, error: BaseException, timeout_s: float) -> PipelineFailure:
    """The error a rank raises when a neighbour stopped answering: the recorded first failure
    of the run if some rank reported one within a few seconds, else ``error`` itself."""
    store = default_store()
    # After a timeout, a peer that raised has long since recorded its error: a short look is
    # enough. A closed connection may come a moment before the record (the peer records, then
    # exits; we may notice the exit first): wait for it, up to NAMING_S.
    timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
    wait_s = 0.5 if timed_out else NAMING_S
    first = first_failure(store, wait_s) if store is not None else None
    if first:
        return PipelineFailure(f"{where} stops: the pipeline failed at {first}")
    return PipelineFailure(
        f"{where} stops: {error} (no answer within {timeout_s:g} s or connection closed; that "
        "rank failed or hangs)"
    )

