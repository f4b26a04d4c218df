"""A train script's entry point under torchrun: an error the user can fix is one line, once."""

from __future__ import annotations

import datetime
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import gpipe_core as gp
from apps.config import ConfigError
from apps.harness.checkpoints import CheckpointError, CheckpointWriteError
from apps.harness.guards import DivergenceError, Interrupted
from apps.harness.loop import progress_bar_open
from apps.harness.writes import RunWriteError
from apps.validation import leave_it_to_rank_0

CLEAR_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, CheckpointError, CheckpointWriteError, gp.CheckpointCorruptError,
    gp.PipelineFailure, DivergenceError, RunWriteError,
)


def run_main(main: Callable[[], Any], *, command: str,
             errors: tuple[type[BaseException], ...] = ()) -> None:
    """A train script's entry point under torchrun: an error the user can fix (``CLEAR_ERRORS``
    and ``errors``) prints one line, once for the run rather than once per rank, and exits with
    status 2 for a bad option (ConfigError) or 1 for the others, instead of a traceback per rank; it is also recorded in the c10d store, so the
    other ranks name it (see gp.report_failure). ``command`` is how to launch it with torchrun.
    """
    if not all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        print(f"error: this script runs one process per pipeline stage under torchrun: "
              f"`{command}`", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except Interrupted as stop:
        if str(stop):
            _close_progress_bars()
            print(str(stop), file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except (*CLEAR_ERRORS, *errors) as error:
        _record_said(error)  # before the failure record that the others name it from
        gp.report_failure(error)
        if _first_to_say(error):
            _close_progress_bars()
            print(f"{_line_start()}error: {error}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(error, ConfigError) else 1)  # 2: a usage error, as argparse
    except Exception as error:
        # a bug: its traceback follows, but the other ranks name it rather than a hang
        gp.report_failure(error)
        raise


def _close_progress_bars() -> None:
    """End tqdm's open bars, so that a message starts on a line of its own."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", [])):
            bar.close()
    except Exception:  # noqa: BLE001 - cosmetic
        pass


def _line_start() -> str:
    """A newline on a rank other than 0 while rank 0's progress bar is open: the ranks share
    the terminal (or torchrun's log), and the bar's last redraw ends without one."""
    if int(os.environ.get("RANK", "0")) != 0 and progress_bar_open():
        return "\n"
    return ""


def _said_as(error: BaseException) -> str:
    """What rank 0 and another rank compare to tell whether they say the same thing: the
    error's ``same_on_every_rank`` when it has one (a checkpoint that did not fit names each
    rank's own file, but it is one failure: the folder), else its text."""
    same = getattr(error, "same_on_every_rank", None)
    return f"{type(error).__name__}: {same if same is not None else error}"


def _first_to_say(error: BaseException) -> bool:
    """Rank 0 says its error; another rank only one that rank 0 does not say as well."""
    rank = int(os.environ.get("RANK", "0"))
    text = _said_as(error)
    try:
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001
        store = None
    if isinstance(error, gp.PipelineFailure):
        # each survivor says where it stopped, unless it only repeats the error that the
        # failed rank prints itself (a full disk on rank 0 is one line, not one per rank)
        return not _said_by_the_failed_rank(store, str(error))
    if store is None:  # before the process group: every rank read the same config
        return leave_it_to_rank_0()  # torchrun stops this rank once rank 0 has said it
    try:
        if rank == 0:
            return True
        store.wait(["apps/said/0"], datetime.timedelta(seconds=2))
        return bool(store.get("apps/said/0").decode() != text)
    except Exception:  # noqa: BLE001 - rank 0 said nothing (or no store): say it here
        return True


def _record_said(error: BaseException) -> None:
    """Put this rank's error line in the c10d store (``apps/error/<rank>``), and what it is
    compared by (``apps/said/<rank>``, :func:`_said_as`): rank 0's is compared by the others,
    and a survivor that would only repeat it stays silent."""
    if isinstance(error, gp.PipelineFailure):
        return
    try:
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        if store is not None:
            rank = int(os.environ.get("RANK", "0"))
            store.set(f"apps/error/{rank}", f"{type(error).__name__}: {error}")
            store.set(f"apps/said/{rank}", _said_as(error))
    except Exception:  # noqa: BLE001 - a side channel: without it, every rank speaks
        pass


_FAILED_AT = re.compile(r"the run failed at rank (\d+): (.*)", re.DOTALL)


def _said_by_the_failed_rank(store: Any, message: str) -> bool:
    """Whether ``message`` ("rank 1 stops: the run failed at rank 0: <error>") repeats an
    error that rank 0 prints itself: its ``apps/error/0`` key, set before its failure record,
    so no wait (a rank that raised a bug sets none, and its traceback names no run)."""
    found = _FAILED_AT.search(message)
    if store is None or found is None:
        return False
    try:
        key = f"apps/error/{found.group(1)}"
        return bool(store.check([key]) and store.get(key).decode() == found.group(2))
    except Exception:  # noqa: BLE001 - it printed nothing (or no store): say it here
        return False
