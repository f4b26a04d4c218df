"""Seeded train/eval loaders over image shards: stream, check, decode, augment, batch.

The shard format (``dataset.json``, ``<split>-NNNNNN.tar`` of ``.png``/``.jpg`` + ``.cls``
members) and its writer live in ``data/image_shards.py``; the preparers in ``data/`` write it.
A shard whose size or sample count differs from dataset.json, or that tarfile or PIL cannot
read, raises ``CorruptShardError`` naming it (or is skipped with a warning when
``skip_corrupt_shards`` is set). ``dataset="shards"`` also accepts a folder of
``<split>-*.tar`` without dataset.json (then nothing is checked beyond readability). The
loaders stream with webdataset, decode with PIL, transform with timm's ``create_transform`` and
batch inside the workers.

Determinism: the shard order, the shuffle buffer and mixup draw from RNGs seeded by
``(config.seed, epoch, worker)``, and worker seeds (timm's random crops and flips) come from a
DataLoader generator seeded the same way. Two processes that build the same loader see the same
batches in the same order, which a pipeline needs (inputs are read on the first stage, targets on
the last). With ``num_workers=0`` the order and the mixup targets are still seeded, but the
random crops and flips draw from the calling process' global RNGs.
"""

from __future__ import annotations

import io
import json
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
import webdataset as wds
from PIL import Image
from timm.data import Mixup, create_transform
from torch import Tensor
from torch.utils.data import DataLoader, get_worker_info

from apps.amoebanet.config import AmoebaNetConfig, soft_targets
from data.image_shards import DATASET_JSON, IMAGE_EXTENSIONS, LABEL_EXTENSION, shard_glob

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


class DecodeSample:
    """Shard sample dict -> (transformed image tensor, label); picklable for DataLoader workers."""

    def __init__(self, transform: Callable[[Image.Image], Tensor], mode: str, skip: bool) -> None:
        self.transform = transform
        self.mode = mode  # "L" for 1 channel, "RGB" for 3: grayscale and colour both convert
        self.skip = skip

    def __call__(self, sample: dict[str, Any]) -> tuple[Tensor, int] | None:
        shard = sample.get("__url__", "<unknown shard>")
        key = sample.get("__key__")
        try:
            ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
            if ext is None:
                raise ValueError(f"no image member (one of {', '.join(IMAGE_EXTENSIONS)})")
            with Image.open(io.BytesIO(sample[ext])) as image:
                pixels = image.convert(self.mode)
            label = int(sample[LABEL_EXTENSION])
        except Exception as exn:  # noqa: BLE001 - any decode failure is reported the same way
            message = (f"corrupt sample {key!r} in shard {shard}: {type(exn).__name__}: {exn} "
                       f"(members: {sorted(k for k in sample if not k.startswith('__'))})")
            if self.skip:
                warnings.warn(f"{message}; skipping it (skip_corrupt_shards=true)", stacklevel=2)
                return None
            raise CorruptShardError(
                f"{message}; rebuild the dataset or set --skip_corrupt_shards=true"
            ) from exn
        return self.transform(pixels), label


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
    mode = "L" if config.in_chans == 1 else "RGB"
    decode = DecodeSample(build_transform(config, training=training), mode,
                          skip=config.skip_corrupt_shards)
    stages: list[Any] = [
        wds.SimpleShardList(urls),
        wds.split_by_worker,  # each worker reads whole, distinct shards
        wds.tarfile_to_samples(handler=handler),
        CountSamplesPerShard(expected, handler),
    ]
    if training and config.shuffle_buffer > 1:
        stages.append(wds.shuffle(config.shuffle_buffer, initial=config.shuffle_buffer,
                                  rng=random.Random(f"samples-{config.seed}-{epoch}-{dp_rank}")))
    stages += [wds.map(decode), _drop_none]
    batch_size = config.batch_size if training else config.eval_batch_size
    # training drops the last partial batch so every step splits into equal micro-batches
    stages.append(wds.batched(batch_size, partial=not training, collation_fn=_collate))
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
