"""The image-shard format that the image preparers write and the AmoebaNet app reads.

On disk a dataset is one folder::

    dataset.json            {"name", "classes" (index order), "image_mode", "splits": {split:
                             {"images", "class_counts", "shards", "shard_images",
                             "shard_bytes", "image_exts"}}, ...extra keys}; written last, so its presence
                             means "complete"
    train-000000.tar ...    samples "<key>.png" (or .jpg, .jpeg, .webp: the encoded image file;
    test-000000.tar ...     or .npy: the image decoded once, a uint8 HxWxC array in NumPy's
                            format) + "<key>.cls" (the class index as decimal text)

Shards are USTAR tars with a fixed mtime (byte-identical when rebuilt), named
``<split>-NNNNNN.tar``; a folder of such shards without dataset.json is readable too (nothing
is checked then beyond readability). ``data/fashion_mnist/prepare.py`` and
``data/imagenet/prepare.py`` write it with ``write_split`` / ``write_dataset_json``;
``apps/amoebanet/data.py`` streams it. This module imports neither torch nor the app: a
script that only writes shards needs numpy, PIL and, while writing, webdataset's writer.

Encoded or decoded: PNG/JPEG keep shards small (ImageNet's) but cost a PIL decode per image
per epoch; ``.npy`` members (``encode_npy``) hold the pixels ready to use, which the reader
batches and augments with torch ops (small images such as Fashion-MNIST's: 784 bytes each).
A split's entry records which members it holds as ``"image_exts"``.
"""

from __future__ import annotations

import functools
import io
import json
import shutil
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

DATASET_JSON = "dataset.json"
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")  # members holding the image, in this order
DECODED_EXTENSION = "npy"  # the member holding a decoded uint8 HxWxC image
LABEL_EXTENSION = "cls"  # the member holding the class index


def shard_glob(split: str) -> str:
    """The file names of a split's shards, as a glob pattern (``train-*.tar``)."""
    return f"{split}-*.tar"


@dataclass(frozen=True)
class Sample:
    """One encoded image and its class index, as stored in a shard."""

    key: str  # unique within the split; no dots (webdataset splits keys at the first dot)
    image: bytes  # encoded image file (PNG, JPEG, ...)
    ext: str  # "png", "jpg", ...
    label: int


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an HxW (grayscale) or HxWx3 (RGB) uint8 array."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def encode_npy(pixels: np.ndarray) -> bytes:
    """``.npy`` bytes of an HxW (grayscale, stored as HxWx1) or HxWxC uint8 array."""
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3):
        raise ValueError(f"an image is a uint8 HxW or HxWxC array, got {pixels.dtype} "
                         f"{pixels.shape}")
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(pixels[:, :, None] if pixels.ndim == 2 else pixels),
            allow_pickle=False)
    return buffer.getvalue()


_NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=64)
def _npy_header(prefix: bytes) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """(shape, dtype, data offset) of a ``.npy`` header; cached, as a split's headers repeat."""
    file = io.BytesIO(prefix)
    version = np.lib.format.read_magic(file)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    shape, fortran_order, dtype = read(file, max_header_size=len(prefix))
    if fortran_order:
        raise ValueError("a Fortran-ordered array; write C-ordered (encode_npy does)")
    return tuple(shape), dtype, file.tell()


def decode_npy(data: bytes) -> np.ndarray:
    """The uint8 HxWxC image of ``.npy`` bytes, without a copy; ValueError when damaged.

    ``np.load`` parses each header with ``ast`` (44 us, as long as the rest of a 28x28
    image's trip); the headers of a split repeat, so they are parsed once.
    """
    if data[:6] != _NPY_MAGIC or len(data) < 12:
        raise ValueError(f"not a .npy array (starts with {data[:8]!r})")
    size_bytes = 2 if data[6] == 1 else 4  # header length: uint16 (version 1) or uint32
    end = 8 + size_bytes + int.from_bytes(data[8:8 + size_bytes], "little")
    shape, dtype, offset = _npy_header(bytes(data[:end]))
    if dtype != np.uint8 or len(shape) != 3:
        raise ValueError(f"a decoded image is a uint8 HxWxC array, got {dtype} {shape}")
    expected = int(np.prod(shape))
    if len(data) - offset != expected:
        raise ValueError(f"{len(data) - offset} bytes of pixels for shape {shape} "
                         f"({expected}): truncated or padded")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape)


def write_split(
    samples: Iterable[Sample],
    out_dir: str | Path,
    split: str,
    *,
    num_classes: int,
    max_per_shard: int = 5000,
) -> dict[str, Any]:
    """Write ``samples`` as ``<split>-NNNNNN.tar`` shards; return the split's dataset.json entry.

    Shards are written under a temporary name and renamed once complete, so an interrupted run
    never leaves a truncated ``.tar`` that looks finished.
    """
    import webdataset as wds  # imported here: it imports torch, which reading this module needs not

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob(shard_glob(split)), *out_dir.glob(f"{split}-*.tar.partial")]:
        stale.unlink()
    counts = [0] * num_classes
    exts: set[str] = set()
    images_per_shard: dict[int, int] = {}
    pattern = str(out_dir / f"{split}-%06d.tar.partial")
    # USTAR with a fixed integer mtime: no PAX header per member (halves the size of small-image
    # shards) and byte-identical shards when rebuilt
    with wds.ShardWriter(pattern, maxcount=max_per_shard, verbose=0, mtime=0,
                         format=tarfile.USTAR_FORMAT) as writer:
        for sample in samples:
            if not 0 <= sample.label < num_classes:
                raise ValueError(
                    f"sample {sample.key!r} has label {sample.label}, outside [0, {num_classes})"
                )
            if "." in sample.key:
                raise ValueError(f"sample key {sample.key!r} must not contain '.'")
            writer.write({"__key__": sample.key, sample.ext: sample.image,
                          LABEL_EXTENSION: sample.label})
            counts[sample.label] += 1
            exts.add(sample.ext)
            shard_index = writer.shard - 1  # ShardWriter has already advanced to the next name
            images_per_shard[shard_index] = images_per_shard.get(shard_index, 0) + 1
    shards, shard_bytes = [], []
    for index in sorted(images_per_shard):
        partial_path = Path(pattern % index)
        final = partial_path.with_suffix("")  # drop ".partial"
        partial_path.rename(final)
        shards.append(final.name)
        shard_bytes.append(final.stat().st_size)
    # per-shard sizes and counts let the reader detect truncated or damaged shards, which
    # Python's tarfile would otherwise read as a shorter archive without any error
    return {"images": sum(counts), "class_counts": counts, "shards": shards,
            "shard_images": [images_per_shard[i] for i in sorted(images_per_shard)],
            "shard_bytes": shard_bytes, "image_exts": sorted(exts)}


def write_dataset_json(
    out_dir: str | Path,
    *,
    name: str,
    classes: Sequence[str],
    image_mode: str,
    splits: dict[str, dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """Write dataset.json (class names in index order, per-split counts); return its content."""
    info = {"name": name, "classes": list(classes), "image_mode": image_mode, "splits": splits,
            **extra}
    path = Path(out_dir) / DATASET_JSON
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    tmp.rename(path)  # written last and atomically: its presence means the dataset is complete
    return info


def dataset_is_complete(out_dir: str | Path) -> bool:
    """True when dataset.json exists and every shard it lists is on disk."""
    out_dir = Path(out_dir)
    try:
        info = json.loads((out_dir / DATASET_JSON).read_text())
        return all(
            (out_dir / shard).is_file()
            for split in info["splits"].values()
            for shard in split["shards"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def remove_partial_files(out_dir: str | Path) -> None:
    """Delete leftovers of an interrupted write (``*.partial``)."""
    for path in Path(out_dir).glob("*.partial"):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
