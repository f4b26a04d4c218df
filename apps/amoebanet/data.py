"""Seeded train/eval loaders over image shards: stream, check, decode, augment, batch.

The shard format (``dataset.json``, ``<split>-NNNNNN.tar`` of ``.png``/``.jpg`` or ``.npy`` +
``.cls`` members) and its writer live in ``data/image_shards.py``; the preparers in ``data/``
write it. A shard whose size or sample count differs from dataset.json, or that tarfile, PIL or
the ``.npy`` reader cannot read, raises ``CorruptShardError`` naming it (or is skipped with a
warning when ``skip_corrupt_shards`` is set). ``dataset="shards"`` also accepts a folder of
``<split>-*.tar`` without dataset.json (then nothing is checked beyond readability). The loaders
stream with webdataset and batch inside the workers, in one of two ways:

    encoded (.png/.jpg)  per image: PIL decode -> timm create_transform   -> batch   -> mixup
    decoded (.npy)       per image: view the uint8 array -> batch -> BatchTransform -> mixup

``BatchTransform`` is the same recipe as timm's transforms (random resized crop with timm's
crop sampling, horizontal flip, colour jitter; eval: resize and centre crop; normalisation) as
torch ops on the whole uint8 batch, each image with its own draws (torchvision's batched v2
transforms draw once per batch, which would change the augmentation): a 28x28 image costs
~0.1 ms of CPU instead of ~0.5 ms (``scripts/bench_amoebanet_input.py``). It has no
auto-augment (timm's runs on PIL images): a config asking for it on decoded shards is refused
with the fix.

Determinism: the shard order, the shuffle buffer and mixup draw from RNGs seeded by
``(config.seed, epoch, worker)``, and worker seeds (timm's random crops and flips) come from a
DataLoader generator seeded the same way; ``BatchTransform`` draws from a torch generator
seeded by ``(config.seed, epoch, dp_rank, worker)``, in any process. Two processes that build
the same loader see the same batches in the same order, which a pipeline needs (inputs are read
on the first stage, targets on the last). With ``num_workers=0`` the order and the mixup targets
are still seeded, but timm's random crops and flips (encoded shards) draw from the calling
process' global RNGs.
"""

from __future__ import annotations

import io
import json
import math
import random
import tarfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import webdataset as wds
from PIL import Image
from timm.data import Mixup, create_transform
from torch import Tensor
from torch.utils.data import DataLoader, get_worker_info

from apps.amoebanet.config import AmoebaNetConfig, soft_targets
from data.image_shards import (
    DATASET_JSON,
    DECODED_EXTENSION,
    IMAGE_EXTENSIONS,
    LABEL_EXTENSION,
    decode_npy,
    shard_glob,
)

Batch = tuple[Tensor, Tensor]  # images [B, C, H, W] float32; targets [B] int64 or [B, classes]

# The command that builds each dataset, quoted in "dataset not found" errors.
PREPARE_COMMANDS = {
    "fashion_mnist": "python -m data.fashion_mnist.prepare --out {data_dir}",
    "imagenet": "python -m data.imagenet.prepare --src <folder with train/ and val/> "
    "--out {data_dir}",
    "shards": "python -m data.imagenet.prepare --src <image folder> --out {data_dir} "
    "(or write <split>-NNNNNN.tar shards with .png/.jpg + .cls members yourself)",
}


class DatasetNotFoundError(FileNotFoundError):
    """The prepared shards are missing; the message says which command builds them."""


class CorruptShardError(RuntimeError):
    """A shard (or an image inside it) cannot be read; the message names the shard."""


def _missing(config: AmoebaNetConfig, what: str) -> DatasetNotFoundError:
    command = PREPARE_COMMANDS[config.dataset].format(data_dir=config.data_dir)
    return DatasetNotFoundError(f"{what}; build the {config.dataset} dataset with: {command}")


def read_dataset_info(config: AmoebaNetConfig) -> dict[str, Any] | None:
    """dataset.json of ``config.data_dir``; None only for ``dataset="shards"`` without one."""
    path = Path(config.data_dir) / DATASET_JSON
    if not path.is_file():
        if config.dataset == "shards":
            return None
        raise _missing(config, f"{path} not found (no prepared {config.dataset} shards)")
    try:
        info: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        raise _missing(config, f"{path} is not valid JSON ({exc})") from None
    return info


@dataclass(frozen=True)
class ShardInfo:
    """A shard's path and, when dataset.json records them, its size in bytes and images."""

    url: str
    num_bytes: int | None = None
    num_images: int | None = None


def shard_infos(config: AmoebaNetConfig, split: str) -> list[ShardInfo]:
    """The split's shards in order; a clear error when the dataset or the split is missing."""
    data_dir = Path(config.data_dir)
    info = read_dataset_info(config)
    if info is None:
        paths = sorted(data_dir.glob(shard_glob(split)))
        if not paths:
            raise _missing(config, f"no {shard_glob(split)} shards and no {DATASET_JSON} in "
                                   f"{data_dir}")
        return [ShardInfo(str(p)) for p in paths]
    splits = info.get("splits", {})
    if split not in splits:
        raise _missing(config, f"split {split!r} not in {data_dir / DATASET_JSON} "
                               f"(it has {sorted(splits)})")
    classes = info.get("classes")
    if classes is not None and len(classes) != config.num_classes:
        raise ValueError(
            f"{data_dir / DATASET_JSON} has {len(classes)} classes but num_classes="
            f"{config.num_classes}; set --num_classes={len(classes)}"
        )
    entry = splits[split]
    paths = [data_dir / shard for shard in entry["shards"]]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise _missing(config, f"shard(s) {absent} listed in {DATASET_JSON} are missing")
    num_bytes = entry.get("shard_bytes") or [None] * len(paths)
    num_images = entry.get("shard_images") or [None] * len(paths)
    return [ShardInfo(str(p), b, n) for p, b, n in zip(paths, num_bytes, num_images, strict=True)]


def shard_urls(config: AmoebaNetConfig, split: str) -> list[str]:
    """Paths of the split's shards, in order."""
    return [info.url for info in shard_infos(config, split)]


def num_images(config: AmoebaNetConfig, split: str) -> int:
    """Images in a split: from dataset.json, else by counting the shards' label members."""
    info = read_dataset_info(config)
    if info is not None:
        return int(info["splits"][split]["images"])
    total = 0
    for shard in shard_infos(config, split):
        with tarfile.open(shard.url) as tar:
            total += sum(1 for name in tar.getnames() if name.endswith(f".{LABEL_EXTENSION}"))
    return total


def class_names(config: AmoebaNetConfig) -> list[str]:
    """Class names in label order from dataset.json (``class<i>`` when it has none)."""
    info = read_dataset_info(config)
    classes = (info or {}).get("classes")
    return list(classes) if classes else [f"class{i}" for i in range(config.num_classes)]


def _shard_of(exn: BaseException) -> str:
    """The shard path webdataset attached to an exception's args (it appends the url)."""
    for arg in reversed(exn.args):
        if isinstance(arg, str) and ".tar" in arg:
            return arg.split(" @ ")[-1]
    return "<unknown shard>"


class ShardErrorHandler:
    """webdataset handler: stop with an error naming the shard, or warn and skip it."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip

    def __call__(self, exn: BaseException) -> bool:
        if isinstance(exn, CorruptShardError):
            if not self.skip:
                raise exn
            warnings.warn(f"{exn}; skipping (skip_corrupt_shards=true)", stacklevel=2)
            return True
        shard = _shard_of(exn)
        message = f"corrupt shard {shard}: {type(exn).__name__}: {exn.args[0] if exn.args else exn}"
        if self.skip:
            warnings.warn(f"{message}; skipping the rest of it (skip_corrupt_shards=true)",
                          stacklevel=2)
            return True
        raise CorruptShardError(f"{message}; {_fix_hint()}") from exn


def _corrupt_sample(sample: dict[str, Any], exn: Exception, skip: bool) -> None:
    """Warn that a sample cannot be read (``skip``), else raise CorruptShardError naming it."""
    shard = sample.get("__url__", "<unknown shard>")
    message = (f"corrupt sample {sample.get('__key__')!r} in shard {shard}: "
               f"{type(exn).__name__}: {exn} "
               f"(members: {sorted(k for k in sample if not k.startswith('__'))})")
    if skip:
        warnings.warn(f"{message}; skipping it (skip_corrupt_shards=true)", stacklevel=3)
        return
    raise CorruptShardError(
        f"{message}; rebuild the dataset or set --skip_corrupt_shards=true"
    ) from exn


class DecodeSample:
    """Shard sample dict -> (transformed image tensor, label); picklable for DataLoader workers."""

    def __init__(self, transform: Callable[[Image.Image], Tensor], mode: str, skip: bool) -> None:
        self.transform = transform
        self.mode = mode  # "L" for 1 channel, "RGB" for 3: grayscale and colour both convert
        self.skip = skip

    def __call__(self, sample: dict[str, Any]) -> tuple[Tensor, int] | None:
        try:
            ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
            if ext is None:
                raise ValueError(f"no image member (one of {', '.join(IMAGE_EXTENSIONS)})")
            with Image.open(io.BytesIO(sample[ext])) as image:
                pixels = image.convert(self.mode)
            label = int(sample[LABEL_EXTENSION])
        except Exception as exn:  # noqa: BLE001 - any decode failure is reported the same way
            _corrupt_sample(sample, exn, self.skip)
            return None
        return self.transform(pixels), label


class DecodeArray:
    """Decoded shards' sample dict -> (uint8 HxWxC array, label); picklable, no copy."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip

    def __call__(self, sample: dict[str, Any]) -> tuple[np.ndarray, int] | None:
        try:
            if DECODED_EXTENSION not in sample:
                raise ValueError(f"no decoded image member (.{DECODED_EXTENSION}) in a split "
                                 f"of decoded images")
            pixels = decode_npy(sample[DECODED_EXTENSION])
            label = int(sample[LABEL_EXTENSION])
        except Exception as exn:  # noqa: BLE001 - any decode failure is reported the same way
            _corrupt_sample(sample, exn, self.skip)
            return None
        return pixels, label


def _fix_hint() -> str:
    return ("rebuild the dataset (rerun its prepare command with --force) or set "
            "--skip_corrupt_shards=true to skip unreadable shards")


def check_shard_sizes(shards: list[ShardInfo], handler: ShardErrorHandler) -> list[ShardInfo]:
    """Drop (or stop at) shards whose size on disk differs from dataset.json's record."""
    kept = []
    for shard in shards:
        size = Path(shard.url).stat().st_size
        if shard.num_bytes is not None and size != shard.num_bytes:
            handler(CorruptShardError(
                f"corrupt shard {shard.url}: {size} bytes on disk, {shard.num_bytes} when "
                f"written (truncated or overwritten); {_fix_hint()}"))
            continue
        if shard.num_bytes is None and not _ends_like_a_tar(shard.url, size):
            # no dataset.json to compare with: a cut tar would read as a shorter one, silently
            handler(CorruptShardError(
                f"corrupt shard {shard.url}: {size} bytes, not ending in a tar archive's "
                f"end-of-archive blocks (truncated?); {_fix_hint()}"))
            continue
        kept.append(shard)
    return kept


def _ends_like_a_tar(path: str, size: int) -> bool:
    """A complete tar is whole 512-byte blocks ending in (at least) two zero blocks."""
    if size < 1024 or size % 512:
        return False
    with open(path, "rb") as file:
        file.seek(size - 1024)
        return file.read(1024) == bytes(1024)


class CountSamplesPerShard:
    """Pipeline stage: check each shard yields as many samples as it was written with.

    Python's tarfile ends a stream quietly at a damaged header, so a broken shard can look like
    a shorter one; counting catches that. Runs per worker, on whole shards, before shuffling.
    """

    def __init__(self, expected: dict[str, int], handler: ShardErrorHandler) -> None:
        self.expected = expected
        self.handler = handler

    def _check(self, url: str | None, count: int) -> None:
        want = self.expected.get(url) if url is not None else None
        if want is not None and count != want:
            self.handler(CorruptShardError(
                f"corrupt shard {url}: read {count} samples, {want} when written; {_fix_hint()}"))

    def __call__(self, samples: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        url, count = None, 0
        for sample in samples:
            if sample.get("__url__") != url:
                self._check(url, count)
                url, count = sample.get("__url__"), 0
            count += 1
            yield sample
        self._check(url, count)


def _drop_none(samples: Iterable[Any]) -> Iterator[Any]:
    return (s for s in samples if s is not None)


def _collate(samples: Sequence[tuple[Tensor, int]]) -> Batch:
    images, labels = zip(*samples, strict=True)
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64)


def _collate_arrays(samples: Sequence[tuple[np.ndarray, int]]) -> Batch:
    """uint8 ``[B, H, W, C]`` images (one copy, into the batch) and int64 labels."""
    images, labels = zip(*samples, strict=True)
    shapes = {image.shape for image in images}
    if len(shapes) > 1:
        raise ValueError(f"decoded images of one batch have shapes {sorted(shapes)}: a split of "
                         f"decoded (.npy) images needs one shape; store images of varying "
                         f"sizes encoded (.png/.jpg)")
    return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64)


def _worker_index() -> int:
    info = get_worker_info()
    return 0 if info is None else info.id


def _mix_batches(
    batches: Iterable[Batch], *, mixup: Mixup, seed: int, epoch: int
) -> Iterator[Batch]:
    """Apply timm's Mixup with its numpy draws seeded per (seed, epoch, worker, batch).

    Mixup draws from the global numpy RNG; seeding it around each call (and restoring it)
    makes the mixed targets the same in every process that builds this loader.
    """
    rng = random.Random(f"mixup-{seed}-{epoch}-{_worker_index()}")
    for images, labels in batches:
        saved = np.random.get_state()
        np.random.seed(rng.randrange(2**32))
        try:
            images, targets = mixup(images, labels)
        finally:
            np.random.set_state(saved)
        yield images, targets


def build_transform(config: AmoebaNetConfig, *, training: bool) -> Callable[[Image.Image], Tensor]:
    """timm's train or eval transform for the config's size, channels and augmentation."""
    return create_transform(
        input_size=(config.in_chans, config.image_size, config.image_size),
        is_training=training,
        scale=(config.crop_scale_min, 1.0),
        hflip=config.hflip,
        color_jitter=config.color_jitter,
        auto_augment=config.auto_augment,
        interpolation="bilinear",
        mean=tuple(config.mean),
        std=tuple(config.std),
        crop_pct=config.crop_pct,
    )


def build_mixup(config: AmoebaNetConfig) -> Mixup | None:
    """timm Mixup/CutMix (with label smoothing folded in), or None when both alphas are 0."""
    if not soft_targets(config):
        return None
    return Mixup(
        mixup_alpha=config.mixup,
        cutmix_alpha=config.cutmix,
        label_smoothing=config.label_smoothing,
        num_classes=config.num_classes,
    )


# ---------------------------------------------------------------------------------------------
# Decoded shards: timm's recipe as torch ops on whole batches

CROP_RATIO = (3 / 4, 4 / 3)  # timm's (and torchvision's) RandomResizedCrop aspect-ratio range
CROP_ATTEMPTS = 10  # timm's tries before falling back to a centre crop


def sample_crop_boxes(
    batch: int, height: int, width: int, *, scale: tuple[float, float],
    ratio: tuple[float, float] = CROP_RATIO, generator: torch.Generator | None = None,
) -> Tensor:
    """Random-resized-crop boxes ``[B, 4]`` (top, left, height, width), int64.

    timm's ``RandomResizedCropAndInterpolation.get_params`` for every image at once: up to 10
    draws of an area fraction in ``scale`` and a log-uniform aspect ratio in ``ratio``; the
    first draw that fits is placed uniformly; none fits: the centre crop with the aspect ratio
    clamped into ``ratio``.
    """
    area = height * width
    draws = torch.rand(batch, CROP_ATTEMPTS, 2, generator=generator, dtype=torch.float64)
    target_area = area * (scale[0] + (scale[1] - scale[0]) * draws[..., 0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * draws[..., 1])
    widths = torch.round(torch.sqrt(target_area * aspect)).long()  # half to even, as round()
    heights = torch.round(torch.sqrt(target_area / aspect)).long()
    fits = (widths <= width) & (heights <= height)
    first = fits.long().argmax(dim=1, keepdim=True)  # the first attempt that fits
    found = fits.any(dim=1)
    # the fallback, the same for every image of the batch (they share one size)
    in_ratio = width / height
    if in_ratio < min(ratio):
        fallback_w, fallback_h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        fallback_w, fallback_h = int(round(height * max(ratio))), height
    else:
        fallback_w, fallback_h = width, height
    box_h = torch.where(found, heights.gather(1, first)[:, 0], fallback_h)
    box_w = torch.where(found, widths.gather(1, first)[:, 0], fallback_w)
    offsets = torch.rand(batch, 2, generator=generator, dtype=torch.float64)
    top = torch.where(found, (offsets[:, 0] * (height - box_h + 1)).long(),
                      (height - fallback_h) // 2)
    left = torch.where(found, (offsets[:, 1] * (width - box_w + 1)).long(),
                       (width - fallback_w) // 2)
    return torch.stack([top, left, box_h, box_w], dim=1)


def _source_pixels(start: Tensor, length: Tensor, size: int) -> tuple[Tensor, ...]:
    """Bilinear source indices and weights ``[B, size]`` of ``interpolate(align_corners=False)``
    resizing ``length`` pixels from ``start`` to ``size`` (float32 arithmetic, as its kernel)."""
    scale = length.float() / size
    source = (scale[:, None] * (torch.arange(size, dtype=torch.float32) + 0.5) - 0.5).clamp_(min=0)
    index0 = source.long()  # source >= 0: truncation is floor
    weight1 = source - index0
    index1 = index0 + (index0 < (length[:, None] - 1)).long()
    return start[:, None] + index0, start[:, None] + index1, 1 - weight1, weight1


def resized_crop(images: Tensor, boxes: Tensor, size: int) -> Tensor:
    """Crop every image ``[B, C, H, W]`` to its box and resize it to ``size`` x ``size``.

    Bilinear, as ``F.interpolate(crop, size, mode="bilinear", align_corners=False)`` per image
    (no antialiasing: for decoded shards of small images the crops are upscaled), as gathers
    over the whole batch.
    """
    batch, channels, height, _ = images.shape
    top, left, box_h, box_w = boxes.unbind(1)
    if bool((box_h == size).all() and (box_w == size).all()) and images.shape[-1] == size == height:
        return images  # the whole image at its own size: a resize to the same size is the identity
    rows0, rows1, row_w0, row_w1 = _source_pixels(top, box_h, size)
    cols0, cols1, col_w0, col_w1 = _source_pixels(left, box_w, size)

    def columns(index: Tensor) -> Tensor:
        return images.gather(3, index[:, None, None, :].expand(batch, channels, height, size))

    across = columns(cols0) * col_w0[:, None, None, :] + columns(cols1) * col_w1[:, None, None, :]

    def rows(index: Tensor) -> Tensor:
        return across.gather(2, index[:, None, :, None].expand(batch, channels, size, size))

    return rows(rows0) * row_w0[:, None, :, None] + rows(rows1) * row_w1[:, None, :, None]


def _grayscale(images: Tensor) -> Tensor:
    """torchvision's luma of float RGB images ``[B, 3, H, W]`` -> ``[B, 1, H, W]``."""
    red, green, blue = images.unbind(1)
    return (0.2989 * red + 0.587 * green + 0.114 * blue).unsqueeze(1)


def _blend(images: Tensor, other: Tensor | float, factor: Tensor) -> Tensor:
    return (factor * images + (1.0 - factor) * other).clamp(0.0, 1.0)


def _brightness(images: Tensor, factor: Tensor) -> Tensor:
    return _blend(images, 0.0, factor)


def _contrast(images: Tensor, factor: Tensor) -> Tensor:
    gray = _grayscale(images) if images.shape[1] == 3 else images
    return _blend(images, gray.mean(dim=(-3, -2, -1), keepdim=True), factor)


def _saturation(images: Tensor, factor: Tensor) -> Tensor:
    if images.shape[1] == 1:
        return images  # as torchvision: a grayscale image has no saturation
    return _blend(images, _grayscale(images), factor)


JITTERS = (_brightness, _contrast, _saturation)  # timm's color_jitter=c: these three, hue off


def color_jitter(images: Tensor, factors: Tensor, order: Tensor) -> Tensor:
    """torchvision's ColorJitter on float images in [0, 1], per image: ``factors[b, k]`` for
    adjustment k of ``JITTERS``, applied in the order ``order[b]`` (a permutation of 0..2).

    Every position runs each adjustment on the whole batch, with factor 1 (the identity,
    exactly) for the images whose turn it is not.
    """
    for position in range(len(JITTERS)):
        for kind, adjust in enumerate(JITTERS):
            turn = order[:, position] == kind
            if bool(turn.any()):
                factor = torch.where(turn, factors[:, kind], 1.0).to(images.dtype)
                images = adjust(images, factor[:, None, None, None])
    return images


def to_channels(images: Tensor, channels: int) -> Tensor:
    """uint8 ``[B, C, H, W]`` with C in {1, 3} -> ``channels`` (PIL's convert("L")/("RGB"))."""
    have = images.shape[1]
    if have == channels:
        return images
    if have == 1 and channels == 3:
        return images.expand(-1, 3, -1, -1)
    if have == 3 and channels == 1:  # PIL's integer luma: (19595 R + 38470 G + 7471 B + 2^15) >> 16
        weights = torch.tensor([19595, 38470, 7471], dtype=torch.int32)[None, :, None, None]
        luma = (images.int() * weights).sum(dim=1, keepdim=True) + 0x8000
        return (luma >> 16).to(torch.uint8)
    raise ValueError(f"decoded images have {have} channels; in_chans={channels} needs 1 or 3")


@dataclass(frozen=True)
class BatchTransform:
    """timm's train or eval transform of this config as torch ops on a uint8 batch.

    ``images [B, H, W, C] uint8 -> [B, in_chans, image_size, image_size] float32``. Train:
    random resized crop (timm's box sampling, bilinear), horizontal flip, colour jitter
    (brightness, contrast, saturation in random order per image), normalisation. Eval: resize
    the shorter side to ``image_size / crop_pct`` (bilinear, antialiased), centre crop,
    normalisation. Random draws come from ``generator``.
    """

    training: bool
    image_size: int
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: float = 0.0
    color_jitter: float = 0.0
    crop_pct: float = 1.0

    @classmethod
    def of(cls, config: AmoebaNetConfig, *, training: bool) -> BatchTransform:
        if config.auto_augment:
            raise ValueError(
                f"auto_augment={config.auto_augment!r} runs per image on PIL images (timm), "
                f"and {config.data_dir} holds decoded (.npy) images, augmented in batches with "
                f"torch ops; rebuild the dataset with encoded images (e.g. python -m "
                f"data.fashion_mnist.prepare --image-format png --force) or drop auto_augment")
        return cls(training=training, image_size=config.image_size, in_chans=config.in_chans,
                   mean=tuple(config.mean), std=tuple(config.std),
                   crop_scale=(config.crop_scale_min, 1.0), hflip=config.hflip,
                   color_jitter=config.color_jitter, crop_pct=config.crop_pct)

    def __call__(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        pixels = to_channels(images.permute(0, 3, 1, 2), self.in_chans)
        batch, _, height, width = pixels.shape
        floats = pixels.float().div_(255)  # timm's ToTensor
        if self.training:
            boxes = sample_crop_boxes(batch, height, width, scale=self.crop_scale,
                                      generator=generator)
            floats = resized_crop(floats, boxes, self.image_size)
            if self.hflip > 0:
                flip = torch.rand(batch, generator=generator) < self.hflip
                floats = torch.where(flip[:, None, None, None], floats.flip(-1), floats)
            if self.color_jitter > 0:
                low, high = max(0.0, 1 - self.color_jitter), 1 + self.color_jitter
                factors = low + (high - low) * torch.rand(batch, len(JITTERS),
                                                          generator=generator)
                order = torch.rand(batch, len(JITTERS), generator=generator).argsort(dim=1)
                floats = color_jitter(floats, factors, order)
        else:
            floats = self._resize_and_centre_crop(floats)
        mean = torch.tensor(self.mean, dtype=torch.float32)[None, :, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[None, :, None, None]
        return floats.sub_(mean).div_(std).contiguous()

    def _resize_and_centre_crop(self, images: Tensor) -> Tensor:
        """timm's eval: Resize(floor(size / crop_pct)) of the shorter side, CenterCrop(size)."""
        height, width = images.shape[-2:]
        short = math.floor(self.image_size / self.crop_pct)
        if min(height, width) != short:
            new_h = short if height <= width else int(short * height / width)
            new_w = short if width <= height else int(short * width / height)
            images = F.interpolate(images, size=(new_h, new_w), mode="bilinear",
                                   align_corners=False, antialias=True)
            height, width = new_h, new_w
        top = int(round((height - self.image_size) / 2.0))
        left = int(round((width - self.image_size) / 2.0))
        return images[..., top:top + self.image_size, left:left + self.image_size]


def augment_seed(seed: int, epoch: int, dp_rank: int, worker: int) -> int:
    """The seed of ``BatchTransform``'s generator for one (run seed, epoch, replica, worker)."""
    return random.Random(f"augment-{seed}-{epoch}-{dp_rank}-{worker}").randrange(2**63)


def _transform_batches(batches: Iterable[Batch], *, transform: BatchTransform, seed: int,
                       epoch: int, dp_rank: int) -> Iterator[Batch]:
    """Pipeline stage: ``transform`` every uint8 batch, drawing from a generator seeded per
    (seed, epoch, replica, worker): the same batches in every process, after any resume."""
    generator = torch.Generator().manual_seed(augment_seed(seed, epoch, dp_rank,
                                                           _worker_index()))
    for images, labels in batches:
        yield transform(images, generator), labels


def split_is_decoded(config: AmoebaNetConfig, split: str, shards: Sequence[ShardInfo]) -> bool:
    """Whether a split holds decoded (.npy) images: from dataset.json's ``image_exts``, else
    from the first shard's first image member (a shard that cannot be read: not decoded, and
    the reader names it)."""
    info = read_dataset_info(config)
    exts = ((info or {}).get("splits", {}).get(split) or {}).get("image_exts")
    if exts is not None:
        if DECODED_EXTENSION in exts and len(exts) > 1:
            raise ValueError(f"split {split!r} of {config.data_dir} mixes decoded (.npy) and "
                             f"encoded images ({exts}); rebuild it with one kind")
        return DECODED_EXTENSION in exts
    if not shards:
        return False
    try:
        with tarfile.open(shards[0].url) as tar:
            for member in tar:
                ext = member.name.rsplit("/", 1)[-1].split(".", 1)[-1]
                if ext == DECODED_EXTENSION or ext in IMAGE_EXTENSIONS:
                    return ext == DECODED_EXTENSION
    except (OSError, tarfile.TarError):
        pass
    return False


def image_pipeline(
    config: AmoebaNetConfig,
    split: str,
    *,
    training: bool,
    epoch: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> wds.DataPipeline:
    """The webdataset pipeline yielding batches; see ``build_train_loader``."""
    handler = ShardErrorHandler(skip=config.skip_corrupt_shards)
    shards = check_shard_sizes(shard_infos(config, split), handler)
    if training:
        random.Random(f"shards-{config.seed}-{epoch}").shuffle(shards)
    if dp_size > 1:
        # data-parallel replicas read disjoint shards (the same shuffled list on every rank)
        if len(shards) < dp_size:
            raise ValueError(f"{len(shards)} shard(s) of split {split!r} cannot feed "
                             f"{dp_size} data-parallel replicas; write more, smaller shards")
        shards = shards[dp_rank::dp_size]
    urls = [shard.url for shard in shards]
    expected = {s.url: s.num_images for s in shards if s.num_images is not None}
    decoded = split_is_decoded(config, split, shards)
    stages: list[Any] = [
        wds.SimpleShardList(urls),
        wds.split_by_worker,  # each worker reads whole, distinct shards
        wds.tarfile_to_samples(handler=handler),
        CountSamplesPerShard(expected, handler),
    ]
    if training and config.shuffle_buffer > 1:
        stages.append(wds.shuffle(config.shuffle_buffer, initial=config.shuffle_buffer,
                                  rng=random.Random(f"samples-{config.seed}-{epoch}-{dp_rank}")))
    batch_size = config.batch_size if training else config.eval_batch_size
    # training drops the last partial batch so every step splits into equal micro-batches
    if decoded:
        stages += [wds.map(DecodeArray(skip=config.skip_corrupt_shards)), _drop_none,
                   wds.batched(batch_size, partial=not training, collation_fn=_collate_arrays),
                   partial(_transform_batches, transform=BatchTransform.of(config,
                                                                           training=training),
                           seed=config.seed, epoch=epoch, dp_rank=dp_rank)]
    else:
        mode = "L" if config.in_chans == 1 else "RGB"
        decode = DecodeSample(build_transform(config, training=training), mode,
                              skip=config.skip_corrupt_shards)
        stages += [wds.map(decode), _drop_none,
                   wds.batched(batch_size, partial=not training, collation_fn=_collate)]
    mixup = build_mixup(config) if training else None
    if mixup is not None:
        stages.append(partial(_mix_batches, mixup=mixup, seed=config.seed, epoch=epoch))
    return wds.DataPipeline(*stages)


def _loader(pipeline: wds.DataPipeline, config: AmoebaNetConfig, seed: int) -> DataLoader:
    return DataLoader(
        pipeline,
        batch_size=None,  # batched inside the pipeline, in the workers
        num_workers=config.num_workers,
        generator=torch.Generator().manual_seed(seed),  # fixes the workers' augmentation seeds
        persistent_workers=False,
    )


def build_train_loader(
    config: AmoebaNetConfig, *, epoch: int = 0, dp_rank: int = 0, dp_size: int = 1
) -> DataLoader:
    """One epoch of shuffled, augmented training batches ``(images, targets)``.

    Targets are int64 class indices, or soft targets ``[B, num_classes]`` when mixup/cutmix is
    on (use ``apps.amoebanet.loss.build_train_loss``). The last partial batch is dropped. Build a new loader per
    epoch: ``epoch`` reseeds the shard order, shuffle buffer, augmentation and mixup. With
    ``dp_size > 1`` each data-parallel replica reads every ``dp_size``-th shard.
    """
    pipeline = image_pipeline(config, config.train_split, training=True, epoch=epoch,
                              dp_rank=dp_rank, dp_size=dp_size)
    return _loader(pipeline, config, seed=config.seed * 100_003 + epoch)


def build_eval_loader(
    config: AmoebaNetConfig, split: str | None = None, *, dp_rank: int = 0, dp_size: int = 1
) -> DataLoader:
    """Every image of ``split`` (default ``config.eval_split``) exactly once, in shard order.

    Batches are ``(images, int64 labels)`` with eval transforms; the last batch may be smaller.
    """
    pipeline = image_pipeline(config, split or config.eval_split, training=False,
                              dp_rank=dp_rank, dp_size=dp_size)
    return _loader(pipeline, config, seed=config.seed)
