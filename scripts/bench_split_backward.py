"""What the backward split in two costs: I then W against the fused B, on one stage.

``--model mlp|transformer``: a middle stage (its input needs a gradient) of ``--blocks``
pre-norm MLP blocks or ``nn.TransformerEncoderLayer``s, in both re-materialization modes.
``--model nmt_app|amoebanet_app``: both stages of Table 2's CPU models cut in two
(``scripts.reproduction.THROUGHPUT_FAMILIES``: the NMT app's 12 + 12 layers, AmoebaNet-D(12, 24)),
at the micro-batch of M=8 (4 sentence pairs or images); the first stage's input needs no
gradient (its I is empty, its W the whole backward), the second ends in the loss.

Each round runs one forward + B, one forward + I + W, and one forward + I + W with W by an
autograd call at every boundary (what W did before it computed linear and convolution weight
gradients from their saved inputs; the benchmark switches ``split_backward``'s direct path off): round-robin, so that load
drifts touch all alike; one thread. It reports the median seconds of B, I, W and I + W; a
zero-bubble schedule pays I + W - B per micro-batch for moving W off the critical path.
After the timed rounds, ``--op-rounds`` more run under ``torch.profiler``: each kind's aten
operators' own time (``operators``: what the arithmetic costs, and the rest of the wall time,
which is Python and autograd bookkeeping) and its five costliest operators.
Writes the medians with every round's samples to ``--out`` and, with
``scripts.harness.provenance`` (commit, torch, UTC time, machine, load before and after), to
``--json`` (default ``docs/reproduction/split_backward_<model>.json``, the file the pages cite).

    python scripts/bench_split_backward.py [--model mlp|transformer|nmt_app|amoebanet_app
                                            --blocks 4 --width 256 --batch 16 --seq 32
                                            --rounds 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_core import split_backward
from gpipe_core.microbatch import flatten, unflatten
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


@dataclass
class Case:
    """One stage to time: its input (a leaf that needs a gradient unless the first stage's),
    and the gradient of its output (None: the stage ends in its loss, with ``targets``)."""

    name: str
    stage: Stage
    inputs: Any
    grads: list[Tensor | None] | None
    targets: Any = None


def blocks_cases(args: argparse.Namespace) -> list[Case]:
    x = torch.randn(args.batch, args.seq, args.width).requires_grad_(True)
    grad = torch.randn(args.batch, args.seq, args.width)
    return [Case(mode, Stage(build(args.model, args.blocks, args.width), stage_index=1,
                             num_stages=3, first_layer_index=0, device=torch.device("cpu"),
                             checkpoint=mode, seed=0), x, [grad])
            for mode in ("never", "always")]


def app_cases(args: argparse.Namespace) -> list[Case]:
    """The two stages of Table 2's model of the app, cut at the middle layer, checkpoint never."""
    import gpipe_core as gp
    from gpipe_core.partition import split_module
    from scripts.reproduction import THROUGHPUT_FAMILIES

    family, size = THROUGHPUT_FAMILIES[APP_FAMILIES[args.model]]
    model = gp.materialize(family.build(size), seed=0)
    inputs, targets = family.batch(family.batch_size // 8)
    half = len(model) // 2
    first, second = split_module(model, [half, len(model) - half])
    cpu = torch.device("cpu")
    stage0 = Stage(first, stage_index=0, num_stages=2, first_layer_index=0, device=cpu,
                   checkpoint="never", seed=0)
    stage1 = Stage(second, stage_index=1, num_stages=2, first_layer_index=half, device=cpu,
                   checkpoint="never", seed=0, loss_fn=family.loss_fn)
    with torch.no_grad():
        stage0.begin_step(-1, 1)
        middle = stage0.forward(-1, 0, inputs)
    leaves, spec = flatten(middle)
    middle = unflatten([x.detach().requires_grad_(x.is_floating_point()) for x in leaves], spec)
    grads: list[Tensor | None] = [torch.randn_like(x) if x.is_floating_point() else None
                                  for x in leaves]
    return [Case("stage0", stage0, inputs, grads),
            Case("stage1", stage1, middle, None, targets)]


APP_FAMILIES = {"nmt_app": "transformer", "amoebanet_app": "amoebanet"}
KINDS = ("B", "I+W", "I+W autograd")


def measure(case: Case, step: int, kind: str) -> list[float]:
    """Seconds of B, or of I and W, for one micro-batch (after its forward)."""
    stage = case.stage
    stage.begin_step(step, 1)
    stage.forward(step, 0, case.inputs, case.targets)
    grads = case.grads
    # The stage's list of trainable parameters is read once per step, not per micro-batch:
    # read it before the clock starts, as every micro-batch of a step after the first finds it.
    stage._parameters_requiring_grad(step)
    start = time.perf_counter()
    if kind == "B":
        stage.backward(step, 0, grads)
        return [time.perf_counter() - start]
    direct = split_backward._run_directly
    if kind == "I+W autograd":  # every group through autograd, as before weight_grads
        split_backward._run_directly = lambda group, captured: False  # type: ignore[assignment]
    try:
        stage.backward_input(step, 0, grads)
        middle = time.perf_counter()
        stage.backward_weight(step, 0)
    finally:
        split_backward._run_directly = direct  # type: ignore[assignment]
    return [middle - start, time.perf_counter() - middle]


def operator_time(case: Case, rounds: int, step: int) -> dict[str, dict[str, Any]]:
    """Per kind (B, I, W): the seconds its aten operators themselves ran (self CPU time under
    ``torch.profiler``, the median over ``rounds``) and the five costliest operators. What a
    kind's wall time has beyond its operators is the Python and autograd bookkeeping around
    them (the split's graph analysis in I, W's per-node calls)."""
    from torch.profiler import ProfilerActivity, profile

    totals: dict[str, list[float]] = {"B": [], "I": [], "W": []}
    per_op: dict[str, dict[str, list[float]]] = {kind: {} for kind in totals}

    def record(kind: str, prof: Any) -> None:
        ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()
               if e.key.startswith("aten::")}
        totals[kind].append(sum(ops.values()))
        for name, seconds in ops.items():
            per_op[kind].setdefault(name, []).append(seconds)

    stage = case.stage
    for r in range(rounds):
        for kind in ("B", "I"):
            stage.begin_step(step + r, 1)
            stage.forward(step + r, 0, case.inputs, case.targets)
            stage._parameters_requiring_grad(step + r)  # once per step (see measure)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                if kind == "B":
                    stage.backward(step + r, 0, case.grads)
                else:
                    stage.backward_input(step + r, 0, case.grads)
            record(kind, prof)
            if kind == "I":
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    stage.backward_weight(step + r, 0)
                record("W", prof)
    result = {}
    for kind, values in totals.items():
        medians = {name: statistics.median(v + [0.0] * (rounds - len(v)))
                   for name, v in per_op[kind].items()}
        top = sorted(medians.items(), key=lambda item: -item[1])[:5]
        result[kind] = {"aten_s": statistics.median(values), "top_aten_s": dict(top)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "transformer", *APP_FAMILIES], default="mlp")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--op-rounds", type=int, default=5,
                        help="rounds under torch.profiler for the operators' own time (0: none)")
    parser.add_argument("--out", default="out/bench_split_backward")
    parser.add_argument("--json", default=None,
                        help="the result with its provenance, where the pages cite it "
                             "(default docs/reproduction/split_backward_<model>.json)")
    args = parser.parse_args()
    if args.json is None:
        args.json = f"docs/reproduction/split_backward_{args.model}.json"
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    cases = app_cases(args) if args.model in APP_FAMILIES else blocks_cases(args)
    samples: dict[tuple[str, str], list[list[float]]] = {
        (case.name, kind): [] for case in cases for kind in KINDS
    }
    for round_ in range(args.rounds + 2):  # two warm rounds
        for case in cases:
            for kind in KINDS:
                seconds = measure(case, round_, kind)
                if round_ >= 2:
                    samples[(case.name, kind)].append(seconds)
    print(f"{args.model}: median of {args.rounds} rounds, 1 thread (ms); W autograd: an "
          "autograd call at every boundary")
    print(f"{'stage':<9}{'B':>8}{'I':>8}{'W':>8}{'I+W':>8}{'(I+W)/B':>9}"
          f"{'W autograd':>12}{'(I+W)/B':>9}")
    report = []
    for case in cases:
        fused = [r[0] for r in samples[(case.name, "B")]]
        split, engine = samples[(case.name, "I+W")], samples[(case.name, "I+W autograd")]
        b = statistics.median(fused)
        i = statistics.median(r[0] for r in split)
        w = statistics.median(r[1] for r in split)
        both = statistics.median(r[0] + r[1] for r in split)
        w_engine = statistics.median(r[1] for r in engine)
        both_engine = statistics.median(r[0] + r[1] for r in engine)
        print(f"{case.name:<9}{b * 1e3:>8.2f}{i * 1e3:>8.2f}{w * 1e3:>8.2f}{both * 1e3:>8.2f}"
              f"{both / b:>9.2f}{w_engine * 1e3:>12.2f}{both_engine / b:>9.2f}")
        row: dict[str, Any] = {
            "checkpoint" if args.model not in APP_FAMILIES else "stage": case.name,
            "B": b, "I": i, "W": w, "I+W": both,
            "W_autograd": w_engine, "I+W_autograd": both_engine,
            "W_rounds_won_by_direct": sum(a[1] < e[1] for a, e in zip(split, engine, strict=True)),
            "samples": {"B": fused, "I": [r[0] for r in split], "W": [r[1] for r in split],
                        "I_autograd": [r[0] for r in engine],
                        "W_autograd": [r[1] for r in engine]}}
        if args.op_rounds > 0:  # after the timed rounds, so that profiling never touches them
            ops = operator_time(case, args.op_rounds, 10_000)
            walls = {"B": b, "I": i, "W": w}
            for kind, entry in ops.items():
                entry["wall_minus_aten_s"] = walls[kind] - entry["aten_s"]
            row["operators"] = ops
            print(f"{'':<9}aten operators alone: B {ops['B']['aten_s'] * 1e3:.2f}, "
                  f"I {ops['I']['aten_s'] * 1e3:.2f}, W {ops['W']['aten_s'] * 1e3:.2f} ms; "
                  f"(I+W)/B of the operators "
                  f"{(ops['I']['aten_s'] + ops['W']['aten_s']) / ops['B']['aten_s']:.2f}")
        report.append(row)
    result = {"provenance": provenance(load_before), "config": vars(args), "rows": report}
    out = Path(args.out)
    write_json(out / f"{args.model}.json", result)
    write_json(args.json, result)
    print(f"wrote {out / f'{args.model}.json'} and {args.json}")


if __name__ == "__main__":
    main()
