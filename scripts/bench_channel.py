"""Step times before and after issue 41.1 (every point-to-point message through one Channel):
the same steps on the code of two commits, in paired rounds.

Three workloads, each through ``DistributedGPipe`` on 2 gloo ranks, one core each
(``scripts.harness.setup_process``), one training step (forward, backward, optimizer) timed on
the slowest rank (``scripts.harness.timed_step``):

1. ``encoder``: the held-out encoder stack of ``scripts.reproduction`` (8
   ``nn.TransformerEncoderLayer``, d=192, 4 heads, FFN 768, and a linear head; batch 32 x 48
   tokens), M=4, 1F1B;
2. ``nmt_app`` and 3. ``amoebanet_app``: the apps' CPU configs (``scripts.reproduction
   .APP_FAMILIES``: their models, batch, chunks, schedule, re-materialization; balance by
   parameters), as ``scripts/bench_precision.py`` runs them.

The code before is a ``git worktree`` of ``--before`` (default: the commit that recorded the
wire, before the change); the code after is this tree. Each side runs as its own job (a
process with ``PYTHONPATH`` set to its tree, which spawns the 2 ranks; the job records which
``gpipe_core`` it imported): per workload, ``--warmup`` steps, then ``--steps`` timed steps, of
which the job reports the median. A round is one job of each side, the order alternating
round by round, so that a drift in the machine's load touches both alike. Per workload: each
side's median over the rounds, the median of the rounds' after/before ratios, and in how many
rounds the code after was faster. Writes every sample with ``scripts.harness.provenance``
(commit, torch, time, CPU, load before and after) to ``--json`` (default
``docs/reproduction/channel_refactor.json``).

    python scripts/bench_channel.py [--rounds 5 --steps 5 --warmup 2 --before 8962f5b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKLOADS = ("encoder", "nmt_app", "amoebanet_app")
SIDES = ("before", "after")
BEFORE = "8962f5b"  # the wire's reference recorded; transport, channel, tied as before 41.1


# --- one job: the steps of every workload on one tree's code ---------------------------------


def rank_worker(rank: int, world_size: int, warmup: int, steps: int) -> dict[str, Any] | None:
    import functools

    import torch

    import gpipe_core as gp
    from scripts.harness import timed_step
    from scripts.reproduction import (
        APP_FAMILIES,
        ENCODER,
        _app_amoeba_config,
        _app_nmt_config,
    )

    result: dict[str, Any] = {"gpipe_core": gp.__file__}
    for name in WORKLOADS:
        if name == "encoder":
            family, size = ENCODER, ENCODER.ladder[0]
            chunks, checkpoint, schedule = 4, "never", "1f1b"
        else:
            family, size = APP_FAMILIES[name]
            config = _app_nmt_config() if name == "nmt_app" else _app_amoeba_config()
            chunks, checkpoint, schedule = config.chunks, config.checkpoint, config.schedule
        torch.manual_seed(0)
        model = family.build(size)
        balance = gp.balance_by_params(model, world_size)
        pipe = gp.DistributedGPipe(model, balance, chunks=chunks, checkpoint=checkpoint,
                                   schedule=schedule, loss_fn=family.loss_fn, seed=0)
        optimizer = family.optimizer(list(pipe.parameters()))
        inputs, targets = family.batch(family.batch_size)

        def step(pipe: Any = pipe, optimizer: Any = optimizer, inputs: Any = inputs,
                 targets: Any = targets) -> None:
            optimizer.zero_grad(set_to_none=True)
            pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None)
            optimizer.step()

        seconds = [timed_step(functools.partial(step)) for _ in range(warmup + steps)][warmup:]
        result[name] = {"median_seconds": statistics.median(seconds), "seconds": seconds,
                        "balance": list(balance), "chunks": chunks, "schedule": schedule,
                        "checkpoint": checkpoint, "batch": family.batch_size}
        del pipe, optimizer
    return result if rank == 0 else None


def job(warmup: int, steps: int, out: Path) -> None:
    from gpipe_core.launch import spawn
    from scripts.harness import setup_process

    result = spawn(rank_worker, 2, None, warmup, steps, setup=setup_process, pg_timeout_s=300,
                   timeout_s=None)[0]
    out.write_text(json.dumps(result))


def run_job(tree: Path, warmup: int, steps: int) -> dict[str, Any]:
    """One job on ``tree``'s code (its gpipe_core and scripts come first on the path)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--job", str(out),
                        "--warmup", str(warmup), "--steps", str(steps)], cwd=tree, env=env,
                       check=True)
        result: dict[str, Any] = json.loads(out.read_text())
    if not result["gpipe_core"].startswith(str(tree)):
        raise RuntimeError(f"the job for {tree} imported {result['gpipe_core']}")
    return result


# --- the paired rounds -----------------------------------------------------------------------


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {}
    for name in WORKLOADS:
        before = [r["before"][name]["median_seconds"] for r in rounds]
        after = [r["after"][name]["median_seconds"] for r in rounds]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        rows[name] = {"before_seconds": statistics.median(before),
                      "after_seconds": statistics.median(after),
                      "median_ratio_after_over_before": statistics.median(ratios),
                      "after_faster_rounds": sum(a < b for a, b in zip(after, before,
                                                                        strict=True)),
                      "rounds": len(rounds), "ratios": ratios,
                      "setup": {k: rounds[0]["after"][name][k] for k in
                                ("balance", "chunks", "schedule", "checkpoint", "batch")}}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds (jobs per side)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per workload and job")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--before", default=BEFORE, help="the commit of the code before")
    parser.add_argument("--json", default="docs/reproduction/channel_refactor.json")
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)  # one side's job (internal)
    from scripts.harness import add_draft_argument
    add_draft_argument(parser)
    args = parser.parse_args()
    if args.job is not None:
        job(args.warmup, args.steps, args.job)
        return
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"--rounds {args.rounds} and --steps {args.steps} must be >= 1, --warmup "
                     f"{args.warmup} >= 0")
    from scripts.harness import ROOT, provenance, refuse_dirty_tree, set_draft, write_json

    set_draft(args.draft)
    refuse_dirty_tree(args.json)  # before measuring, not after
    before_commit = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout.strip()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        old_tree = Path(folder) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), before_commit],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            trees = {"before": old_tree, "after": ROOT}
            rounds = []
            for index in range(args.rounds):
                order = SIDES if index % 2 == 0 else SIDES[::-1]
                record = {side: run_job(trees[side], args.warmup, args.steps) for side in order}
                record["order"] = list(order)
                rounds.append(record)
                print(f"round {index + 1}: " + ", ".join(
                    f"{name} {record['after'][name]['median_seconds'] / record['before'][name]['median_seconds']:.3f}"
                    for name in WORKLOADS), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT,
                           check=False, capture_output=True)
    rows = summarize(rounds)
    report = {
        "what": "training-step seconds (slowest of 2 gloo ranks, one core each) of the code "
                "before issue 41.1 (transport, channel and tied weights each with their own "
                "point-to-point code) and after (one Channel under all three); paired rounds, "
                "one job per side per round, the order alternating",
        "before_commit": before_commit,
        "config": {k: v for k, v in vars(args).items() if k != "job"},
        "rows": rows,
        "shared_machine": "the 2 CPU cores were shared with other jobs while this ran; see "
                          "the load averages in provenance",
        "rounds": rounds,
        "provenance": provenance(load_before),
    }
    path = write_json(args.json, report)
    for name, row in rows.items():
        print(f"{name:14s} before {row['before_seconds'] * 1e3:8.1f} ms   after "
              f"{row['after_seconds'] * 1e3:8.1f} ms   after/before "
              f"{row['median_ratio_after_over_before']:.3f}   after faster in "
              f"{row['after_faster_rounds']}/{row['rounds']} rounds")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
