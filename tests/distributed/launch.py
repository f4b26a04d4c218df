"""Run a function on several real torch.distributed processes (gloo, file:// rendezvous)."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int, world_size: int, root: str, fn: Callable[..., Any], args: tuple[Any, ...],
    pg_timeout_s: float = 60.0,
) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # never any other address
    dist.init_process_group(
        "gloo",
        init_method=f"file://{root}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, f"{root}/result-{rank}.pt")
    except BaseException:
        Path(f"{root}/error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout_s: float = 240.0,
    expect_failure: bool = False,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    ``pg_timeout_s``: the process group's timeout (how long a collective waits).

    Raises with every failed rank's traceback; kills all processes past ``timeout_s``.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    root = str(tmp_path)
    context = mp.start_processes(
        _worker, args=(world_size, root, fn, args, pg_timeout_s), nprocs=world_size, join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    for process in context.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in context.processes if p.is_alive()]
    for process in alive:
        process.kill()
        process.join()
    if alive:
        raise TimeoutError(f"{len(alive)} of {world_size} ranks still ran after {timeout_s} s")
    codes = [p.exitcode for p in context.processes]
    if expect_failure:
        return [(code, _read(f"{root}/error-{r}.txt")) for r, code in enumerate(codes)]
    errors = [_read(f"{root}/error-{r}.txt") for r in range(world_size)]
    if any(code != 0 for code in codes):
        detail = "\n".join(f"--- rank {r} (exit {c}):\n{e}" for r, (c, e) in enumerate(zip(codes, errors, strict=False)))
        raise RuntimeError(f"distributed run failed, exit codes {codes}\n{detail}")
    return [torch.load(f"{root}/result-{r}.pt", weights_only=False) for r in range(world_size)]


def _read(path: str) -> str:
    return Path(path).read_text() if os.path.exists(path) else ""


def torchrun(
    module: str, args: list[str], *, nproc: int = 2, timeout_s: float = 150.0
) -> str:
    """``python -m torch.distributed.run -m module args`` on 127.0.0.1; returns its output.

    Asserts a zero exit status, quoting the end of the output otherwise.
    """
    import socket
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as sock:  # a free port on the loopback interface
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "-m", module, *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                            timeout=timeout_s, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{output[-6000:]}"
    return output
