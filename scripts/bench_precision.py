"""What bf16 autocast buys on this CPU: fp32 against bf16, side by side, in paired rounds.

Three levels, each timed round-robin (fp32 and bf16 alternate, the order swapping every round,
so that a drift in machine load touches both alike), on one thread per process:

1. ``matmul``: a 1024 x 1024 matrix product, GFLOP/s (what the hardware gives: AVX512-BF16 or
   AMX run bf16 products natively; without them bf16 is emulated and slower than fp32).
2. ``encoder_layer``: ``nn.TransformerEncoderLayer(128, 2, 512)`` forward + backward on 64 x 32
   tokens, fp32 against bf16 autocast.
3. The apps' default models (``scripts.reproduction.APP_FAMILIES``: what ``make train-nmt`` and
   ``make train-amoebanet`` build, with their configs' chunks, schedule, re-materialization and
   balance by parameters) through ``DistributedGPipe`` on 2 gloo ranks, one core each, one
   training step (forward, backward, Adam/RMSprop update) with ``precision="fp32"`` and one with
   ``precision="bf16"`` per round; seconds on the slowest rank.

Each row reports both medians, their ratio (fp32 / bf16: above 1, bf16 is faster) and in how
many paired rounds bf16 won. Writes every round's samples with ``scripts.harness.provenance``
(commit, torch, time, CPU model and its bf16 flags, load) to ``--json`` (default
``docs/reproduction/precision.json``).

    python scripts/bench_precision.py [--rounds 15 --app-rounds 8 --apps nmt_app amoebanet_app]

``--quality FP32_RUN BF16_RUN`` instead compares two finished training runs of one app at the
same steps (their ``summary.json``: dev loss and BLEU per bucket, or top-1; tokens or images per
second) and writes ``docs/reproduction/precision_quality.json`` (``--json`` to change):

    make train-nmt ARGS="--train_steps=400 --precision=fp32 --out_dir=runs/q_fp32"
    make train-nmt ARGS="--train_steps=400 --precision=bf16 --out_dir=runs/q_bf16"
    python scripts/bench_precision.py --quality runs/q_fp32 runs/q_bf16
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gpipe_core as gp
from gpipe_core.launch import spawn
from scripts.harness import (
    add_draft_argument,
    provenance,
    refuse_dirty_tree,
    set_draft,
    setup_process,
    timed_step,
    write_json,
)

PRECISIONS = ("fp32", "bf16")


def paired(step: dict[str, Callable[[], float]], rounds: int, warmup: int = 2
           ) -> dict[str, Any]:
    """Time ``step[p]()`` (seconds it returns) for both precisions, alternating the order."""
    samples: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for round_ in range(warmup + rounds):
        order = PRECISIONS if round_ % 2 == 0 else PRECISIONS[::-1]
        for precision in order:
            seconds = step[precision]()
            if round_ >= warmup:
                samples[precision].append(seconds)
    fp32, bf16 = (statistics.median(samples[p]) for p in PRECISIONS)
    wins = sum(b < f for f, b in zip(samples["fp32"], samples["bf16"], strict=True))
    return {"fp32_seconds": fp32, "bf16_seconds": bf16, "speedup": fp32 / bf16,
            "bf16_wins": wins, "rounds": rounds, "samples": samples}


def clock(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def autocast(precision: str) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def matmul_row(rounds: int) -> dict[str, Any]:
    n, repeat = 1024, 8
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    operands = {"fp32": (a32, b32), "bf16": (a32.bfloat16(), b32.bfloat16())}

    def step(precision: str) -> float:
        a, b = operands[precision]
        return clock(lambda: [torch.mm(a, b) for _ in range(repeat)]) / repeat

    row = paired({p: functools.partial(step, p) for p in PRECISIONS}, rounds)
    row["what"] = f"torch.mm {n}x{n}, one thread"
    row["gflops"] = {p: 2 * n**3 / row[f"{p}_seconds"] / 1e9 for p in PRECISIONS}
    return row


def encoder_row(rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 2, 512, dropout=0.0, batch_first=True)
    x = torch.randn(64, 32, 128)

    def step(precision: str) -> float:
        def run() -> None:
            with autocast(precision):
                out = layer(x)
            out.float().square().mean().backward()
        return clock(run)

    row = paired({p: functools.partial(step, p) for p in PRECISIONS}, rounds)
    row["what"] = "nn.TransformerEncoderLayer(128, 2, 512) forward+backward, 64x32 tokens"
    return row


def app_worker(rank: int, world_size: int, apps: list[str], rounds: int) -> str | None:
    from scripts.reproduction import APP_FAMILIES

    rows = []
    for name in apps:
        family, size = APP_FAMILIES[name]
        config = (_nmt_config() if name == "nmt_app" else _amoeba_config())
        inputs, targets = family.batch(family.batch_size)
        steps: dict[str, Callable[[], float]] = {}
        for precision in PRECISIONS:
            model = family.build(size)
            balance = gp.balance_by_params(model, world_size)
            pipe = gp.DistributedGPipe(model, balance, chunks=config.chunks,
                                       checkpoint=config.checkpoint, schedule=config.schedule,
                                       loss_fn=family.loss_fn, seed=0, precision=precision)
            optimizer = family.optimizer(list(pipe.parameters()))

            steps[precision] = functools.partial(
                timed_step, functools.partial(_train_step, pipe, optimizer, inputs, targets))
        row = paired(steps, rounds)
        row.update(what=f"{name}: DistributedGPipe K=2, M={config.chunks}, "
                        f"{config.schedule}, checkpoint={config.checkpoint}, batch "
                        f"{family.batch_size}, one training step with the optimizer",
                   app=name, balance=balance)
        rows.append(row)
    return json.dumps(rows) if rank == 0 else None


def _train_step(pipe: gp.DistributedGPipe, optimizer: torch.optim.Optimizer, inputs: Any,
                targets: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
    pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None)
    optimizer.step()


def _nmt_config() -> Any:
    from scripts.reproduction import _app_nmt_config

    return _app_nmt_config()


def _amoeba_config() -> Any:
    from scripts.reproduction import _app_amoeba_config

    return _app_amoeba_config()


QUALITY_KEYS = ("steps", "tokens", "dev_loss", "dev", "top1", "top5", "tokens_per_second",
                "images_per_second", "train_minutes")


def quality(fp32_run: Path, bf16_run: Path) -> dict[str, Any]:
    """Two runs' summaries side by side; refuses runs of different lengths or settings other
    than the precision."""
    import yaml

    summaries, configs = {}, {}
    for precision, run in (("fp32", fp32_run), ("bf16", bf16_run)):
        summary = json.loads((run / "summary.json").read_text())
        summaries[precision] = {k: summary[k] for k in QUALITY_KEYS if k in summary}
        configs[precision] = yaml.safe_load((run / "config.yaml").read_text())
        if configs[precision].get("precision") != precision:
            raise SystemExit(f"{run} trained with precision={configs[precision].get('precision')}"
                             f", not {precision}")
    differ = sorted(k for k in configs["fp32"] if k not in ("precision", "out_dir")
                    and configs["fp32"][k] != configs["bf16"].get(k))
    if differ or summaries["fp32"]["steps"] != summaries["bf16"]["steps"]:
        raise SystemExit(f"the runs differ in more than their precision: {differ} (steps "
                         f"{summaries['fp32']['steps']} and {summaries['bf16']['steps']})")
    return {"runs": {"fp32": str(fp32_run), "bf16": str(bf16_run)}, "summaries": summaries,
            "config": configs["fp32"] | {"precision": None}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds per micro row")
    parser.add_argument("--app-rounds", type=int, default=8, help="paired rounds per app")
    parser.add_argument("--apps", nargs="*", default=["nmt_app", "amoebanet_app"])
    parser.add_argument("--json", default=None, help="default: docs/reproduction/precision.json "
                        "(precision_quality.json with --quality)")
    parser.add_argument("--quality", nargs=2, type=Path, metavar=("FP32_RUN", "BF16_RUN"))
    add_draft_argument(parser)
    args = parser.parse_args()
    args.json = args.json or ("docs/reproduction/precision_quality.json" if args.quality
                              else "docs/reproduction/precision.json")
    if args.quality:
        set_draft(args.draft)
        report = {"provenance": provenance(), **quality(*args.quality)}
        write_json(args.json, report)
        print(json.dumps(report["summaries"], indent=1))
        return
    if args.rounds < 1 or args.app_rounds < 1:
        parser.error(f"--rounds {args.rounds} and --app-rounds {args.app_rounds} must be >= 1")
    set_draft(args.draft)
    refuse_dirty_tree(args.json)  # before measuring, not after
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    rows = [matmul_row(args.rounds), encoder_row(args.rounds)]
    if args.apps:
        rows += json.loads(spawn(app_worker, 2, None, args.apps, args.app_rounds,
                                 setup=setup_process, pg_timeout_s=300, timeout_s=None)[0])
    report = {"provenance": provenance(load_before), "config": vars(args), "rows": rows}
    write_json(args.json, report)
    record = report["provenance"]
    print(f"{record['cpu_model']} ({', '.join(record['cpu_flags'])}), torch {record['torch']}, "
          f"load {record['load_average_before']} -> {record['load_average_after']}")
    for row in rows:
        print(f"{row['what']}\n    fp32 {row['fp32_seconds'] * 1e3:9.2f} ms   bf16 "
              f"{row['bf16_seconds'] * 1e3:9.2f} ms   fp32/bf16 {row['speedup']:.2f}   "
              f"bf16 faster in {row['bf16_wins']}/{row['rounds']} rounds")


if __name__ == "__main__":
    main()
