"""One-rank jobs (preparing data, evaluating) that the other ranks wait for in the c10d store,
watching rank 0's heartbeat so that a rank 0 that hangs or died is named within a bound."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch.distributed as dist

import gpipe_core as gp


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
