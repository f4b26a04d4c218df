"""Guards of a training loop: a diverged loss stops the run, a signal stops it at a checkpoint."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any


class DivergenceError(FloatingPointError):
    """The training loss is not finite, or beyond the divergence bound; the message says the fix."""


def check_loss(loss: float, *, step: int, num_classes: int, factor: float, fix: str) -> None:
    """Stop a run whose loss diverged (the rule both apps document).

    A loss that is NaN or infinite, or larger than ``factor * ln(num_classes)``: ``ln(C)`` is the
    cross-entropy of a uniform guess over C classes (the loss of an untrained model), so a loss
    ``factor`` (1000 by default) times larger means the weights have blown up, although the
    number is still finite. ``factor=0`` keeps only the non-finite rule.
    """
    if not math.isfinite(loss):
        raise DivergenceError(f"loss is {loss} at step {step}; {fix}")
    bound = factor * math.log(max(num_classes, 2))
    if factor and loss > bound:
        raise DivergenceError(
            f"loss {loss:.4g} at step {step} exceeds max_loss_factor={factor:g} x "
            f"ln({num_classes}) = {bound:.4g} (a uniform guess's loss): the run diverged; {fix} "
            "(max_loss_factor=0 turns this rule off)"
        )


class Interrupt:
    """SIGINT / SIGTERM set a flag instead of killing the process, so the training loop can agree
    with the other ranks on a step, checkpoint it and exit cleanly (``signal_name`` says which).

    torchrun forwards SIGTERM to its workers and kills them 30 s later: the checkpoint must fit.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.reason = "a signal on another rank"  # what stopped the run, said by rank 0
        self.parent = os.getppid()
        self.previous = {sig: signal.signal(sig, self._handle)
                         for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.reason = self.signal_name
            if os.getppid() != self.parent:  # gp.init_process_groups' watch of torchrun
                self.reason = f"{self.signal_name}: this rank's torchrun agent died (lost node?)"

    def stop(self, *, step: int, checkpoint: Path, master: bool) -> Interrupted:
        """The exception to raise once the checkpoint of ``step`` is on disk; rank 0 (and a rank
        whose agent died) says why it stopped and how to continue."""
        message = ""
        if master or os.getppid() != self.parent:
            message = (f"interrupted ({self.reason}) at step {step}: checkpoint {checkpoint}; "
                       "continue with --resume")
        return Interrupted(self.signal_name or "SIGTERM", message)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Interrupted(Exception):
    """Raised after the checkpoint of an interrupted run is on disk (exit status 128 + signal)."""

    def __init__(self, signal_name: str, message: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + int(signal.Signals[signal_name])
