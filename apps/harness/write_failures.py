"""The message of a run's failed write: ``could not write <file>: <error> (<free space>);
<what is intact>; <what to do>``, with the command that continues the run.

Below both :mod:`apps.harness.checkpoints` (a checkpoint that does not fit) and
:mod:`apps.harness.writes` (every other file of a run), so neither imports the other's module
for it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


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


def failure_message(out_dir: Path, what: str, error: OSError, *,
                    intact: tuple[str, bool]) -> str:
    """``could not write <what>: <error> (<free space>); <what is intact>; <what to do>``.
    ``intact``: (what a reader may rely on, whether there is a checkpoint to resume), e.g.
    ``apps.harness.checkpoints.what_is_intact``'s answer."""
    said, resumable = intact
    if resumable:
        todo = f"free space (or fix out_dir) and continue with --resume: `{resume_command()}`"
    else:
        command = resume_command().removesuffix(" --resume")
        todo = f"free space (or fix out_dir) and start the run again: `{command}`"
    return f"could not write {what}: {error} ({free_space(out_dir)}); {said}; {todo}"
