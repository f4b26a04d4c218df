"""Evaluate an AmoebaNet checkpoint: top-1 / top-5 on a split, JSON plus a confusion-matrix PNG.

    python scripts/eval_top1.py --ckpt runs/amoebanet --split test [--out PATH] [--threads 2]
        [--device cpu|cuda] [--key=value ...]

``--ckpt`` is a run's out_dir (its ``latest`` checkpoint) or a ``step-NNNNNNN`` folder. The
config saved with the checkpoint is loaded, ``--key=value`` overrides it (e.g.
``--data_dir=...``, ``--eval_batch_size=512``; unknown keys are an error), the model shards are
merged into the plain ``nn.Sequential`` in one process, and every image of the split is scored
once with the eval transforms. Writes ``<out>.json`` (top-1, top-5, loss, per-class top-1,
confusion matrix) and ``<out>.png`` (the confusion matrix with class names); default
``<ckpt>/eval_<split>``.

Under torchrun the same command evaluates through the pipeline instead, and no rank holds the
whole model::

    torchrun --nproc-per-node 2 scripts/eval_top1.py --ckpt runs/amoebanet [--stages 2]

``--stages`` K pipeline stages (default: every rank, one pipeline; a world of R x K ranks is R
data-parallel replicas, each reading its share of the split's shards). Each rank builds its
stage on the ``meta`` device with ``DistributedGPipe.from_checkpoint`` and loads only its part
of the checkpoint (the stage split recorded in its index.json, its stages joined when K divides
their number, so that each rank reads only the shards holding its layers; else the layers are
split by parameters); the images go through ``DistributedGPipe.evaluate``
(forward only, BatchNorm in eval mode, ``chunks`` micro-batches) and the counts are summed
over the world. Top-1, top-5 and the confusion matrix equal the one-process numbers exactly;
the loss agrees to rounding (micro-batches change the order of floating-point sums). Rank 0
writes the report.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpipe_core as gp  # noqa: E402
from apps.amoebanet.config import AmoebaNetConfig, load_amoebanet_config  # noqa: E402
from apps.amoebanet.data import (  # noqa: E402
    DatasetNotFoundError,
    build_eval_loader,
    class_names,
    shard_infos,
)
from apps.amoebanet.evaluate import (  # noqa: E402
    TRAIN_COMMAND,
    ClassificationMetrics,
    load_model,
    write_report,
)
from apps.config import ConfigError  # noqa: E402
from apps.harness.checkpoints import CheckpointError, require_app, resolve_checkpoint  # noqa: E402


def load_checkpoint_config(checkpoint: Path, overrides: Sequence[str] = ()) -> AmoebaNetConfig:
    """The config saved with ``checkpoint``, with ``--key=value`` overrides on top."""
    return load_amoebanet_config([f"--config={checkpoint / 'config.yaml'}", *overrides])


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
    checkpoint = resolve_checkpoint(ckpt, train_command=TRAIN_COMMAND.format(out_dir=ckpt))
    require_app(checkpoint, "amoebanet")
    config = load_checkpoint_config(checkpoint, overrides)
    shard_infos(config, split)  # a missing dataset or split fails here, naming the command
    model = load_model(config, checkpoint, torch.device(device))
    metrics = ClassificationMetrics(config.num_classes)
    for images, labels in build_eval_loader(config, split):
        metrics.update(model(images.to(device)), labels)
    report = metrics.report(class_names(config), split=split)
    report["checkpoint"] = str(checkpoint)
    if out is None:  # beside the run's own files when given its out_dir, else in the step folder
        out = (Path(ckpt) if (Path(ckpt) / "latest").is_file() else checkpoint) / f"eval_{split}"
    write_report(report, out)
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
    import torch.nn.functional as F

    from apps.amoebanet.config import build_model
    from apps.amoebanet.evaluate import evaluate_pipeline
    from apps.harness.run import end_run, setup_run

    checkpoint = resolve_checkpoint(ckpt, train_command=TRAIN_COMMAND.format(out_dir=ckpt))
    require_app(checkpoint, "amoebanet")
    config = load_checkpoint_config(checkpoint, overrides)
    shard_infos(config, split)
    world_size = int(os.environ["WORLD_SIZE"])
    num_stages = num_stages or world_size
    if num_stages < 1 or world_size % num_stages:
        raise ConfigError(f"--stages={num_stages} must divide the world size {world_size} "
                          "(R replicas x K stages)")
    run = setup_run(num_stages=num_stages, device=device, timeout_s=config.timeout_s)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    # the checkpoint's recorded stage split (each rank reads only the shards of its layers),
    # or the layers split by parameters for another number of stages or an older checkpoint
    pipe = gp.DistributedGPipe.from_checkpoint(
        checkpoint, build_model(config, device="meta"), num_stages=num_stages,
        resplit=gp.balance_by_params, chunks=config.chunks, schedule="gpipe",
        deferred_batch_norm=False, loss_fn=loss_fn, group=run.pipeline_group,
        data_parallel_group=run.data_group if run.num_replicas > 1 else None,
        device=run.device, seed=config.seed,
    )
    balance = pipe.balance
    metrics = evaluate_pipeline(pipe, config, run, split, nullcontext())
    report = metrics.report(class_names(config), split=split)
    report.update(checkpoint=str(checkpoint), stages=num_stages, balance=list(balance),
                  replicas=run.num_replicas)
    if out is None:
        out = (Path(ckpt) if (Path(ckpt) / "latest").is_file() else checkpoint) / f"eval_{split}"
    if run.master:
        write_report(report, out)
    end_run()  # every rank waits for rank 0's report, then leaves the process groups
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/eval_top1.py",
        description="Top-1 / top-5 and the confusion matrix of an apps.amoebanet checkpoint.",
        epilog="Any other --key=value overrides the checkpoint's config (e.g. --data_dir=...).",
        allow_abbrev=False,  # an unknown --key must reach the config loader, not match --out
    )
    parser.add_argument("--ckpt", default="runs/amoebanet", help="run out_dir or step-* folder")
    parser.add_argument("--split", default="test", help="split of the dataset (test, val, train)")
    parser.add_argument("--out", default=None,
                        help="write <out>.json and <out>.png (default: <out_dir>/eval_<split>)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--stages", type=int, default=None,
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
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(f"{report['checkpoint']}: {args.split} top-1 {100 * report['top1']:.2f}%  top-5 "
          f"{100 * report['top5']:.2f}%  loss {report['loss']:.4f}  ({report['images']:,} images)")
    worst = sorted(report["per_class_top1"].items(), key=lambda item: item[1])[:3]
    print("hardest classes: " + ", ".join(f"{name} {100 * acc:.1f}%" for name, acc in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
