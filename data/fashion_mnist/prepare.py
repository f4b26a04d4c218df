"""Fashion-MNIST from Debian's dataset-fashion-mnist package to webdataset shards.

    python -m data.fashion_mnist.prepare --out .cache/fashion_mnist

Steps: ``apt-get download dataset-fashion-mnist`` into ``<out>/download`` (``apt-get update``
once if the package index lacks it), ``dpkg-deb -x`` there (nothing is installed system-wide),
parse the four IDX files, and write image + class-index shards for ``train`` (minus a
held-out ``val``), ``val`` and ``test``, plus ``dataset.json`` (class names, counts). Images
are stored decoded (``--image-format npy``, the default: uint8 28x28x1 arrays, which the app
batches and augments with torch ops) or as PNG (``--image-format png``: decoded by PIL and
transformed by timm per image, as before 2027-01). A finished dataset in the asked format is
left alone unless ``--force``; the downloaded .deb is reused.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data.image_shards import (
    DATASET_JSON,
    Sample,
    dataset_is_complete,
    encode_npy,
    encode_png,
    remove_partial_files,
    write_dataset_json,
    write_split,
)

PACKAGE = "dataset-fashion-mnist"
IDX_DIR = Path("usr/share/datasets/fashion-mnist")  # inside the .deb
IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IDX_IMAGES_MAGIC = 2051  # big-endian int32 at the start of an IDX3 uint8 image file
IDX_LABELS_MAGIC = 2049
IMAGE_FORMATS = {"npy": encode_npy, "png": encode_png}  # --image-format: the member's encoder


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def download_deb(download_dir: Path) -> Path:
    """The package's .deb in ``download_dir``, fetched with ``apt-get download`` if absent."""
    download_dir = download_dir.resolve()
    download_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(download_dir.glob(f"{PACKAGE}_*.deb"))
    if existing:
        return existing[-1]
    result = _run(["apt-get", "download", PACKAGE], download_dir)
    if result.returncode != 0:
        # a fresh machine may have no package index yet: update it once and retry
        update = _run(["apt-get", "update"], download_dir)
        result = _run(["apt-get", "download", PACKAGE], download_dir)
        if result.returncode != 0:
            raise RuntimeError(
                f"`apt-get download {PACKAGE}` failed in {download_dir} (exit "
                f"{result.returncode}): {result.stderr.strip()[-500:]}\n`apt-get update` said: "
                f"{update.stderr.strip()[-300:]}\nNeeds a Debian/Ubuntu apt source carrying "
                f"{PACKAGE}; or put the .deb into {download_dir} yourself and rerun."
            )
    existing = sorted(download_dir.glob(f"{PACKAGE}_*.deb"))
    if not existing:
        raise RuntimeError(f"apt-get download succeeded but no {PACKAGE}_*.deb in {download_dir}")
    return existing[-1]


def extract_deb(deb: Path, into: Path) -> Path:
    """``dpkg-deb -x`` the package into ``into``; return the folder holding the IDX files."""
    deb, into = deb.resolve(), into.resolve()
    idx_dir = into / IDX_DIR
    if not all((idx_dir / name).is_file() for pair in IDX_FILES.values() for name in pair):
        result = _run(["dpkg-deb", "-x", str(deb), str(into)], into.parent)
        if result.returncode != 0:
            raise RuntimeError(f"`dpkg-deb -x {deb} {into}` failed: {result.stderr.strip()}; "
                               f"delete {deb} to download it again")
    return idx_dir


def read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file (gzip) as a uint8 array: [N, rows, cols] for images, [N] for labels."""
    data = gzip.decompress(path.read_bytes())
    header = np.frombuffer(data, dtype=">i4", count=1)[0]
    if header != magic:
        raise ValueError(f"{path}: IDX magic {header}, expected {magic}; the file is corrupt")
    ndim = magic & 0xFF  # the magic's last byte is the number of dimensions
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    pixels = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if pixels.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {pixels.size} bytes of data for shape {shape}; truncated file")
    return pixels.reshape(shape)


def _samples(prefix: str, images: np.ndarray, labels: np.ndarray,
             indices: np.ndarray, image_format: str) -> Iterator[Sample]:
    encode = IMAGE_FORMATS[image_format]
    for index in indices:
        # the key keeps the image's index in the original IDX file
        yield Sample(key=f"{prefix}_{index:05d}", image=encode(images[index]), ext=image_format,
                     label=int(labels[index]))


def _image_format_of(out_dir: Path) -> str:
    """The image format of a complete dataset (datasets written before the choice: PNG)."""
    info = json.loads((out_dir / DATASET_JSON).read_text())
    return str(info.get("image_format", "png"))


def prepare(
    out_dir: str | Path = ".cache/fashion_mnist",
    *,
    val_size: int = 5000,
    max_per_shard: int = 5000,
    seed: int = 0,
    image_format: str = "npy",
    force: bool = False,
) -> dict[str, Any]:
    """Build the Fashion-MNIST shards in ``out_dir``; return dataset.json's content.

    ``val_size`` train images (a seeded random choice) go to the ``val`` split instead of
    ``train``; ``test`` is the official 10,000-image test set. ``image_format`` is ``"npy"``
    (decoded uint8 arrays) or ``"png"``; a complete dataset in the other format is rebuilt.
    """
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image_format={image_format!r} is not one of {sorted(IMAGE_FORMATS)}")
    out_dir = Path(out_dir).resolve()  # subprocesses run with other working directories
    if dataset_is_complete(out_dir) and not force:
        existing = _image_format_of(out_dir)
        if existing == image_format:
            print(f"{out_dir} already holds Fashion-MNIST shards ({DATASET_JSON}); --force "
                  f"rebuilds")
            return dict(json.loads((out_dir / DATASET_JSON).read_text()))
        print(f"{out_dir} holds {existing} shards; rebuilding them as {image_format}")
    if not 0 <= val_size < 60000:
        raise ValueError(f"val_size={val_size} must be in [0, 60000)")
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_partial_files(out_dir)
    (out_dir / DATASET_JSON).unlink(missing_ok=True)  # the dataset is incomplete until rewritten
    deb = download_deb(out_dir / "download")
    idx_dir = extract_deb(deb, out_dir / "download" / "extracted")

    arrays = {
        split: (read_idx(idx_dir / images, IDX_IMAGES_MAGIC),
                read_idx(idx_dir / labels, IDX_LABELS_MAGIC))
        for split, (images, labels) in IDX_FILES.items()
    }
    train_images, train_labels = arrays["train"]
    test_images, test_labels = arrays["test"]
    order = np.random.default_rng(seed).permutation(len(train_images))
    val_indices = np.sort(order[:val_size])
    train_indices = np.sort(order[val_size:])

    plan = {"train": ("train", train_images, train_labels, train_indices),
            "val": ("train", train_images, train_labels, val_indices),
            "test": ("test", test_images, test_labels, np.arange(len(test_images)))}
    splits: dict[str, dict[str, Any]] = {}
    for split, (prefix, images, labels, indices) in plan.items():
        if len(indices) == 0:
            continue
        splits[split] = write_split(_samples(prefix, images, labels, indices, image_format),
                                    out_dir, split,
                                    num_classes=len(CLASSES), max_per_shard=max_per_shard)
        print(f"{split}: {splits[split]['images']} images in {len(splits[split]['shards'])} "
              f"shard(s)")
    # mean/std without a float64 copy of the whole split: E[x], E[x^2] - E[x]^2
    pixels = train_images[train_indices]
    mean = float(pixels.mean(dtype=np.float64)) / 255.0
    std = float(np.sqrt(np.square(pixels, dtype=np.float32).mean(dtype=np.float64)
                        / 255.0**2 - mean**2))
    info = write_dataset_json(
        out_dir,
        name="fashion_mnist",
        classes=CLASSES,
        image_mode="L",
        image_size=[28, 28],
        image_format=image_format,
        splits=splits,
        # normalisation constants of the train split (the config's mean/std defaults)
        mean=[round(mean, 4)],
        std=[round(std, 4)],
        source=f"Debian package {deb.name}",
        seconds_to_prepare=round(time.perf_counter() - start, 1),
    )
    print(f"wrote {out_dir / DATASET_JSON} in {info['seconds_to_prepare']} s")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".cache/fashion_mnist", help="output folder")
    parser.add_argument("--val-size", type=int, default=5000,
                        help="train images held out as the val split (0 = none)")
    parser.add_argument("--max-per-shard", type=int, default=5000, help="images per shard")
    parser.add_argument("--seed", type=int, default=0, help="seed of the val split choice")
    parser.add_argument("--image-format", choices=sorted(IMAGE_FORMATS), default="npy",
                        help="npy: decoded uint8 arrays (batched torch augmentation); png: "
                             "PNG files (per-image PIL decode and timm transforms)")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    prepare(args.out, val_size=args.val_size, max_per_shard=args.max_per_shard, seed=args.seed,
            image_format=args.image_format, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
