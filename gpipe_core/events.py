"""The record of one action as it ran: the timeline that the runtime writes, the simulator
predicts and the trace draws (pure data: nothing here knows torch.distributed)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TimelineEvent"]


@dataclass
class TimelineEvent:
    """One action as it ran: which stage, what, and when (``time.perf_counter`` seconds)."""

    stage: int
    action: str
    start: float
    end: float
    # When the action's input (activation or gradient) had arrived and its computation began:
    # ``ready - start`` is time spent waiting on a neighbour, ``end - ready`` the action's own
    # cost (what the simulator takes as an action's duration). None where not recorded.
    ready: float | None = None
