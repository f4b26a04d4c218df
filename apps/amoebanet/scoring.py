"""Scores of AmoebaNet: top-1 / top-5, loss and the confusion matrix
(:class:`ClassificationMetrics`), through the pipeline during training or evaluation
(:func:`evaluate_pipeline`), and the report both write (JSON and a confusion-matrix PNG).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import gpipe_core as gp
from apps.amoebanet.config import AmoebaNetConfig
from apps.amoebanet.data import build_eval_loader
from apps.harness.run import Run

__all__ = ["ClassificationMetrics", "evaluate_pipeline", "plot_report", "write_json",
           "write_report"]


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
    path = Path(path)
    json_path, png_path = path.with_suffix(".json"), path.with_suffix(".png")
    write_json(report, json_path)
    plot_report(report, png_path)
    return json_path, png_path


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """The report as JSON, whole or not at all."""
    gp.write_atomic(path, json.dumps(report, indent=1) + "\n")


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """The confusion matrix as a PNG: rates per true class, with the class names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    gp.write_atomic(path, png.getvalue())


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

