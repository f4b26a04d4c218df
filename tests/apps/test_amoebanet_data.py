"""AmoebaNet data: shards written by our writer, read back through webdataset and timm."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn

from apps.amoebanet.config import AmoebaNetConfig, build_model
from apps.amoebanet.data import (
    CorruptShardError,
    DatasetNotFoundError,
    build_eval_loader,
    build_train_loader,
)
from apps.amoebanet.loss import build_train_loss
from data.fashion_mnist.prepare import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx
from data.image_shards import (
    DATASET_JSON,
    Sample,
    dataset_is_complete,
    encode_png,
    write_dataset_json,
    write_split,
)
from data.imagenet.prepare import prepare as prepare_image_folder

NUM_CLASSES = 3
SIZES = {"train": 26, "test": 13}
SHARD_SIZE = {"train": 7, "test": 5}  # train: 4 shards (7+7+7+5), test: 3 shards (5+5+3)
MEAN, STD = 0.5, 0.5


def image_id_value(image_id: int) -> int:
    """Every image is one flat gray level, unique per image, so a batch reveals which it holds."""
    return 5 + 4 * image_id


def make_samples(split: str) -> Iterator[Sample]:
    offset = 0 if split == "train" else SIZES["train"]
    for index in range(SIZES[split]):
        image_id = offset + index
        pixels = np.full((20, 20), image_id_value(image_id), dtype=np.uint8)
        yield Sample(key=f"{split}_{index:04d}", image=encode_png(pixels), ext="png",
                     label=image_id % NUM_CLASSES)


def decoded_ids(images: torch.Tensor) -> list[int]:
    """Image ids back from normalised, flat images (eval transform keeps them flat)."""
    levels = (images.mean(dim=(1, 2, 3)) * STD + MEAN) * 255
    return [(round(level) - 5) // 4 for level in levels.tolist()]


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    out = tmp_path / "shards"
    splits = {split: write_split(make_samples(split), out, split, num_classes=NUM_CLASSES,
                                 max_per_shard=SHARD_SIZE[split]) for split in SIZES}
    write_dataset_json(out, name="synthetic", classes=["a", "b", "c"], image_mode="L",
                       splits=splits)
    return out


def config_for(data_dir: Path, **overrides: object) -> AmoebaNetConfig:
    config = AmoebaNetConfig(
        dataset="shards", data_dir=str(data_dir), num_classes=NUM_CLASSES, in_chans=1,
        image_size=16, batch_size=4, eval_batch_size=4, num_workers=0, shuffle_buffer=8,
        mean=(MEAN,), std=(STD,), label_smoothing=0.0, num_normal_cells=3, filters=8,
    )
    return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]


def test_writer_output_and_dataset_json(shard_dir: Path) -> None:
    info = json.loads((shard_dir / DATASET_JSON).read_text())
    assert info["classes"] == ["a", "b", "c"]
    assert info["splits"]["train"]["images"] == SIZES["train"]
    assert info["splits"]["train"]["shards"] == [f"train-{i:06d}.tar" for i in range(4)]
    assert info["splits"]["test"]["class_counts"] == [4, 4, 5]
    assert not list(shard_dir.glob("*.partial"))
    assert dataset_is_complete(shard_dir)


def test_train_loader_batches_labels_and_transforms(shard_dir: Path) -> None:
    config = config_for(shard_dir)
    batches = list(build_train_loader(config))
    assert len(batches) == SIZES["train"] // config.batch_size  # last partial batch dropped
    for images, labels in batches:
        assert images.shape == (4, 1, 16, 16) and images.dtype == torch.float32
        assert labels.dtype == torch.int64
        for image_id, label in zip(decoded_ids(images), labels.tolist(), strict=True):
            assert label == image_id % NUM_CLASSES  # the label travels with its image
    ids = [i for images, _ in batches for i in decoded_ids(images)]
    assert len(set(ids)) == len(ids)
    assert ids != sorted(ids), "training order should be shuffled"
    model = build_model(config)
    assert model(batches[0][0]).shape == (4, NUM_CLASSES)


def test_train_order_is_deterministic_per_seed_and_epoch(shard_dir: Path) -> None:
    def order(**overrides: int) -> list[int]:
        config = config_for(shard_dir, **{k: v for k, v in overrides.items() if k != "epoch"})
        loader = build_train_loader(config, epoch=overrides.get("epoch", 0))
        return [i for images, _ in loader for i in decoded_ids(images)]

    assert order() == order()
    assert order() != order(epoch=1)
    assert order() != order(seed=1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_eval_loader_sees_every_image_exactly_once(shard_dir: Path, num_workers: int) -> None:
    config = config_for(shard_dir, num_workers=num_workers)
    seen: list[int] = []
    for images, labels in build_eval_loader(config):
        ids = decoded_ids(images)
        assert labels.tolist() == [i % NUM_CLASSES for i in ids]
        seen += ids
    assert sorted(seen) == list(range(SIZES["train"], SIZES["train"] + SIZES["test"]))


def test_data_parallel_replicas_split_the_eval_set(shard_dir: Path) -> None:
    config = config_for(shard_dir)
    per_rank = [[i for images, _ in build_eval_loader(config, dp_rank=rank, dp_size=2)
                 for i in decoded_ids(images)] for rank in range(2)]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(SIZES["train"],
                                                           SIZES["train"] + SIZES["test"]))
    with pytest.raises(ValueError, match="cannot feed 4 data-parallel replicas"):
        build_eval_loader(config, dp_rank=0, dp_size=4)


def test_augmented_batches_from_workers_are_reproducible(tmp_path: Path) -> None:
    # textured images, so random crops and flips change pixels; two processes building the same
    # loader (first and last pipeline stage) must get identical batches
    rng = np.random.default_rng(0)
    samples = [Sample(key=f"k{i}", image=encode_png(rng.integers(0, 255, (20, 20), np.uint8)),
                      ext="png", label=i % NUM_CLASSES) for i in range(16)]
    split = write_split(samples, tmp_path, "train", num_classes=NUM_CLASSES, max_per_shard=4)
    write_dataset_json(tmp_path, name="texture", classes=["a", "b", "c"], image_mode="L",
                       splits={"train": split})
    config = config_for(tmp_path, num_workers=2, crop_scale_min=0.3)

    def run(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(seed)  # the caller's RNG state must not matter
        return list(build_train_loader(config))

    first, second = run(1), run(2)
    assert len(first) == len(second) == 4
    for (images_a, labels_a), (images_b, labels_b) in zip(first, second, strict=True):
        assert torch.equal(labels_a, labels_b)
        torch.testing.assert_close(images_a, images_b)
    other = list(build_train_loader(config, epoch=1))
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(first, other, strict=True))


def test_mixup_gives_seeded_soft_targets_and_the_matching_loss(shard_dir: Path) -> None:
    config = config_for(shard_dir, mixup=0.8, cutmix=1.0, label_smoothing=0.1)
    assert isinstance(build_train_loss(config), SoftTargetCrossEntropy)
    first = [targets for _, targets in build_train_loader(config)]
    second = [targets for _, targets in build_train_loader(config)]
    for a, b in zip(first, second, strict=True):
        assert a.shape == (4, NUM_CLASSES) and a.dtype == torch.float32
        torch.testing.assert_close(a.sum(dim=1), torch.ones(4))
        torch.testing.assert_close(a, b)
    smoothing = config_for(shard_dir, label_smoothing=0.1)
    assert isinstance(build_train_loss(smoothing), LabelSmoothingCrossEntropy)
    assert isinstance(build_train_loss(config_for(shard_dir)), nn.CrossEntropyLoss)


def test_rgb_images_load_as_one_or_three_channels(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [Sample(key=f"k{i}", image=encode_png(rng.integers(0, 255, (12, 10, 3), np.uint8)),
                      ext="png", label=i % 2) for i in range(5)]
    split = write_split(samples, tmp_path, "test", num_classes=2, max_per_shard=10)
    write_dataset_json(tmp_path, name="rgb", classes=["x", "y"], image_mode="RGB",
                       splits={"test": split})
    for in_chans in (1, 3):
        config = config_for(tmp_path, num_classes=2, in_chans=in_chans, image_size=12,
                            mean=(0.5,) * in_chans, std=(0.5,) * in_chans)
        images, labels = next(iter(build_eval_loader(config)))
        assert images.shape == (4, in_chans, 12, 12)
        assert labels.tolist() == [0, 1, 0, 1]


def corrupt_by_truncation(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])


def test_truncated_shard_is_named_or_skipped(shard_dir: Path) -> None:
    corrupt_by_truncation(shard_dir / "test-000001.tar")
    with pytest.raises(CorruptShardError, match="test-000001.tar"):
        list(build_eval_loader(config_for(shard_dir)))
    with pytest.warns(UserWarning, match="test-000001.tar"):
        batches = list(build_eval_loader(config_for(shard_dir, skip_corrupt_shards=True)))
    count = sum(len(labels) for _, labels in batches)
    assert SIZES["test"] - 5 <= count < SIZES["test"]


def test_damaged_header_is_caught_by_the_sample_count(shard_dir: Path) -> None:
    # same size, but the third sample's first tar header is garbage: tarfile just stops there
    path = shard_dir / "test-000000.tar"
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[4].offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 512] = b"\xff" * 512
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"test-000000.tar: read 2 samples, 5 when"):
        list(build_eval_loader(config_for(shard_dir)))
    with pytest.warns(UserWarning, match="test-000000.tar"):
        list(build_eval_loader(config_for(shard_dir, skip_corrupt_shards=True)))


def test_garbage_shard_is_named_in_a_worker_too(shard_dir: Path) -> None:
    (shard_dir / "test-000002.tar").write_bytes(b"this is not a tar file" * 50)
    with pytest.raises(Exception, match="test-000002.tar") as info:
        list(build_eval_loader(config_for(shard_dir, num_workers=1)))
    assert "skip_corrupt_shards" in str(info.value)


def test_corrupt_image_names_sample_and_shard(shard_dir: Path) -> None:
    path = shard_dir / "test-000000.tar"
    data = bytearray(path.read_bytes())
    start = data.index(b"\x89PNG")  # the first image's bytes: break its PNG signature
    data[start:start + 8] = b"garbage!"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=r"'test_0000' in shard .*test-000000.tar"):
        list(build_eval_loader(config_for(shard_dir)))
    with pytest.warns(UserWarning, match="test_0000"):
        batches = list(build_eval_loader(config_for(shard_dir, skip_corrupt_shards=True)))
    assert sum(len(labels) for _, labels in batches) == SIZES["test"] - 1


def test_missing_dataset_says_which_command_builds_it(tmp_path: Path) -> None:
    empty = tmp_path / "nothing_here"
    config = config_for(empty, dataset="fashion_mnist", num_classes=10)
    with pytest.raises(DatasetNotFoundError,
                       match=f"python -m data.fashion_mnist.prepare --out {empty}"):
        build_train_loader(config)
    with pytest.raises(DatasetNotFoundError, match="data.imagenet.prepare"):
        build_eval_loader(config_for(empty, dataset="imagenet"))
    with pytest.raises(DatasetNotFoundError, match="no test-\\*.tar shards"):
        build_eval_loader(config_for(empty))


def test_missing_split_and_class_mismatch(shard_dir: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="split 'val' not in"):
        build_eval_loader(config_for(shard_dir), "val")
    with pytest.raises(ValueError, match="has 3 classes but num_classes=10"):
        build_eval_loader(config_for(shard_dir, num_classes=10))
    os.remove(shard_dir / "train-000002.tar")
    assert not dataset_is_complete(shard_dir)
    with pytest.raises(DatasetNotFoundError, match="train-000002.tar"):
        build_train_loader(config_for(shard_dir))


def test_image_folder_to_shards_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "folder"
    classes = ["n02", "n01", "n03"]  # class indices follow the sorted folder names
    counts = {"train": [3, 2, 4], "val": [1, 2, 1]}
    rng = np.random.default_rng(0)
    for split, per_class in counts.items():
        for name, count in zip(classes, per_class, strict=True):
            (src / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 255, (24, 30, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(src / split / name / f"img{i}.JPEG")
    out = tmp_path / "shards"
    info = prepare_image_folder(src, out, max_per_shard=4)
    assert info["classes"] == ["n01", "n02", "n03"]
    assert info["splits"]["train"]["class_counts"] == [2, 3, 4]
    assert info["splits"]["train"]["shards"] == ["train-000000.tar", "train-000001.tar",
                                                 "train-000002.tar"]
    assert info["splits"]["val"]["class_counts"] == [2, 1, 1]

    config = config_for(out, dataset="imagenet", in_chans=3, image_size=16, crop_pct=0.875,
                        mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), eval_split="val")
    labels = torch.cat([labels for _, labels in build_eval_loader(config)])
    assert labels.bincount(minlength=3).tolist() == [2, 1, 1]
    images, _ = next(iter(build_train_loader(config)))
    assert images.shape == (4, 3, 16, 16)

    stamp = (out / "train-000000.tar").stat().st_mtime_ns
    prepare_image_folder(src, out, max_per_shard=4)  # idempotent: nothing rewritten
    assert (out / "train-000000.tar").stat().st_mtime_ns == stamp

    (src / "val" / "n99").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / "val" / "n99" / "x.jpeg")
    with pytest.raises(ValueError, match=r"class folders \['n99'\]"):
        prepare_image_folder(src, tmp_path / "other")


def test_idx_parser_reads_and_rejects(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = np.array([IDX_IMAGES_MAGIC, 2, 3, 4], dtype=">i4").tobytes()
    path = tmp_path / "images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + images.tobytes()))
    np.testing.assert_array_equal(read_idx(path, IDX_IMAGES_MAGIC), images)
    with pytest.raises(ValueError, match="IDX magic 2051, expected 2049"):
        read_idx(path, IDX_LABELS_MAGIC)
    path.write_bytes(gzip.compress(header + images.tobytes()[:-3]))
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path, IDX_IMAGES_MAGIC)


def test_truncated_shard_without_dataset_json_is_named(shard_dir: Path) -> None:
    # no sizes or counts to compare with: a tar cut between two members reads as a shorter
    # archive without any error (the shard would lose its last samples silently)
    (shard_dir / "dataset.json").unlink()
    complete = sum(len(labels) for _, labels in build_eval_loader(config_for(shard_dir)))
    assert complete == SIZES["test"]
    path = shard_dir / "test-000001.tar"
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[6].offset  # after three whole samples (.png + .cls each)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(CorruptShardError, match=r"test-000001.tar: \d+ bytes, not ending in a "
                       "tar archive's end-of-archive blocks"):
        list(build_eval_loader(config_for(shard_dir)))
