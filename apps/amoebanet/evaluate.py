"""The command that scores an AmoebaNet checkpoint (``make eval-amoebanet``): top-1 / top-5,
loss and the confusion matrix::

    python -m apps.amoebanet.evaluate --ckpt runs/amoebanet --split test [--out PATH]
        [--threads 2] [--device cpu|cuda] [--key=value ...]

``--ckpt`` is a run's out_dir (its ``latest`` checkpoint) or a ``step-NNNNNNN`` folder. The
config saved with the checkpoint is loaded, ``--key=value`` overrides it (e.g.
``--data_dir=...``, ``--eval_batch_size=512``; unknown keys are an error), the model shards are
merged into the plain ``nn.Sequential`` in one process, and every image of the split is scored
once with the eval transforms. Writes ``<out>.json`` (top-1, top-5, loss, per-class top-1,
confusion matrix) and ``<out>.png`` (the confusion matrix with class names); default
``<ckpt>/eval_<split>``.

Under torchrun the same command evaluates through the pipeline instead, and no rank holds the
whole model::

    torchrun --nproc-per-node 2 -m apps.amoebanet.evaluate --ckpt runs/amoebanet [--stages 2]

``--stages`` K pipeline stages (default: every rank, one pipeline; a world of R x K ranks is R
data-parallel replicas, each reading its share of the split's shards). Each rank builds its
stage on the ``meta`` device with ``DistributedGPipe.from_checkpoint`` and loads only its part
of the checkpoint (the stage split recorded in its index.json, its stages joined when K divides
their number, so that each rank reads only the shards holding its layers; else the layers are
split by parameters); the images go through ``DistributedGPipe.evaluate``
(forward only, BatchNorm in eval mode, ``chunks`` micro-batches) and the counts are summed
over the world. Top-1, top-5 and the confusion matrix equal the one-process numbers exactly;
the loss agrees to rounding (micro-batches change the order of floating-point sums). Rank 0
writes the report; a report that cannot be written is one ``error:`` line naming the file and
the free space (``apps.report_writes``), exit status 1.

The work is in the modules below: ``apps.amoebanet.checkpoint_loading`` (the checkpoint and its
config; its weights, or this rank's stage) and ``apps.amoebanet.scoring`` (the metrics, through
the pipeline as in training, and the report's JSON and PNG).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import gpipe_core as gp
from apps.amoebanet.checkpoint_loading import find_checkpoint, load_model, load_pipeline
from apps.amoebanet.data import DatasetNotFoundError, build_eval_loader, class_names
from apps.amoebanet.scoring import (
    ClassificationMetrics,
    evaluate_pipeline,
    plot_report,
    write_json,
)
from apps.config import ConfigError
from apps.harness.checkpoints import CheckpointError, unpin
from apps.harness.run import end_run
from apps.report_writes import ReportWriteError, report_write
from apps.validation import CommandParser, at_least, device_name, say_once, threads

__all__ = ["default_out", "evaluate_checkpoint", "evaluate_pipelined", "main",
           "write_report_files"]


def default_out(ckpt: str | Path, checkpoint: Path, split: str) -> Path:
    """``eval_<split>`` beside the run's own files when given its out_dir, else in the step
    folder."""
    return (Path(ckpt) if (Path(ckpt) / "latest").is_file() else checkpoint) / f"eval_{split}"


def write_report_files(report: dict[str, Any], out: str | Path) -> None:
    """``<out>.json`` and ``<out>.png``; a write that fails is a ReportWriteError naming it."""
    out = Path(out)
    for path, write in ((out.with_suffix(".json"), write_json),
                        (out.with_suffix(".png"), plot_report)):
        with report_write(path):
            write(report, path)


@torch.no_grad()
def evaluate_checkpoint(
    ckpt: str | Path,
    *,
    split: str = "test",
    overrides: Sequence[str] = (),
    out: str | Path | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Score the checkpoint under ``ckpt`` on ``split``; write ``<out>.json`` and ``<out>.png``.

    Raises CheckpointError (no checkpoint: says how to train one; another app's checkpoint),
    gp.CheckpointCorruptError (a file does not match index.json), DatasetNotFoundError (says
    which command builds the data) or ConfigError (an unknown or invalid ``--key=value``).
    """
    checkpoint, config = find_checkpoint(ckpt, split, overrides)
    model = load_model(config, checkpoint, torch.device(device))
    unpin(checkpoint)  # in memory now: a running trainer may rotate it away
    metrics = ClassificationMetrics(config.num_classes)
    for images, labels in build_eval_loader(config, split):
        metrics.update(model(images.to(device)), labels)
    report = metrics.report(class_names(config), split=split)
    report["checkpoint"] = str(checkpoint)
    write_report_files(report, default_out(ckpt, checkpoint, split) if out is None else out)
    return report


def evaluate_pipelined(
    ckpt: str | Path,
    *,
    split: str = "test",
    overrides: Sequence[str] = (),
    out: str | Path | None = None,
    device: str = "cpu",
    num_stages: int | None = None,
) -> dict[str, Any]:
    """``evaluate_checkpoint`` through ``DistributedGPipe`` under torchrun (see the module's
    docstring); every rank returns the report, rank 0 writes it."""
    checkpoint, config = find_checkpoint(ckpt, split, overrides)
    world_size = int(os.environ["WORLD_SIZE"])
    num_stages = num_stages or world_size
    if num_stages < 1 or world_size % num_stages:
        raise ConfigError(f"--stages={num_stages} must divide the world size {world_size} "
                          "(R replicas x K stages)")
    pipe, run, checkpoint = load_pipeline(checkpoint, config, num_stages=num_stages,
                                          device=device)
    unpin(checkpoint)  # every rank's part is in memory
    balance = pipe.balance
    metrics = evaluate_pipeline(pipe, config, run, split)
    report = metrics.report(class_names(config), split=split)
    report.update(checkpoint=str(checkpoint), stages=num_stages, balance=list(balance),
                  replicas=run.num_replicas)
    try:
        if run.master:
            write_report_files(report, default_out(ckpt, checkpoint, split) if out is None
                               else out)
    finally:
        end_run()  # every rank waits for rank 0's report (or its failure), then leaves
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m apps.amoebanet.evaluate",
        description="Top-1 / top-5 and the confusion matrix of an apps.amoebanet checkpoint.",
        epilog="Any other --key=value overrides the checkpoint's config (e.g. --data_dir=...).",
        allow_abbrev=False,  # an unknown --key must reach the config loader, not match --out
    )
    parser.add_argument("--ckpt", default="runs/amoebanet", help="run out_dir or step-* folder")
    parser.add_argument("--split", default="test", help="split of the dataset (test, val, train)")
    parser.add_argument("--out", default=None,
                        help="write <out>.json and <out>.png (default: <out_dir>/eval_<split>)")
    parser.add_argument("--threads", type=threads(), default=None, help="torch CPU threads")
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu or cuda")
    parser.add_argument("--stages", type=at_least("--stages", 1, "pipeline stages"), default=None,
                        help="under torchrun: pipeline stages (default: the world size)")
    args, overrides = parser.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pipelined = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        if pipelined:
            report = evaluate_pipelined(args.ckpt, split=args.split, overrides=overrides,
                                        out=args.out, device=args.device,
                                        num_stages=args.stages)
        else:
            report = evaluate_checkpoint(args.ckpt, split=args.split, overrides=overrides,
                                         out=args.out, device=args.device)
    except (CheckpointError, gp.CheckpointCorruptError, DatasetNotFoundError,
            ConfigError) as error:
        say_once(f"error: {error}")  # every rank reaches the same error
        return 2
    except ReportWriteError as error:  # rank 0's only: it writes the report
        print(f"error: {error}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(f"{report['checkpoint']}: {args.split} top-1 {100 * report['top1']:.2f}%  top-5 "
          f"{100 * report['top5']:.2f}%  loss {report['loss']:.4f}  ({report['images']:,} images)")
    worst = sorted(report["per_class_top1"].items(), key=lambda item: item[1])[:3]
    print("hardest classes: " + ", ".join(f"{name} {100 * acc:.1f}%" for name, acc in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
