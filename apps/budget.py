"""A run's length in steps, fixed from the speed measured at its start so that it fits its time.

A budget in steps gives the same model on every machine but may not fit the time a user has; a
wall-clock cap fits the time but cuts the learning-rate schedule wherever the clock falls, so a
slower machine gets an unannealed model. The apps do neither: they time the first steps of the
run (all inside the learning rate's warm-up, whose values do not depend on the run's length),
then fix the number of steps once, so that training and the final evaluation end within
``budget_minutes``, and the schedule is laid over exactly those steps::

    step 0 ....... skip ............ decide_at ........................... train_steps
         warm-up    |--- timed -------|  budget fixed: the schedule's length = train_steps

From that step on the run is deterministic: the chosen ``train_steps`` goes into the run's
config, checkpoint and summary, and ``--train_steps=N`` on another machine (or ``--resume``)
reproduces it exactly. A machine that slows down after the decision makes the run take longer;
it never shortens the schedule.

Every setting of how long a run lasts, in both apps (:data:`RETIRED_LENGTH_KEYS` are refused,
naming these)::

    train_steps      the run's length in optimizer steps, and its schedule's (0: decided below)
    budget_minutes   a time the length is fitted to once the first steps were timed (0: none)
    max_steps/epochs the most the config trains (NMT in steps, AmoebaNet in epochs): the length
                     when neither of the above is given, and the cap of a fitted one
    goal_steps       the steps at which the config's quality goal was measured (only reported)
    stop_at_step     a run option, not a length: this invocation stops after that step with a
                     checkpoint, the schedule unchanged, and ``--resume`` continues
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import gpipe_core as gp
from apps.config import ConfigError

__all__ = ["HOW_LONG", "RETIRED_LENGTH_KEYS", "BudgetChoice", "RunLength", "StepTimer", "choose_train_steps",
           "decision_step"]

SKIP_STEPS = 5  # the first steps are slower (allocator, caches, the data loader filling up)
TIMED_STEPS = 30  # steps timed after those: the pipeline's step time over a few dozen batches
SAFETY = 1.08  # time per step assumed above the measured one (epoch ends, checkpoints, logging)

HOW_LONG = ("a run's length is --train_steps=N (optimizer steps; the learning-rate schedule "
            "spans them) or --budget_minutes=T (the steps that fit T minutes, fitted once the "
            "first steps were timed)")
# Settings of a run's length that are no longer settings in either app, and what replaces each
# (apps.config refuses them when set; at 0, their old 'off', they are dropped, so a checkpoint's
# saved config.yaml from before still loads). Each app's config adds its own.
RETIRED_LENGTH_KEYS = {
    "max_minutes": (f"{HOW_LONG}; to stop now and continue later, give --stop_at_step=N or "
                    "send SIGTERM (a checkpoint is written), then --resume"),
}


def decision_step(warmup_steps: float) -> int:
    """The step after which the budget is fixed: ``SKIP_STEPS + TIMED_STEPS``, or the end of
    warm-up if that comes first (the steps before the decision must not depend on it)."""
    end = SKIP_STEPS + TIMED_STEPS
    if warmup_steps < end:
        end = int(warmup_steps)
    if end < SKIP_STEPS + 5:
        raise ValueError(
            f"a time budget times the steps of the learning rate's warm-up, but warm-up has only "
            f"{warmup_steps:g} steps; give it at least {SKIP_STEPS + 5} steps, or fix the run's "
            "length with --train_steps=N"
        )
    return end


class StepTimer:
    """Wall time of the steps ``[skip, decide_at)`` of the training loop, on the deciding rank.

    Call :meth:`tick` at the top of each loop iteration with the number of steps done; the time
    between ticks is everything the loop does for a step (data, pipeline, optimizer, logging).
    """

    def __init__(self, *, skip: int, decide_at: int) -> None:
        self.skip, self.decide_at = skip, decide_at
        self._start: float | None = None
        self.seconds_per_step: float | None = None

    def tick(self, step: int) -> None:
        if step == self.skip:
            self._start = time.monotonic()
        elif step == self.decide_at and self._start is not None:
            self.seconds_per_step = (time.monotonic() - self._start) / (self.decide_at - self.skip)


@dataclass(frozen=True)
class BudgetChoice:
    """What was decided, and from what (written to the run's summary)."""

    train_steps: int  # the run's length in optimizer steps: the learning-rate schedule's length
    # "measured" (fitted to budget_minutes), "train_steps" (given), or the config's length
    # without a budget ("epochs", "max_steps")
    chosen_by: str
    budget_minutes: float = 0.0  # the whole run's wall-clock limit it was fitted to
    seconds_per_step: float = 0.0  # measured over steps [skip, decide_at)
    timed_steps: tuple[int, int] = (0, 0)  # [skip, decide_at)
    elapsed_s: float = 0.0  # wall time of the run when the budget was fixed
    reserve_s: float = 0.0  # kept for the final checkpoint and evaluation
    fitted_steps: int = 0  # what the time allowed, before the cap
    cap: int = 0  # the most steps the config allows (epochs or max_steps)
    # the steps at which the config's quality goal was measured to hold (docs/RESULTS.md); 0 =
    # the config states none. A machine that affords fewer is told so, with the budget it needs
    goal_steps: int = 0

    @property
    def below_goal(self) -> bool:
        """Whether the run trains fewer steps than its config's quality goal was measured at."""
        return 0 < self.train_steps < self.goal_steps

    @property
    def minutes_for_goal(self) -> float:
        """The ``budget_minutes`` that would have given ``goal_steps`` at the measured speed."""
        if not (self.goal_steps and self.seconds_per_step):
            return 0.0
        after = max(0, self.goal_steps - self.timed_steps[1]) * self.seconds_per_step * SAFETY
        return (self.elapsed_s + self.reserve_s + after) / 60.0

    def explain(self, unit: str = "") -> str:
        """One line for the progress bar and the log."""
        if self.chosen_by != "measured":
            return f"budget: {self.train_steps} steps{unit}, as configured ({self.chosen_by})"
        capped = (f"; capped at {self.cap} by the config (the time allowed {self.fitted_steps})"
                  if self.train_steps < self.fitted_steps else "")
        return (
            f"budget: {self.train_steps} steps{unit}, from {self.seconds_per_step:.3f} s per step "
            f"measured over steps {self.timed_steps[0]}-{self.timed_steps[1]} on this machine, to "
            f"end within budget_minutes={self.budget_minutes:g} ({self.elapsed_s / 60:.1f} min "
            f"spent so far, {self.reserve_s / 60:.1f} min kept for the final checkpoint and "
            f"evaluation){capped}; the learning-rate schedule spans exactly these steps. "
            f"Rerun this run exactly with --train_steps={self.train_steps}{self._goal_note()}"
        )

    def _goal_note(self) -> str:
        if not self.below_goal:
            return ""
        return (
            f". NOTE: this machine affords {self.train_steps} steps, fewer than the "
            f"{self.goal_steps} at which this config's quality goal was measured to hold "
            f"(docs/RESULTS.md), so expect lower scores than the README's; at this speed "
            f"--budget_minutes={math.ceil(self.minutes_for_goal)} would give {self.goal_steps} "
            "steps"
        )

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["timed_steps"] = list(self.timed_steps)
        record["below_goal"] = self.below_goal
        if self.below_goal:
            record["minutes_for_goal"] = round(self.minutes_for_goal, 1)
        return record


def choose_train_steps(
    *,
    budget_minutes: float,
    seconds_per_step: float,
    elapsed_s: float,
    reserve_s: float,
    cap: int,
    at_least: int,
    timed_steps: tuple[int, int],
    goal_steps: int = 0,
) -> BudgetChoice:
    """The most steps that end, with ``reserve_s`` after them, within ``budget_minutes``.

    ``elapsed_s``: the run's wall time so far (``timed_steps[1]`` steps done); ``cap``: the
    config's most steps; ``at_least``: the steps already done (a budget never undoes them);
    ``goal_steps``: the steps the config's quality goal was measured at (only reported).
    """
    if not seconds_per_step > 0:
        raise ValueError(f"seconds_per_step={seconds_per_step!r} must be positive")
    left_s = 60.0 * budget_minutes - elapsed_s - reserve_s
    fitted = timed_steps[1] + max(0, math.floor(left_s / (seconds_per_step * SAFETY)))
    steps = max(at_least, min(cap, fitted))
    return BudgetChoice(
        train_steps=steps, chosen_by="measured", budget_minutes=budget_minutes,
        seconds_per_step=seconds_per_step, timed_steps=timed_steps, elapsed_s=elapsed_s,
        reserve_s=reserve_s, fitted_steps=fitted, cap=cap, goal_steps=goal_steps,
    )


class RunLength:
    """How many steps a run trains: given (``train_steps``), fitted to ``budget_minutes`` once
    the first steps were timed, or the config's cap (``epochs`` x steps per epoch, or
    ``max_steps``). Every rank holds one; :meth:`decide` is a collective at ``decide_at``.

    ``step``: the steps already done (a resumed run); ``saved_steps``: the length a resumed
    run's checkpoint recorded (0 if it was saved before the decision); ``goal_steps``: the steps
    at which the config's quality goal was measured to hold (0: none), reported beside a
    measured length that falls short of it; ``stop_at_step``: this invocation stops there (0:
    at the run's end), the length and the schedule unchanged.
    """

    def __init__(self, *, train_steps: int, budget_minutes: float, cap: int, cap_name: str,
                 warmup_steps: float, step: int = 0, saved_steps: int = 0,
                 goal_steps: int = 0, stop_at_step: int = 0) -> None:
        self.cap, self.budget_minutes, self.goal_steps = cap, budget_minutes, goal_steps
        self.stop_at_step = stop_at_step
        self.timer: StepTimer | None = None
        self.choice: BudgetChoice | None = None
        if saved_steps and train_steps and saved_steps != train_steps:
            raise ConfigError(
                f"train_steps={train_steps}, but the checkpoint's run has train_steps="
                f"{saved_steps}; resume without --train_steps (or with that value)"
            )
        steps = saved_steps or train_steps
        if steps > cap:
            raise ConfigError(
                f"train_steps={steps} exceeds the most this config trains ({cap_name}: {cap} "
                f"steps); raise {cap_name.split('=')[0]} or lower train_steps"
            )
        if steps:
            self.choice = BudgetChoice(train_steps=steps, chosen_by="train_steps", cap=cap)
        elif not budget_minutes:
            self.choice = BudgetChoice(train_steps=cap, chosen_by=cap_name, cap=cap)
        else:
            decide_at = decision_step(warmup_steps)
            skip = max(SKIP_STEPS, step + 2) if step else SKIP_STEPS
            if decide_at - skip < 5:
                raise ConfigError(
                    f"resumed at step {step}, before the time budget was fixed and too late in "
                    f"warm-up to time the steps again; resume with --train_steps=N"
                )
            self.timer = StepTimer(skip=skip, decide_at=decide_at)

    @property
    def steps(self) -> int:
        """The run's length: the decided one, or until then the cap (for the progress bar)."""
        return self.choice.train_steps if self.choice is not None else self.cap

    @property
    def stop_reason(self) -> str:
        """What ends a run that reached :attr:`steps`: ``train_steps=N``, or the config's cap."""
        if self.choice is not None and self.choice.chosen_by not in ("measured", "train_steps"):
            return self.choice.chosen_by
        return f"train_steps={self.steps}"

    def stop(self, step: int) -> str:
        """Why the run stops before step ``step + 1`` ("" to go on): its length
        (:attr:`stop_reason`) or this invocation's ``stop_at_step``."""
        if step >= self.steps:
            return self.stop_reason
        if self.stop_at_step and step >= self.stop_at_step:
            return f"stop_at_step={self.stop_at_step}"
        return ""

    def early_stop_note(self, step: int, reason: str | None) -> str | None:
        """The line a run says when ``stop_at_step`` ended this invocation before its length."""
        if not (reason and reason.startswith("stop_at_step")):
            return None
        return (f"stopped at step {step} of {self.steps} ({reason}): the learning-rate schedule "
                "has not ended; continue with --resume")

    @property
    def bar_total(self) -> int:
        """The steps this invocation trains to, for a progress bar."""
        return min(self.steps, self.stop_at_step) if self.stop_at_step else self.steps

    @property
    def decided(self) -> bool:
        return self.choice is not None

    @property
    def recorded_steps(self) -> int:
        """What a checkpoint records as the run's length: a measured or given length (a resumed
        run keeps it); 0 for none yet, or for the config's cap, which a resumed run may change
        (``--max_steps`` / ``--epochs``)."""
        if self.choice is None or self.choice.chosen_by not in ("measured", "train_steps"):
            return 0
        return self.choice.train_steps

    def tick(self, step: int) -> None:
        """At the top of every loop iteration, with the steps done so far."""
        if self.timer is not None:
            self.timer.tick(step)

    def due(self, step: int) -> bool:
        """Whether :meth:`decide` must run now (on every rank)."""
        return self.timer is not None and self.choice is None and step == self.timer.decide_at

    def decide(self, *, step: int, elapsed_s: float, reserve_s: Callable[[float], float],
               master: bool, device: torch.device) -> BudgetChoice:
        """Fit the length to the budget on rank 0 from its timed steps; every rank gets it.

        ``reserve_s(seconds_per_step)``: the time to keep for what follows the last step (the
        final checkpoint and evaluation), from the measured speed.
        """
        assert self.timer is not None
        choice = None
        if master:
            per_step = self.timer.seconds_per_step
            assert per_step is not None
            choice = choose_train_steps(
                budget_minutes=self.budget_minutes, seconds_per_step=per_step,
                elapsed_s=elapsed_s, reserve_s=reserve_s(per_step), cap=self.cap, at_least=step,
                timed_steps=(self.timer.skip, self.timer.decide_at), goal_steps=self.goal_steps,
            )
        shared = torch.tensor([choice.train_steps if choice else 0], dtype=torch.int64,
                              device=device)
        with gp.collectives(f"the time budget at step {step}"):
            dist.broadcast(shared, src=0)
        self.choice = choice or BudgetChoice(train_steps=int(shared), chosen_by="measured",
                                             budget_minutes=self.budget_minutes, cap=self.cap,
                                             goal_steps=self.goal_steps)
        return self.choice
