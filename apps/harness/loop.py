"""The control around both apps' training loops: start, resume, stop vote, checkpoints, the end.

The apps differ in what a step is (a shared stream of token batches; epochs of image shards)
and agree on everything around it, which lives here once::

    run = start_run(config, ...)                    # out_dir checked, process groups, lock
    resume_dir, state = find_resume(config, run, ...)   # --resume: checkpoint, config, state
    ... build the pipeline and the optimizer ...
    if resume_dir is not None:
        restore(pipe, optimizer, resume_dir, state); ... the app's own state ...
    loop = TrainingLoop(config, run, pipe, optimizer=..., balance=..., length=..., step=...,
                        checkpoint_state=..., started=...)
    bar = loop.progress_bar(...)
    while True:
        choice = loop.budget(step, reserve_s=...)   # the run's length, fixed once (budget.py)
        if loop.vote(step, stop=..., data_ended=...): ...   # every rank stops at one step
        ... one step, logged through loop.logger and loop.window ...
        if every(step, config.log_every): loop.log_window(step, metrics, ...)
        if loop.step_end(step, checkpoint_due=..., eval_due=...): evaluate
    path = loop.finish(step); ... evaluate; rank 0: summary ...; return loop.close(summary)

The stop vote is one all-reduce of stop flags with MAX (any rank may stop the run): rank 0's
budget or clock, a replica whose data ran dry (an epoch's end), a signal on any rank. A signal
wins: the step is checkpointed (unless it already is) and :class:`Interrupted` is raised.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gpipe_core as gp
from apps.budget import BudgetChoice, RunLength
from apps.config import ConfigError, save_config
from apps.harness.checkpoints import (
    check_resumable,
    checkpoint_dir,
    load_train_state,
    refuse_existing_run,
    resume_checkpoint,
    write_checkpoint,
)
from apps.harness.guards import Interrupt
from apps.harness.out_dir import check_out_dir, lock_out_dir
from apps.harness.rank0 import on_rank0
from apps.harness.run import Run, setup_run
from apps.harness.run_log import RunLogger
from apps.harness.writes import guarded_write
from apps.validation import check_world

# On every rank: whether rank 0's progress bar is open, so that rank 0's terminal line may end
# in a half-drawn bar (tqdm redraws with "\r"). Another rank that prints while it is starts
# with a newline (apps.harness.entry), or its line would be glued to the bar's.
_BAR = [False]


def progress_bar_open() -> bool:
    """Whether rank 0's progress bar is open (read on any rank)."""
    return _BAR[0]

# what the stop vote says (TrainingLoop.vote), besides None (go on)
STOP = "stop"  # rank 0 ends the run (a budget, the clock)
DATA_ENDED = "data_ended"  # a replica's data ran dry: the epoch ends for every rank


def every(step: int, period: int) -> bool:
    """Whether ``step`` is one of every ``period`` steps (never for ``period`` 0)."""
    return bool(period) and step % period == 0


def start_run(config: Any, *, device: str, num_threads: int) -> Run:
    """Check that the world is whole pipelines of ``config.num_stages`` ranks, the device, and
    ``config.out_dir`` (every rank, before any process group: one line), start the
    process groups (every collective fails within ``config.timeout_s``, naming the rank that
    hangs; the long waits are on the store, ``on_rank0``) and lock out_dir on rank 0 until it
    exits (one run per out_dir at a time)."""
    out_dir = Path(config.out_dir)
    check_world(config.num_stages)  # num_stages against the ranks torchrun started
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but this machine has no CUDA GPU that torch can use; "
                          "give device=cpu (or device=auto)")
    check_out_dir(out_dir)
    run = setup_run(num_stages=config.num_stages, device=device, num_threads=num_threads,
                    timeout_s=config.timeout_s, pin_cpus=config.pin_cpus,
                    hold_memory=config.hold_memory)
    on_rank0(lambda: lock_out_dir(out_dir), what="locking out_dir")
    return run


def find_resume(config: Any, run: Run, *, train_command: str,
                load_config: Callable[[list[str]], Any],
                may_change: frozenset[str]) -> tuple[Path | None, dict[str, Any]]:
    """With ``config.resume``: the newest checkpoint whose files all verify (an older one, with
    a warning, if the newest is damaged), checked against ``config`` (only ``may_change`` keys
    may differ) and this rank's train state from it. Without: (None, {}), and a ConfigError if
    out_dir already holds a run (``--resume`` or another out_dir)."""
    out_dir = Path(config.out_dir)
    if not config.resume:
        refuse_existing_run(out_dir)
        return None, {}
    resume_dir = resume_checkpoint(out_dir, train_command=train_command, verbose=run.master)
    saved = load_config([f"--config={resume_dir / 'config.yaml'}"])
    check_resumable(saved, config, may_change=may_change, checkpoint=resume_dir)
    return resume_dir, load_train_state(resume_dir, run.rank, run.world_size)


def restore(pipe: gp.DistributedGPipe, optimizer: torch.optim.Optimizer, resume_dir: Path,
            state: dict[str, Any]) -> None:
    """Resume what every app's checkpoint holds (:meth:`TrainingLoop.checkpoint`): the stage's
    weights, the optimizer's moments and the pipeline's step count (it seeds dropout and
    drop-path: it must continue, not restart). The app restores its own state after it."""
    pipe.load_checkpoint(resume_dir)
    optimizer.load_state_dict(state["optimizer"])
    pipe.steps_done = state["pipe_steps"]
    if pipe.loss_scaler is not None and state.get("loss_scaler"):  # fp16: the scale goes on
        pipe.loss_scaler.load_state_dict(state["loss_scaler"])


class Window:
    """Training metrics over the steps since the last log line: mean loss, items per second."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss, self.steps, self.items = 0.0, 0, 0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Time from now (after a checkpoint or an evaluation, which are not training)."""
        self.start = time.monotonic()

    def add(self, loss: float, items: int) -> None:
        self.loss += loss
        self.steps += 1
        self.items += items

    @property
    def mean_loss(self) -> float:
        return self.loss / self.steps

    def per_second(self) -> float:
        return self.items / max(time.monotonic() - self.start, 1e-9)


class TrainingLoop:
    """What a training loop does besides its steps, the same on every rank.

    Created right before the loop (after resuming): every rank waits for the others, rank 0
    saves the resolved config in out_dir and opens the run's log; from here SIGINT / SIGTERM
    checkpoint at a step all ranks agree on (:meth:`vote`), then exit.

    ``pipe``: the pipeline whose shards the checkpoints hold; ``optimizer`` and ``balance``:
    saved in every rank's train state (with the step, the pipeline's step count, the run's
    length and the world size; :func:`restore` and :func:`find_resume` read them back);
    ``checkpoint_state(step)``: the app's own train state on this rank and rank 0's extra files
    (name -> text); ``length``: the run's :class:`RunLength`; ``step``: the steps done (a
    resumed run's); ``started``: the monotonic time the command started (a time budget counts
    the whole run).
    """

    def __init__(self, config: Any, run: Run, pipe: gp.DistributedGPipe, *,
                 optimizer: torch.optim.Optimizer, balance: list[int], length: RunLength,
                 step: int, checkpoint_state: Callable[[int], tuple[dict[str, Any], dict[str, str]]],
                 started: float) -> None:
        self.config, self.run, self.pipe, self.length = config, run, pipe, length
        self.optimizer, self.balance = optimizer, balance
        self.out_dir = Path(config.out_dir)
        self.checkpoint_state, self.started = checkpoint_state, started
        with gp.collectives("start of training"):
            dist.barrier()
        if run.master:
            with guarded_write(self.out_dir, self.out_dir / "config.yaml"):
                self.out_dir.mkdir(parents=True, exist_ok=True)
                save_config(config, self.out_dir / "config.yaml")
        self.logger = RunLogger(config, self.out_dir, resume_step=step, enabled=run.master)
        self.window = Window()
        self.bar: Any = None
        self.last_saved = step if config.resume else -1
        self.interrupt = Interrupt()

    # --- progress -------------------------------------------------------------------------

    def progress_bar(self, *, total: int, initial: int, unit: str = "step",
                     unit_scale: bool = False) -> Any:
        """Rank 0's progress bar (tqdm on stderr); says first how the run's length was chosen
        when it is already known."""
        from tqdm import tqdm

        if self.run.master and self.length.decided:
            self.run.say(self.length.choice.explain())  # type: ignore[union-attr]
        self.bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=unit_scale,
                        disable=not self.run.master, dynamic_ncols=True, file=sys.stderr,
                        mininterval=2.0)
        _BAR[0] = True
        return self.bar

    def close_bar(self) -> None:
        """Rank 0's bar closed (a no-op elsewhere, and when there is none or it is closed)."""
        if self.bar is not None:
            self.bar.close()
        _BAR[0] = False

    def announce(self, text: str, *, total: int | None = None) -> None:
        """A line above rank 0's bar (and its new total)."""
        if self.run.master:
            if total is not None:
                self.bar.total = total
            self.bar.write(text)
            self.bar.refresh()

    def log_window(self, step: int, metrics: dict[str, Any], **postfix: str) -> None:
        """Every ``log_every`` steps: the window's ``metrics`` to wandb, ``postfix`` on rank 0's
        bar, then a new window."""
        self.logger.metrics(metrics, step)
        self.bar.set_postfix(refresh=False, **postfix)
        self.window.reset()

    # --- the loop's control ---------------------------------------------------------------

    def budget(self, step: int, *,
               reserve_s: Callable[[float], float]) -> BudgetChoice | None:
        """At the top of every iteration: the run's length, fixed once from the timed first
        steps (a collective, on every rank); the choice the step it is made, else None.
        ``reserve_s(seconds_per_step)``: the time the final checkpoint and evaluation need."""
        self.length.tick(step)
        if not self.length.due(step):
            return None
        return self.length.decide(step=step, elapsed_s=time.monotonic() - self.started,
                                  reserve_s=reserve_s, master=self.run.master,
                                  device=self.run.device)

    def vote(self, step: int, *, stop: bool, data_ended: bool = False) -> str | None:
        """Every rank's vote before step ``step + 1`` (a collective): :data:`STOP` if rank 0
        ends the run (``stop``, read on rank 0 only), :data:`DATA_ENDED` if a rank's data ran
        dry, None to go on. A signal on any rank checkpoints ``step`` and raises Interrupted."""
        flags = torch.tensor([int(stop and self.run.master), int(data_ended),
                              int(self.interrupt.requested)], device=self.run.device)
        with gp.collectives(f"stop decision before step {step + 1}"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[2]:
            path = self.checkpoint(step)
            self.close_bar()
            self.logger.close()
            raise self.interrupt.stop(step=step, checkpoint=path, master=self.run.master)
        if flags[0]:
            return STOP
        if flags[1]:
            return DATA_ENDED
        return None

    def step_end(self, step: int, *, checkpoint_due: bool, eval_due: bool) -> bool:
        """After a step: checkpoint it when either is due; whether to evaluate now (not after
        the run's last step: the final evaluation follows the loop)."""
        if checkpoint_due or eval_due:
            self.checkpoint(step)
        return eval_due and step < self.length.steps

    def checkpoint(self, step: int) -> Path:
        """The checkpoint of ``step``, written unless it already is (a collective): shards,
        every rank's state, the config (recording the run's length) and rank 0's files."""
        if self.last_saved == step:
            return checkpoint_dir(self.out_dir, step)
        own, files = self.checkpoint_state(step)
        state = {"optimizer": self.optimizer.state_dict(), "step": step,
                 "pipe_steps": self.pipe.steps_done, "train_steps": self.length.recorded_steps,
                 "loss_scaler": (self.pipe.loss_scaler.state_dict()
                                 if self.pipe.loss_scaler is not None else None),
                 "world_size": self.run.world_size, "balance": self.balance, **own}
        config = replace(self.config, train_steps=state["train_steps"])
        path = write_checkpoint(self.out_dir, step, self.pipe, state, config,
                                rank=self.run.rank, files=files,
                                keep=config.keep_checkpoints)
        self.last_saved = step
        return path

    # --- the end --------------------------------------------------------------------------

    def finish(self, step: int) -> Path:
        """After the loop: rank 0's bar closed, and the last step checkpointed (unless it
        already is); the checkpoint's folder, which the final evaluation scores."""
        self.close_bar()
        return self.checkpoint(step)

    def close(self, summary: dict[str, Any] | None) -> dict[str, Any] | None:
        """After the final evaluation: rank 0's ``summary`` (None on the other ranks) written
        to ``summary.json``, then :meth:`end`; returns ``summary``."""
        if summary is not None:
            self.write_summary(summary)
        self.end()
        return summary

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json`` in out_dir (rank 0), atomically."""
        path = self.out_dir / "summary.json"
        with guarded_write(self.out_dir, path):
            gp.write_atomic(path, json.dumps(summary, indent=1) + "\n")

    def end(self) -> None:
        """Close the log, wait for rank 0's report, restore the signal handlers, leave the
        process groups."""
        self.logger.close()
        on_rank0(lambda: None, what="the end of the run")
        self.interrupt.restore()
        dist.destroy_process_group()
