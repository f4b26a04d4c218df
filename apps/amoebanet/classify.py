"""Classify image files with a trained AmoebaNet checkpoint: the top-5 classes of each.

    python -m apps.amoebanet.classify --ckpt runs/amoebanet IMAGE [IMAGE ...]
        [--top 5] [--device cpu|cuda] [--threads N] [--key=value ...]

Runs in one process on the plain model merged from the checkpoint's shards (as
``apps.amoebanet.evaluate`` does), BatchNorm in eval mode. Each image goes through the eval
transforms of the checkpoint's config (converted to its channels, resized to ``image_size /
crop_pct``, center-cropped to ``image_size``, normalised by its ``mean`` / ``std``); any other
``--key=value`` overrides that config. For each image it prints the path, then one line per
class, most probable first::

    shirt.png
      0.9123  Shirt
      0.0501  T-shirt/top

Class names come from the checkpoint's run.json (as trained), else the dataset.json of the
config's ``data_dir``, else ``class<i>``. Every image is opened before the model is loaded, and
the command refuses (one line per bad image, exit status 2, nothing classified) a file that
does not exist or is not an image PIL reads, and an image whose smaller side is below the
smallest the network accepts (``min_image_size(stem_stride)``: each stride-2 reduction must
still halve something); images between that and ``image_size`` are upscaled by the transform,
with a warning on stderr. An image of more than ``--max-image-pixels`` pixels (default
178,956,970, the size PIL refuses as a possible decompression bomb; a 20000x20000 image has
400M) is refused from its header, before decoding; pass a larger number, or 0, to allow it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

import gpipe_core as gp
from apps.amoebanet.checkpoint_loading import load_model
from apps.amoebanet.commands import TRAIN_COMMAND
from apps.amoebanet.config import AmoebaNetConfig, load_amoebanet_config
from apps.amoebanet.data import DatasetNotFoundError, build_transform, class_names
from apps.amoebanet.model import min_image_size
from apps.config import ConfigError
from apps.harness.checkpoints import CheckpointError, require_app, resolve_checkpoint
from apps.validation import CommandParser, device_name, threads

__all__ = ["ImageError", "checkpoint_classes", "load_images", "main", "top_classes"]


class ImageError(ValueError):
    """An image that cannot be classified; the message names the file and the fix."""


# The most pixels an image may have (--max-image-pixels): PIL's own decompression-bomb limit
# (twice Image.MAX_IMAGE_PIXELS, 179M), which this command checks itself so that the refusal
# is one line naming the option instead of PIL's DecompressionBombError.
MAX_IMAGE_PIXELS = 2 * 89_478_485


@contextmanager
def _pil_size_check_off() -> Iterator[None]:
    """PIL's global decompression-bomb check off (``load_images`` applies its own limit)."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def checkpoint_classes(checkpoint: Path, config: AmoebaNetConfig) -> list[str]:
    """Class names in label order: the checkpoint's run.json, else the dataset's, else class<i>."""
    try:
        classes = json.loads((checkpoint / "run.json").read_text()).get("classes")
    except (OSError, ValueError):
        classes = None
    if not classes:
        try:
            classes = class_names(config)
        except (DatasetNotFoundError, OSError, ValueError):
            classes = None
    if not classes or len(classes) != config.num_classes:
        classes = [f"class{i}" for i in range(config.num_classes)]
    return list(classes)


def load_images(paths: Sequence[str], config: AmoebaNetConfig, *,
                max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[Tensor, list[str]]:
    """The images at ``paths`` through the config's eval transform, as one batch; and warnings.

    ImageError listing every file that is missing, unreadable, too small for the network, or
    of more than ``max_pixels`` pixels (0 = no limit), checked from the file's header before
    any pixel is decoded.
    """
    transform = build_transform(config, training=False)
    mode = "L" if config.in_chans == 1 else "RGB"
    smallest = min_image_size(config.stem_stride)
    tensors: list[Tensor] = []
    problems: list[str] = []
    warnings: list[str] = []
    for path in paths:
        try:
            with _pil_size_check_off(), Image.open(path) as image:
                width, height = image.size
                if max_pixels and width * height > max_pixels:
                    problems.append(
                        f"{path}: {width}x{height} = {width * height:,} pixels is more than "
                        f"--max-image-pixels={max_pixels:,} (a guard against decompression "
                        "bombs); if you trust the file, pass a larger --max-image-pixels, or 0 "
                        "for no limit")
                    continue
                image.load()
                pixels = image.convert(mode)
        except FileNotFoundError:
            problems.append(f"{path}: no such file")
            continue
        except IsADirectoryError:
            problems.append(f"{path}: is a directory, not an image file")
            continue
        except (UnidentifiedImageError, OSError, ValueError) as error:
            problems.append(f"{path}: not an image PIL can read ({type(error).__name__}: "
                            f"{error}); give a PNG, JPEG or WebP file")
            continue
        width, height = pixels.size
        if min(width, height) < smallest:
            problems.append(
                f"{path}: {width}x{height} is too small for this AmoebaNet (stem_stride="
                f"{config.stem_stride}): its smaller side must be at least {smallest} pixels "
                f"(it was trained on {config.image_size}x{config.image_size}); resize it up")
            continue
        if min(width, height) < config.image_size:
            warnings.append(f"warning: {path}: {width}x{height} is smaller than the model's "
                            f"{config.image_size}x{config.image_size}; upscaling it")
        tensors.append(transform(pixels))
    if problems:
        raise ImageError("cannot classify " + "; ".join(problems))
    return torch.stack(tensors), warnings


@torch.no_grad()
def top_classes(model: torch.nn.Module, images: Tensor, classes: Sequence[str], *,
                top: int = 5) -> list[list[tuple[str, float]]]:
    """(class name, probability) of the ``top`` most probable classes of each image."""
    probabilities = model(images).float().softmax(dim=-1)
    values, indices = probabilities.topk(min(top, probabilities.shape[-1]), dim=-1)
    return [[(classes[int(i)], float(p)) for p, i in zip(row_p, row_i, strict=True)]
            for row_p, row_i in zip(values, indices, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m apps.amoebanet.classify",
        description="Top-5 classes with probabilities of image files, with an apps.amoebanet "
        "checkpoint (the checkpoint's eval transforms).",
        epilog="Any other --key=value overrides the checkpoint's config.",
        allow_abbrev=False,
    )
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files")
    parser.add_argument("--ckpt", default="runs/amoebanet", help="run out_dir or step-* folder")
    parser.add_argument("--top", type=int, default=5, help="classes per image (default 5)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward")
    parser.add_argument("--threads", type=threads(), default=None, help="torch CPU threads")
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu or cuda")
    parser.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                        help="refuse larger images, a guard against decompression bombs "
                        f"(default {MAX_IMAGE_PIXELS:,}, PIL's; 0 = no limit)")
    args, overrides = parser.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 2

    if args.top < 1 or args.batch_size < 1:
        return fail(f"--top={args.top} and --batch-size={args.batch_size} must be >= 1")
    if args.max_image_pixels < 0:
        return fail(f"--max-image-pixels={args.max_image_pixels} must be >= 0 (0 = no limit)")
    unknown = [arg for arg in overrides if not arg.startswith("--")]
    if unknown:
        return fail(f"unexpected argument(s) {unknown}")
    try:
        checkpoint = resolve_checkpoint(
            args.ckpt, train_command=TRAIN_COMMAND.format(out_dir=args.ckpt))
        require_app(checkpoint, "amoebanet")
        config = load_amoebanet_config([f"--config={checkpoint / 'config.yaml'}", *overrides])
        images, warnings = load_images(args.images, config, max_pixels=args.max_image_pixels)
        classes = checkpoint_classes(checkpoint, config)
        model = load_model(config, checkpoint, torch.device(args.device))
    except (CheckpointError, gp.CheckpointCorruptError, ConfigError, ImageError) as error:
        return fail(str(error))
    for warning in warnings:
        print(warning, file=sys.stderr)
    results: list[list[tuple[str, float]]] = []
    for start in range(0, len(images), args.batch_size):
        batch = images[start : start + args.batch_size].to(args.device)
        results += top_classes(model, batch, classes, top=args.top)
    lines: list[Any] = []
    for path, ranked in zip(args.images, results, strict=True):
        lines.append(path)
        lines += [f"  {probability:.4f}  {name}" for name, probability in ranked]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
