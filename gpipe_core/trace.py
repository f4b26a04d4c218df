"""Timelines of what each stage ran: Chrome-trace JSON (opens in Perfetto) and a PNG picture."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .events import TimelineEvent
from .failure import collectives

__all__ = ["gather_timelines", "write_chrome_trace", "write_timeline_png", "bubble_fraction"]


def gather_timelines(events: Sequence[TimelineEvent], *, group: Any) -> list[TimelineEvent]:
    """Every rank's events of ``group``, merged in rank order. Collective over ``group``."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    local = [(e.stage, e.action, e.start, e.end, e.ready) for e in events]
    with collectives("trace"):
        dist.all_gather_object(gathered, (dist.get_rank(), local), group=group)
    return [TimelineEvent(*e) for _, rank_events in gathered for e in rank_events]


def write_chrome_trace(events: Sequence[TimelineEvent], path: str | Path, *,
                       placement: Sequence[int] | None = None) -> None:
    """One row (thread) per stage, or per rank with ``placement`` (the rank of every stage,
    for virtual stages); each action is a complete event in microseconds."""
    origin = min((e.start for e in events), default=0.0)
    row, names = _rows(events, placement)
    trace = {
        "traceEvents": [
            {
                "name": e.action,
                "cat": _CATEGORY[_kind(e.action)],
                "ph": "X",
                "pid": 0,
                "tid": row(e.stage),
                "ts": (e.start - origin) * 1e6,
                "dur": (e.end - e.start) * 1e6,
            }
            for e in events
        ]
        + [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
            for tid, name in names.items()
        ],
        "displayTimeUnit": "ms",
    }
    Path(path).write_text(json.dumps(trace))


def bubble_fraction(events: Sequence[TimelineEvent], num_stages: int) -> float:
    """Idle share of the stages' (or ranks') time between the first start and the last end;
    ``num_stages``: how many run in parallel."""
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (span * num_stages) if span > 0 else 0.0


def write_timeline_png(events: Sequence[TimelineEvent], path: str | Path, *, num_stages: int,
                       placement: Sequence[int] | None = None) -> None:
    """Draw one row per stage (per rank with ``placement``, for virtual stages: each action
    labelled with its stage), forwards blue, backwards (B or I) orange and weight gradients (W)
    green, so the bubble shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min((e.start for e in events), default=0.0)
    row, names = _rows(events, placement)
    if placement is None:
        names = {s: f"stage {s}" for s in range(num_stages)}
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(names) + 1.2))
    for e in events:
        color = _COLOR[_kind(e.action)]
        ax.broken_barh([((e.start - origin) * 1e3, (e.end - e.start) * 1e3)],
                       (row(e.stage) - 0.4, 0.8), facecolors=color, edgecolor="white",
                       linewidth=0.5)
        width_ms = (e.end - e.start) * 1e3
        label = e.action if placement is not None else e.action[len(str(e.stage)):]
        ax.text((e.start - origin) * 1e3 + width_ms / 2, row(e.stage), label,
                ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(sorted(names))
    ax.set_yticklabels([names[r] for r in sorted(names)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"pipeline timeline (bubble {bubble_fraction(events, len(names)):.0%})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_CATEGORY = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
_COLOR = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}


def _rows(events: Sequence[TimelineEvent], placement: Sequence[int] | None,
          ) -> tuple[Any, dict[int, str]]:
    """Which row an event of a stage goes to, and each row's name."""
    if placement is None:
        return (lambda stage: stage), {s: f"stage {s}" for s in sorted({e.stage for e in events})}
    ranks = sorted(set(placement))
    names = {r: f"rank {r} (stages {', '.join(str(s) for s, p in enumerate(placement) if p == r)})"
             for r in ranks}
    return (lambda stage: placement[stage]), names


def _kind(action: str) -> str:
    """The kind letter of a printed action such as ``"12W3"``."""
    return next(c for c in action if c.isalpha())
