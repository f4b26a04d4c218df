"""What the backward split in two costs: I then W against the fused B, on one stage.

A middle stage (its input needs a gradient) of ``--blocks`` pre-norm MLP blocks or Transformer
encoder layers, one micro-batch, one thread. Each round runs one forward + B, and one forward +
I + W, per re-materialization mode (round-robin, so that load drifts touch all alike), and
reports the median seconds of B, I, W and I + W. Zero-bubble schedules pay I + W - B extra per
micro-batch for moving W off the critical path. Writes the medians with every round's samples to
``--out`` and, with ``scripts.harness.provenance`` (commit, torch, UTC time, machine, load
before and after), to ``--json`` (default ``docs/reproduction/split_backward_<model>.json``,
the file the pages cite).

    python scripts/bench_split_backward.py [--model mlp|transformer --blocks 4 --width 256
                                            --batch 16 --seq 32 --rounds 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from gpipe_core.stage import Stage
from scripts.bench_pipeline import Block  # pre-norm residual MLP block
from scripts.harness import provenance, write_json


def build(model: str, blocks: int, width: int) -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    if model == "mlp":
        return [(str(i), Block(width)) for i in range(blocks)]
    return [(str(i), nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width,
                                                dropout=0.0, batch_first=True))
            for i in range(blocks)]


def measure(stage: Stage, x: Tensor, grad: Tensor, step: int, split: bool) -> list[float]:
    """Seconds of B, or of I and W, for one micro-batch (after its forward)."""
    stage.begin_step(step, 1)
    stage.forward(step, 0, x)
    start = time.perf_counter()
    if not split:
        stage.backward(step, 0, [grad])
        return [time.perf_counter() - start]
    stage.backward_input(step, 0, [grad])
    middle = time.perf_counter()
    stage.backward_weight(step, 0)
    return [middle - start, time.perf_counter() - middle]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="out/bench_split_backward")
    parser.add_argument("--json", default=None,
                        help="the result with its provenance, where the pages cite it "
                             "(default docs/reproduction/split_backward_<model>.json)")
    args = parser.parse_args()
    if args.json is None:
        args.json = f"docs/reproduction/split_backward_{args.model}.json"
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    stages = {
        mode: Stage(build(args.model, args.blocks, args.width), stage_index=1, num_stages=3,
                    first_layer_index=0, device=torch.device("cpu"), checkpoint=mode, seed=0)
        for mode in ("never", "always")
    }
    x = torch.randn(args.batch, args.seq, args.width).requires_grad_(True)
    grad = torch.randn(args.batch, args.seq, args.width)
    samples: dict[tuple[str, str], list[list[float]]] = {
        (mode, kind): [] for mode in stages for kind in ("B", "I+W")
    }
    for round_ in range(args.rounds + 2):  # two warm rounds
        for (mode, kind), rows in samples.items():
            seconds = measure(stages[mode], x, grad, round_, split=kind == "I+W")
            if round_ >= 2:
                rows.append(seconds)
    print(f"{args.model}: {args.blocks} blocks, width {args.width}, micro-batch "
          f"{args.batch}x{args.seq}, 1 thread, median of {args.rounds} rounds (ms)")
    print(f"{'checkpoint':<11}{'B':>8}{'I':>8}{'W':>8}{'I+W':>8}{'(I+W)/B':>9}")
    report = []
    for mode in stages:
        b = statistics.median(r[0] for r in samples[(mode, "B")])
        i = statistics.median(r[0] for r in samples[(mode, "I+W")])
        w = statistics.median(r[1] for r in samples[(mode, "I+W")])
        both = statistics.median(r[0] + r[1] for r in samples[(mode, "I+W")])
        print(f"{mode:<11}{b * 1e3:>8.2f}{i * 1e3:>8.2f}{w * 1e3:>8.2f}{both * 1e3:>8.2f}"
              f"{both / b:>9.2f}")
        report.append({"checkpoint": mode, "B": b, "I": i, "W": w, "I+W": both,
                       "samples": {"B": [r[0] for r in samples[(mode, "B")]],
                                   "I": [r[0] for r in samples[(mode, "I+W")]],
                                   "W": [r[1] for r in samples[(mode, "I+W")]]}})
    result = {"provenance": provenance(load_before), "config": vars(args), "rows": report}
    out = Path(args.out)
    write_json(out / f"{args.model}.json", result)
    write_json(args.json, result)
    print(f"wrote {out / f'{args.model}.json'} and {args.json}")


if __name__ == "__main__":
    main()
