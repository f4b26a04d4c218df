"""Evaluation of AmoebaNet: top-1 / top-5, loss and the confusion matrix, through the pipeline
during training (``evaluate_pipeline``) or of a checkpoint (``make eval-amoebanet``), and the
report both write (JSON and a confusion-matrix PNG)::

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
writes the report.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import gpipe_core as gp
from apps.amoebanet.config import AmoebaNetConfig, build_model, load_amoebanet_config
from apps.amoebanet.data import (
    DatasetNotFoundError,
    build_eval_loader,
    class_names,
    shard_infos,
)
from apps.config import ConfigError
from apps.harness.checkpoints import (
    CheckpointError,
    agree_on_checkpoint,
    require_app,
    resolve_checkpoint,
    unpin,
)
from apps.harness.run import Run, end_run, setup_run
from apps.validation import CommandParser, at_least, device_name, threads

TRAIN_COMMAND = (
    "python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d "
    "--rdzv-endpoint 127.0.0.1:0 -m apps.amoebanet.train --out_dir={out_dir}"
)


def load_model(config: AmoebaNetConfig, checkpoint: Path, device: torch.device) -> nn.Module:
    """The plain ``nn.Sequential`` of ``config`` holding the checkpoint's merged shards."""
    model = build_model(config, device="meta")
    model.load_state_dict(gp.load_shards(checkpoint), assign=True)
    return model.to(device).eval()


class ClassificationMetrics:
    """Running top-1 / top-5 counts, summed cross-entropy and the confusion matrix."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)  # [true, pred]
        self.top5_correct = 0
        self.loss_sum = 0.0

    @torch.no_grad()
    def update(self, logits: Tensor, labels: Tensor) -> None:
        logits, labels = logits.detach().float().cpu(), labels.cpu()
        k = min(5, self.num_classes)
        top = logits.topk(k, dim=1).indices
        self.top5_correct += int((top == labels[:, None]).any(dim=1).sum())
        pairs = labels * self.num_classes + top[:, 0]
        self.confusion += torch.bincount(pairs, minlength=self.num_classes**2).view(
            self.num_classes, self.num_classes)
        self.loss_sum += float(F.cross_entropy(logits.double(), labels, reduction="sum"))

    @property
    def images(self) -> int:
        return int(self.confusion.sum())

    def all_reduce(self, device: torch.device, group: Any = None) -> None:
        """Sum the counts of every rank (ranks that saw nothing contribute zeros)."""
        flat = torch.cat([self.confusion.flatten().double(),
                          torch.tensor([self.top5_correct, self.loss_sum], dtype=torch.float64)])
        flat = flat.to(device)
        dist.all_reduce(flat, group=group)
        flat = flat.cpu()
        cells = self.num_classes**2
        self.confusion = flat[:cells].round().long().view(self.num_classes, self.num_classes)
        self.top5_correct = int(round(float(flat[cells])))
        self.loss_sum = float(flat[cells + 1])

    def report(self, classes: Sequence[str], *, split: str) -> dict[str, Any]:
        n = max(self.images, 1)
        per_class = self.confusion.diag().double() / self.confusion.sum(1).clamp(min=1).double()
        return {
            "split": split,
            "images": self.images,
            "top1": float(self.confusion.diag().sum()) / n,
            "top5": self.top5_correct / n,
            "loss": self.loss_sum / n,
            "classes": list(classes),
            "per_class_top1": {name: round(float(v), 4)
                               for name, v in zip(classes, per_class, strict=True)},
            "confusion": self.confusion.tolist(),  # rows: true class, columns: predicted
        }


def write_report(report: dict[str, Any], path: str | Path) -> tuple[Path, Path]:
    """Write ``<path>.json`` and a confusion-matrix ``<path>.png``; return both paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = path.with_suffix(".json"), path.with_suffix(".png")
    gp.write_atomic(json_path, json.dumps(report, indent=1) + "\n")  # whole or not at all
    confusion = np.array(report["confusion"], dtype=np.int64)
    rates = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)
    classes = report["classes"]
    size = max(5.0, 0.55 * len(classes) + 2.0)
    fig, ax = plt.subplots(figsize=(size + 1.0, size))
    image = ax.imshow(rates, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if len(classes) <= 20:
        for i in range(len(classes)):
            for j in range(len(classes)):
                if confusion[i, j]:
                    ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if rates[i, j] > 0.5 else "black")
    ax.set_title(f"{report['split']}: top-1 {100 * report['top1']:.2f}%, "
                 f"top-5 {100 * report['top5']:.2f}% ({report['images']} images)")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    gp.write_atomic(png_path, png.getvalue())
    return json_path, png_path


def evaluate_pipeline(
    pipe: gp.DistributedGPipe, config: AmoebaNetConfig, run: Run, split: str,
) -> ClassificationMetrics:
    """Top-1 / top-5 on ``split`` through the pipeline (forward only, BatchNorm in eval mode).

    Each replica's first stage reads its share of the split's shards and sends each batch's size
    and labels to its last stage, which scores the logits; the counts are summed over the world.
    """
    pipe.eval()  # running BatchNorm statistics, no drop-path, and nothing committed
    metrics = ClassificationMetrics(config.num_classes)
    batches = None
    if pipe.is_first:
        batches = iter(build_eval_loader(config, split, dp_rank=run.replica,
                                         dp_size=run.num_replicas))
    while True:
        batch = next(batches, None) if batches is not None else None
        size = torch.tensor([len(batch[1]) if batch is not None else 0])  # 0: done
        size = run.broadcast_from_first_stage(size, size)
        if int(size[0]) == 0:
            break
        labels = run.broadcast_from_first_stage(batch[1] if batch is not None else None,
                                   torch.empty(int(size[0]), dtype=torch.int64))
        _, logits = pipe.evaluate(batch[0] if batch is not None else None,
                                  labels if pipe.is_last else None, return_outputs=True)
        if pipe.is_last:
            metrics.update(logits, labels)
    pipe.train()
    metrics.all_reduce(run.device)
    return metrics


# ---------------------------------------------------------------------------------------------
# A checkpoint's report: the command


def load_checkpoint_config(checkpoint: Path, overrides: Sequence[str] = ()) -> AmoebaNetConfig:
    """The config saved with ``checkpoint``, with ``--key=value`` overrides on top."""
    return load_amoebanet_config([f"--config={checkpoint / 'config.yaml'}", *overrides])


def find_checkpoint(ckpt: str | Path, split: str,
                    overrides: Sequence[str]) -> tuple[Path, AmoebaNetConfig]:
    """The AmoebaNet checkpoint under ``ckpt`` and its config with ``overrides``, whose
    dataset has ``split``; an error that says the fix if any of them is missing."""
    checkpoint = resolve_checkpoint(ckpt, train_command=TRAIN_COMMAND.format(out_dir=ckpt))
    require_app(checkpoint, "amoebanet")
    config = load_checkpoint_config(checkpoint, overrides)
    shard_infos(config, split)  # a missing dataset or split fails here, naming the command
    return checkpoint, config


def default_out(ckpt: str | Path, checkpoint: Path, split: str) -> Path:
    """``eval_<split>`` beside the run's own files when given its out_dir, else in the step
    folder."""
    return (Path(ckpt) if (Path(ckpt) / "latest").is_file() else checkpoint) / f"eval_{split}"


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
    write_report(report, default_out(ckpt, checkpoint, split) if out is None else out)
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
    run = setup_run(num_stages=num_stages, device=device, timeout_s=config.timeout_s)
    # a run still training may have published another checkpoint while the ranks resolved
    checkpoint = agree_on_checkpoint(checkpoint)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    # the checkpoint's recorded stage split (each rank reads only the shards of its layers),
    # or the layers split by parameters for another number of stages or an older checkpoint
    pipe = gp.DistributedGPipe.from_checkpoint(
        checkpoint, build_model(config, device="meta"), num_stages=num_stages,
        resplit=gp.balance_by_params, chunks=config.chunks, schedule="gpipe",
        deferred_batch_norm=False, loss_fn=loss_fn, group=run.pipeline_group,
        data_parallel_group=run.data_group if run.num_replicas > 1 else None,
        device=run.device, seed=config.seed, precision=config.precision,
    )
    unpin(checkpoint)  # every rank's part is in memory
    balance = pipe.balance
    metrics = evaluate_pipeline(pipe, config, run, split)
    report = metrics.report(class_names(config), split=split)
    report.update(checkpoint=str(checkpoint), stages=num_stages, balance=list(balance),
                  replicas=run.num_replicas)
    if run.master:
        write_report(report, default_out(ckpt, checkpoint, split) if out is None else out)
    end_run()  # every rank waits for rank 0's report, then leaves the process groups
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
