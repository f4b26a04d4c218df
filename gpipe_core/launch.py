"""Launching processes on this host: spawned ranks with a file rendezvous, or a torchrun command.

Two ways to start a multi-process job, written once for tests, benchmarks and scripts:

- ``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size``
  fresh interpreters joined by a gloo process group (``file://`` rendezvous in a temporary
  folder, ``MASTER_ADDR=127.0.0.1``) and returns each rank's return value. It is bounded: past
  ``timeout_s`` every rank is killed, and once a rank fails the others get ``grace_s`` to end
  on their own before they are killed; the error quotes every failed rank's traceback. A rank
  that succeeded exits without the interpreter's teardown (atexit handlers do not run).
  ``start`` / ``collect`` are its two halves for a caller that watches the ranks itself.
- ``torchrun_command(module, args)`` is ``python -m torch.distributed.run ... -m module args``
  on 127.0.0.1 with a free port; ``torchrun(module, args)`` runs it and returns its output.

Nothing here is imported by the rest of the library: it is a tool around it.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "start", "collect", "stop", "free_port", "torchrun_command", "torchrun"]

Setup = Callable[[int, int], None]


def _worker(rank: int, world_size: int, root: str, fn: Callable[..., Any], args: tuple[Any, ...],
            pg_timeout_s: float, process_group: bool, setup: Setup | None) -> None:
    torch.set_num_threads(1)
    if setup is not None:  # before the process group, so that its threads inherit the setup
        setup(rank, world_size)
    if process_group:
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # never any other address
        dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, f"{root}/result-{rank}.pt")
    except BaseException:
        Path(f"{root}/error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if process_group and dist.is_initialized():
            dist.destroy_process_group()
    # Done, and the result saved: leave without the interpreter's teardown. A rank could abort
    # in it (SIGABRT, "terminate called without an active exception", no Python frame left;
    # gloo's threads meeting a half-finalized interpreter, pytorch/pytorch#179291): 3 of 50
    # tiny decoding benchmarks on 2 loaded cores, 0 of 70 leaving this way. A failed rank
    # still exits the usual way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start(fn: Callable[..., Any], world_size: int, root: str | Path, *args: Any,
          pg_timeout_s: float = 60.0, process_group: bool = True,
          setup: Setup | None = None) -> mp.ProcessContext:
    """Start ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; do not wait.

    ``root`` is a folder for the rendezvous and the ranks' results; ``process_group=False``
    skips the process group (a rank that does not communicate); ``setup(rank, world_size)``
    runs first in each process (CPU pinning, allocator settings). ``fn`` and ``setup`` must be
    picklable (module-level functions).
    """
    Path(root).mkdir(parents=True, exist_ok=True)
    return mp.start_processes(
        _worker, args=(world_size, str(root), fn, args, pg_timeout_s, process_group, setup),
        nprocs=world_size, join=False, start_method="spawn")


def stop(context: mp.ProcessContext) -> None:
    """Kill every rank still running and reap them all."""
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join()


def collect(context: mp.ProcessContext, root: str | Path, *, timeout_s: float | None = 600.0,
            grace_s: float | None = 10.0, expect_failure: bool = False) -> list[Any]:
    """Wait for the ranks of ``start``; return their results (see ``spawn``)."""
    world_size = len(context.processes)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first_failure: float | None = None
    timed_out = False
    while any(p.is_alive() for p in context.processes):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            timed_out = True
            break
        if first_failure is None and any(p.exitcode not in (None, 0) for p in context.processes):
            first_failure = now
        if (first_failure is not None and grace_s is not None and not expect_failure
                and now >= first_failure + grace_s):
            break
        time.sleep(0.05)
    alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
    stop(context)
    codes = [p.exitcode for p in context.processes]
    errors = [_read(Path(root, f"error-{rank}.txt")) for rank in range(world_size)]
    if timed_out:
        raise TimeoutError(f"{len(alive)} of {world_size} ranks (ranks {alive}) still ran after "
                           f"{timeout_s} s; they were killed (raise timeout_s if the job is "
                           "just slow)")
    if expect_failure:
        return list(zip(codes, errors, strict=True))
    if any(code != 0 for code in codes):
        killed = f"; ranks {alive} were killed {grace_s} s after the first failure" if alive else ""
        detail = "\n".join(f"--- rank {rank} (exit {code}):\n{error}"
                           for rank, (code, error) in enumerate(zip(codes, errors, strict=True))
                           if code != 0)
        raise RuntimeError(f"distributed run failed, exit codes {codes}{killed}\n{detail}")
    return [torch.load(Path(root, f"result-{rank}.pt"), weights_only=False)
            for rank in range(world_size)]


def spawn(fn: Callable[..., Any], world_size: int, root: str | Path | None = None, *args: Any,
          timeout_s: float | None = 240.0, grace_s: float | None = 10.0,
          expect_failure: bool = False, pg_timeout_s: float = 60.0,
          process_group: bool = True, setup: Setup | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    ``root``: the folder for the rendezvous and results (a temporary one, removed after, when
    None). ``pg_timeout_s``: the process group's timeout (how long a collective waits).
    ``timeout_s``: every rank is killed past it and ``TimeoutError`` raised (None: no bound,
    for measurements whose length the caller cannot know; the process group still bounds a
    hang). Once a rank fails, the others get ``grace_s`` to end on their own, then are killed
    and ``RuntimeError`` quotes every failed rank's traceback. ``expect_failure`` waits for
    every rank to end on its own and returns ``(exit code, traceback text)`` per rank instead.
    """
    if root is None:
        with tempfile.TemporaryDirectory() as temporary:
            return spawn(fn, world_size, temporary, *args, timeout_s=timeout_s, grace_s=grace_s,
                         expect_failure=expect_failure, pg_timeout_s=pg_timeout_s,
                         process_group=process_group, setup=setup)
    context = start(fn, world_size, root, *args, pg_timeout_s=pg_timeout_s,
                    process_group=process_group, setup=setup)
    return collect(context, root, timeout_s=timeout_s, grace_s=grace_s,
                   expect_failure=expect_failure)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# ---------------------------------------------------------------------------------------------
# torchrun on a free port of the loopback interface


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of one torchrun job)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(module: str, args: Sequence[str] = (), *, nproc: int = 2, nnodes: int = 1,
                     port: int | None = None, rdzv_id: str | None = None,
                     python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run ... -m module *args``, rendezvous on 127.0.0.1.

    ``port``: the rendezvous port (a free one when None; give the same to every node's command
    of a multi-node job, with an ``rdzv_id``).
    """
    port = free_port() if port is None else port
    command = [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
               f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}"]
    if rdzv_id is not None:
        command.append(f"--rdzv-id={rdzv_id}")
    return [*command, "-m", module, *args]


def torchrun(module: str, args: Sequence[str] = (), *, nproc: int = 2, timeout_s: float = 150.0,
             cwd: str | Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run ``torchrun_command(module, args)`` to its end; its output (stdout then stderr).

    One torch thread per process (``OMP_NUM_THREADS=1``) unless ``env`` says otherwise; raises
    ``RuntimeError`` quoting the end of the output on a non-zero exit status, and
    ``subprocess.TimeoutExpired`` past ``timeout_s``.
    """
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(torchrun_command(module, args, nproc=nproc), cwd=cwd,
                            env=environment, capture_output=True, text=True, timeout=timeout_s,
                            check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"torchrun -m {module} failed (exit {result.returncode}):\n"
                           f"{output[-6000:]}")
    return output
