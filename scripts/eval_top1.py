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
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpipe_core as gp  # noqa: E402
from apps.amoebanet.config import AmoebaNetConfig, build_model, load_amoebanet_config  # noqa: E402
from apps.amoebanet.data import DatasetNotFoundError, build_eval_loader, shard_infos  # noqa: E402
from apps.amoebanet.train import (  # noqa: E402
    TRAIN_COMMAND,
    ClassificationMetrics,
    class_names,
    write_report,
)
from apps.common import CheckpointError, require_app, resolve_checkpoint  # noqa: E402
from apps.config import ConfigError  # noqa: E402


def load_checkpoint_config(checkpoint: Path, overrides: Sequence[str] = ()) -> AmoebaNetConfig:
    """The config saved with ``checkpoint``, with ``--key=value`` overrides on top."""
    return load_amoebanet_config([f"--config={checkpoint / 'config.yaml'}", *overrides])


def load_model(config: AmoebaNetConfig, checkpoint: Path, device: torch.device) -> torch.nn.Module:
    """The plain ``nn.Sequential`` of ``config`` holding the checkpoint's merged shards."""
    model = build_model(config, device="meta")
    model.load_state_dict(gp.load_shards(checkpoint), assign=True)
    return model.to(device).eval()


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
    args, overrides = parser.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = evaluate_checkpoint(args.ckpt, split=args.split, overrides=overrides,
                                     out=args.out, device=args.device)
    except (CheckpointError, gp.CheckpointCorruptError, DatasetNotFoundError,
            ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{report['checkpoint']}: {args.split} top-1 {100 * report['top1']:.2f}%  top-5 "
          f"{100 * report['top5']:.2f}%  loss {report['loss']:.4f}  ({report['images']:,} images)")
    worst = sorted(report["per_class_top1"].items(), key=lambda item: item[1])[:3]
    print("hardest classes: " + ", ".join(f"{name} {100 * acc:.1f}%" for name, acc in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
