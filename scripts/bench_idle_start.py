"""Does an action cost more when its core has just sat idle, as a pipeline rank's does after
waiting for a neighbour? (issue 22: the replay times actions back to back, the pipeline after
waits.)

One process, one thread, pinned to one core: a stage of 4 ``nn.TransformerEncoderLayer``
(d=192, 4 heads, FFN 768; the held-out encoder family of ``validate_simulator.py``) on one
micro-batch of 4 x 48 tokens (M = 8 of its batch of 32), forward then backward. Before each
timed action, one of: nothing (back to back), a 20 ms or 200 ms sleep (the core idle, as in a
blocking receive), a 200 ms busy loop (the core busy with other work). The conditions take
turns within every round, so drift touches all alike; medians over the rounds, as ratios to
back to back.

    python scripts/bench_idle_start.py [--rounds 30] [--core 0 (-1: not pinned)]
        [--out docs/reproduction/idle_start.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scripts.harness import provenance, write_json

ROOT = Path(__file__).resolve().parents[1]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


CONDITIONS: dict[str, Callable[[], None]] = {
    "back_to_back": lambda: None,
    "sleep_20ms": lambda: time.sleep(0.02),
    "sleep_200ms": lambda: time.sleep(0.2),
    "busy_200ms": lambda: _spin(0.2),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--core", type=int, default=0, help="the core to pin to; -1: no pinning")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "docs" / "reproduction" / "idle_start.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    if args.core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.TransformerEncoderLayer(192, 4, 768, dropout=0.0,
                                                       batch_first=True)
                            for _ in range(args.layers)])
    x = torch.randn(4, 48, 192, requires_grad=True)
    grad = torch.randn(4, 48, 192)

    def action() -> tuple[float, float]:
        start = time.perf_counter()
        y = stage(x)
        middle = time.perf_counter()
        y.backward(grad)
        return middle - start, time.perf_counter() - middle

    for _ in range(args.warmup):
        action()
    samples: dict[str, dict[str, list[float]]] = {
        name: {"forward": [], "backward": []} for name in CONDITIONS}
    for _ in range(args.rounds):
        for name, before in CONDITIONS.items():
            before()
            forward, backward = action()
            samples[name]["forward"].append(forward)
            samples[name]["backward"].append(backward)
    base = {kind: statistics.median(samples["back_to_back"][kind])
            for kind in ("forward", "backward")}
    rows = []
    for name, by_kind in samples.items():
        row: dict[str, Any] = {"condition": name}
        for kind, values in by_kind.items():
            row[f"{kind}_s"] = statistics.median(values)
            row[f"{kind}_over_back_to_back"] = statistics.median(values) / base[kind]
        rows.append(row)
        print(f"{name:13s} forward {row['forward_s'] * 1e3:7.2f} ms "
              f"({row['forward_over_back_to_back']:.2f}x)  backward "
              f"{row['backward_s'] * 1e3:7.2f} ms ({row['backward_over_back_to_back']:.2f}x)")
    report = {"provenance": provenance(load_before), "config": vars(args), "rows": rows,
              "samples": samples,
              "command": "python scripts/bench_idle_start.py " + " ".join(argv or [])}
    print(f"wrote {write_json(args.out, report)}")
    return report


if __name__ == "__main__":
    main()
