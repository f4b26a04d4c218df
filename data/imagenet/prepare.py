"""An ImageNet-style image folder (``<split>/<class>/<image>``) to webdataset shards.

    python -m data.imagenet.prepare --src /data/imagenet --out .cache/imagenet

``--src`` holds one folder per split (``train/``, ``val/``), each with one folder per class
(``n01440764/...jpeg``). Image files are stored as they are (no re-encoding); the training split
is shuffled with a seed before sharding, because the loader's shuffle buffer only mixes nearby
samples. ``dataset.json`` lists the classes in index order (sorted folder names of the first
split) with per-split counts. A finished dataset is left alone unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from data.image_shards import (
    DATASET_JSON,
    Sample,
    dataset_is_complete,
    remove_partial_files,
    write_dataset_json,
    write_split,
)

# File suffix -> webdataset member extension the loader decodes.
EXTENSIONS = {".jpeg": "jpg", ".jpg": "jpg", ".png": "png", ".webp": "webp"}


def list_images(split_dir: Path) -> dict[str, list[Path]]:
    """Images per class folder of one split (class name -> sorted image paths)."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"{split_dir} does not exist; expected <src>/<split>/<class>/")
    classes = {}
    for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        images = sorted(p for p in class_dir.iterdir() if p.suffix.lower() in EXTENSIONS)
        if images:
            classes[class_dir.name] = images
    if not classes:
        raise FileNotFoundError(
            f"no images ({', '.join(EXTENSIONS)}) in class folders under {split_dir}"
        )
    return classes


def _samples(items: Sequence[tuple[Path, int]], split: str) -> Iterator[Sample]:
    for index, (path, label) in enumerate(items):
        yield Sample(key=f"{split}_{index:08d}", image=path.read_bytes(),
                     ext=EXTENSIONS[path.suffix.lower()], label=label)


def prepare(
    src: str | Path,
    out_dir: str | Path = ".cache/imagenet",
    *,
    splits: Sequence[str] = ("train", "val"),
    max_per_shard: int = 1000,
    seed: int = 0,
    force: bool = False,
) -> dict[str, Any]:
    """Convert ``src/<split>/<class>/*`` into shards in ``out_dir``; return dataset.json."""
    src, out_dir = Path(src), Path(out_dir)
    if dataset_is_complete(out_dir) and not force:
        print(f"{out_dir} already holds shards ({DATASET_JSON}); --force rebuilds")
        return dict(json.loads((out_dir / DATASET_JSON).read_text()))
    start = time.perf_counter()
    found = [s for s in splits if (src / s).is_dir()]
    if not found:
        raise FileNotFoundError(f"none of the splits {list(splits)} exists as a folder in {src}")
    per_split = {split: list_images(src / split) for split in found}
    classes = sorted(per_split[found[0]])
    index_of = {name: index for index, name in enumerate(classes)}
    for split, by_class in per_split.items():
        unknown = sorted(set(by_class) - set(index_of))
        if unknown:
            raise ValueError(
                f"{src / split} has class folders {unknown[:5]} (of {len(unknown)}) that "
                f"{src / found[0]} lacks; every split must use the same classes"
            )

    out_dir.mkdir(parents=True, exist_ok=True)
    remove_partial_files(out_dir)
    (out_dir / DATASET_JSON).unlink(missing_ok=True)
    written: dict[str, dict[str, Any]] = {}
    for split, by_class in per_split.items():
        items = [(path, index_of[name]) for name, paths in by_class.items() for path in paths]
        if split == "train":
            random.Random(seed).shuffle(items)
        written[split] = write_split(_samples(items, split), out_dir, split,
                                     num_classes=len(classes), max_per_shard=max_per_shard)
        print(f"{split}: {written[split]['images']} images in {len(written[split]['shards'])} "
              f"shard(s)")
    info = write_dataset_json(
        out_dir,
        name=out_dir.name,
        classes=classes,
        image_mode="RGB",
        splits=written,
        source=str(src.resolve()),
        seconds_to_prepare=round(time.perf_counter() - start, 1),
    )
    print(f"wrote {out_dir / DATASET_JSON} ({len(classes)} classes) in "
          f"{info['seconds_to_prepare']} s")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="folder with <split>/<class>/<image>")
    parser.add_argument("--out", default=".cache/imagenet", help="output folder")
    parser.add_argument("--splits", default="train,val", help="comma-separated split folders")
    parser.add_argument("--max-per-shard", type=int, default=1000, help="images per shard")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train shuffle")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    prepare(args.src, args.out, splits=[s for s in args.splits.split(",") if s],
            max_per_shard=args.max_per_shard, seed=args.seed, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
