"""Decoded (.npy) image shards and the batched torch augmentation that reads them.

Every transform is checked against a per-image reference (timm's own transforms on PIL images,
or torchvision's functional ops) where the draws are fixed; the loaders are checked to be
seeded, to name damaged images and to honour skip_corrupt_shards and data-parallel sharding;
a real 2-rank run stopped and resumed on decoded shards gives the same losses bit for bit.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image

from apps.amoebanet.data import (
    BatchTransform,
    CorruptShardError,
    build_eval_loader,
    build_train_loader,
    build_transform,
    color_jitter,
    resized_crop,
    sample_crop_boxes,
    shard_infos,
    split_is_decoded,
    to_channels,
)
from data.image_shards import (
    DATASET_JSON,
    Sample,
    decode_npy,
    encode_npy,
    write_dataset_json,
    write_split,
)
from tests.apps.test_amoebanet_data import (
    NUM_CLASSES,
    SHARD_SIZE,
    SIZES,
    config_for,
    decoded_ids,
    image_id_value,
)
from tests.apps.test_amoebanet_train import (
    CLASSES,
    TEST_IMAGES,
    TRAIN_IMAGES,
    losses,
    synthetic_samples,
    tiny_args,
    torchrun,
)


def flat_samples(split: str) -> list[Sample]:
    """test_amoebanet_data's flat images (one gray level per image id), decoded."""
    offset = 0 if split == "train" else SIZES["train"]
    return [Sample(key=f"{split}_{index:04d}", ext="npy", label=(offset + index) % NUM_CLASSES,
                   image=encode_npy(np.full((20, 20), image_id_value(offset + index), np.uint8)))
            for index in range(SIZES[split])]


@pytest.fixture
def npy_dir(tmp_path: Path) -> Path:
    out = tmp_path / "npy"
    splits = {split: write_split(flat_samples(split), out, split, num_classes=NUM_CLASSES,
                                 max_per_shard=SHARD_SIZE[split]) for split in SIZES}
    write_dataset_json(out, name="synthetic", classes=["a", "b", "c"], image_mode="L",
                       splits=splits)
    return out


def textured(count: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *shape), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# The format


def test_npy_members_round_trip_and_damage_is_named() -> None:
    gray, rgb = textured(1, (5, 7))[0], textured(1, (5, 7, 3))[0]
    np.testing.assert_array_equal(decode_npy(encode_npy(gray)), gray[:, :, None])
    np.testing.assert_array_equal(decode_npy(encode_npy(rgb)), rgb)
    data = encode_npy(rgb)
    with pytest.raises(ValueError, match="truncated or padded"):
        decode_npy(data[:-1])
    with pytest.raises(ValueError, match="not a .npy array"):
        decode_npy(b"\x89PNG" + data[4:])
    with pytest.raises(ValueError, match="uint8 HxWxC"):
        decode_npy(_npy(np.zeros((2, 2, 1))))
    with pytest.raises(ValueError, match="uint8 HxW"):
        encode_npy(np.zeros((2, 2), np.float32))


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_the_split_records_its_members_and_is_recognised(npy_dir: Path, tmp_path: Path) -> None:
    info = json.loads((npy_dir / DATASET_JSON).read_text())
    assert info["splits"]["train"]["image_exts"] == ["npy"]
    config = config_for(npy_dir)
    assert split_is_decoded(config, "train", shard_infos(config, "train"))
    (npy_dir / DATASET_JSON).unlink()  # no dataset.json: the first shard's members tell
    assert split_is_decoded(config, "test", shard_infos(config, "test"))
    png = tmp_path / "png"
    write_split([Sample("k0", _png(np.zeros((4, 4), np.uint8)), "png", 0)], png, "test",
                num_classes=1)
    png_config = config_for(png)
    assert not split_is_decoded(png_config, "test", shard_infos(png_config, "test"))


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# The batch transform against per-image references


@pytest.mark.parametrize("hflip", [0.0, 1.0])
def test_the_default_recipe_equals_timm_per_image(hflip: float) -> None:
    """crop_scale_min=1 on 28x28 (the CPU default): timm's crop is the whole image, so with the
    flip decided (p = 0 or 1) the batch transform must give timm's tensors exactly."""
    config = dataclasses.replace(config_for(Path("unused")), image_size=28, crop_scale_min=1.0,
                                 hflip=hflip, mean=(0.2860,), std=(0.3530,))
    images = textured(6, (28, 28))
    timm_train = build_transform(config, training=True)
    expected = torch.stack([timm_train(Image.fromarray(image)) for image in images])
    batch = BatchTransform.of(config, training=True)(torch.from_numpy(images[..., None]),
                                                     torch.Generator().manual_seed(0))
    assert torch.equal(batch, expected)
    timm_eval = build_transform(config, training=False)
    expected = torch.stack([timm_eval(Image.fromarray(image)) for image in images])
    assert torch.equal(BatchTransform.of(config, training=False)(
        torch.from_numpy(images[..., None])), expected)


def test_resized_crop_equals_interpolate_per_image() -> None:
    images = torch.from_numpy(textured(16, (3, 20, 24))).float() / 255
    boxes = sample_crop_boxes(16, 20, 24, scale=(0.1, 1.0),
                              generator=torch.Generator().manual_seed(3))
    for size in (12, 16, 32):  # down, down, up
        batch = resized_crop(images, boxes, size)
        for image, out, (top, left, height, width) in zip(images, batch, boxes.tolist(),
                                                          strict=True):
            crop = image[None, :, top:top + height, left:left + width]
            reference = F.interpolate(crop, size=(size, size), mode="bilinear",
                                      align_corners=False)[0]
            torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)


def test_crop_boxes_follow_timm_and_are_seeded() -> None:
    def draw(seed: int, scale: tuple[float, float] = (0.3, 1.0)) -> torch.Tensor:
        return sample_crop_boxes(4000, 28, 28, scale=scale,
                                 generator=torch.Generator().manual_seed(seed))

    boxes = draw(0)
    top, left, height, width = boxes.T
    assert torch.equal(boxes, draw(0)) and not torch.equal(boxes, draw(1))
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + height <= 28).all() and (left + width <= 28).all()
    area = (height * width).double() / 28**2
    assert area.min() >= 0.27 and area.max() <= 1.0  # 0.3 of the area, up to rounding
    aspect = width.double() / height
    assert aspect.min() >= 0.75 * 0.9 and aspect.max() <= 4 / 3 / 0.9
    # placement uniform over the feasible offsets: both ends reached, centred on average
    room = (28 - height).double()
    assert (top == 0).any() and (top == 28 - height)[room > 0].any()
    assert abs(float((top / room)[room > 0].mean()) - 0.5) < 0.03
    # scale 1 on a square image: timm's draws never fit except at ratio ~1; both give it whole
    assert torch.equal(draw(0, (1.0, 1.0)), torch.tensor([[0, 0, 28, 28]]).expand(4000, 4))


def test_color_jitter_equals_torchvision_per_image() -> None:
    images = torch.from_numpy(textured(8, (3, 10, 10))).float() / 255
    generator = torch.Generator().manual_seed(0)
    factors = 0.6 + 0.8 * torch.rand(8, 3, generator=generator)
    order = torch.rand(8, 3, generator=generator).argsort(dim=1)
    adjust = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation)
    for channels in (3, 1):
        batch_in = images if channels == 3 else images[:, :1]
        batch = color_jitter(batch_in, factors, order)
        for index, image in enumerate(batch_in):
            reference = image
            for kind in order[index].tolist():
                reference = adjust[kind](reference, float(factors[index, kind]))
            torch.testing.assert_close(batch[index], reference, rtol=0, atol=1e-6)
        assert not torch.equal(batch, batch_in)


def test_channels_convert_as_pil() -> None:
    rgb = textured(5, (6, 7, 3))
    luma = to_channels(torch.from_numpy(rgb).permute(0, 3, 1, 2), 1)
    expected = np.stack([np.asarray(Image.fromarray(image).convert("L")) for image in rgb])
    assert torch.equal(luma[:, 0], torch.from_numpy(expected))
    gray = torch.from_numpy(textured(2, (1, 4, 4)))
    assert torch.equal(to_channels(gray, 3), gray.expand(-1, 3, -1, -1))


def test_eval_resize_and_centre_crop_match_timm_up_to_rounding() -> None:
    """PIL rounds its resized pixels to uint8; the batch keeps floats: within 1/255."""
    config = dataclasses.replace(config_for(Path("unused")), in_chans=3, image_size=16,
                                 crop_pct=0.875, mean=(0.5,) * 3, std=(0.5,) * 3)
    images = textured(4, (20, 26, 3))
    timm_eval = build_transform(config, training=False)
    expected = torch.stack([timm_eval(Image.fromarray(image)) for image in images])
    batch = BatchTransform.of(config, training=False)(torch.from_numpy(images))
    assert batch.shape == expected.shape == (4, 3, 16, 16)
    torch.testing.assert_close(batch, expected, rtol=0, atol=1.01 / 255 / 0.5)


def test_auto_augment_on_decoded_shards_is_refused_with_the_fix(npy_dir: Path) -> None:
    with pytest.raises(ValueError, match="--image-format png"):
        build_train_loader(config_for(npy_dir, auto_augment="rand-m9-mstd0.5"))


# ---------------------------------------------------------------------------------------------
# The loaders on decoded shards


def test_decoded_loaders_keep_labels_order_and_coverage(npy_dir: Path) -> None:
    config = config_for(npy_dir, crop_scale_min=0.5)
    batches = list(build_train_loader(config))
    assert len(batches) == SIZES["train"] // config.batch_size
    for images, labels in batches:
        assert images.shape == (4, 1, 16, 16) and images.dtype == torch.float32
        for image_id, label in zip(decoded_ids(images), labels.tolist(), strict=True):
            assert label == image_id % NUM_CLASSES  # flat images: crops keep the gray level
    ids = [i for images, _ in batches for i in decoded_ids(images)]
    assert len(set(ids)) == len(ids) and ids != sorted(ids)
    for num_workers in (0, 2):
        seen = [i for images, labels in build_eval_loader(config_for(npy_dir,
                                                                     num_workers=num_workers))
                for i in decoded_ids(images)]
        assert sorted(seen) == list(range(SIZES["train"], SIZES["train"] + SIZES["test"]))
    per_rank = [[i for images, _ in build_eval_loader(config, dp_rank=rank, dp_size=2)
                 for i in decoded_ids(images)] for rank in range(2)]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(seen)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_decoded_augmentation_is_seeded_in_any_process(tmp_path: Path, num_workers: int) -> None:
    samples = [Sample(f"k{i}", encode_npy(image), "npy", i % NUM_CLASSES)
               for i, image in enumerate(textured(16, (20, 20)))]
    split = write_split(samples, tmp_path, "train", num_classes=NUM_CLASSES, max_per_shard=4)
    write_dataset_json(tmp_path, name="texture", classes=["a", "b", "c"], image_mode="L",
                       splits={"train": split})
    config = config_for(tmp_path, num_workers=num_workers, crop_scale_min=0.3, color_jitter=0.4)

    def run(seed: int, **changes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(seed)  # the caller's RNG state must not matter
        np.random.seed(seed)
        return list(build_train_loader(config, **changes))

    first, second = run(1), run(2)
    assert len(first) == len(second) == 4
    for (images_a, labels_a), (images_b, labels_b) in zip(first, second, strict=True):
        assert torch.equal(labels_a, labels_b) and torch.equal(images_a, images_b)
    for other in (run(1, epoch=1), run(1, dp_rank=1)):  # another epoch, another replica
        assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(first, other, strict=True))


def _break_first_npy(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = data.index(b"\x93NUMPY")
    data[start:start + 6] = b"broken"
    path.write_bytes(bytes(data))


def test_a_damaged_decoded_image_is_named_or_skipped(npy_dir: Path) -> None:
    _break_first_npy(npy_dir / "test-000000.tar")
    with pytest.raises(CorruptShardError, match=r"'test_0000' in shard .*test-000000.tar"):
        list(build_eval_loader(config_for(npy_dir)))
    with pytest.warns(UserWarning, match="test_0000"):
        batches = list(build_eval_loader(config_for(npy_dir, skip_corrupt_shards=True)))
    assert sum(len(labels) for _, labels in batches) == SIZES["test"] - 1


def test_a_truncated_decoded_shard_is_named_or_skipped(npy_dir: Path) -> None:
    path = npy_dir / "test-000001.tar"
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[4].offset
    path.write_bytes(path.read_bytes()[:cut + 700])
    with pytest.raises(CorruptShardError, match="test-000001.tar"):
        list(build_eval_loader(config_for(npy_dir)))
    with pytest.warns(UserWarning, match="test-000001.tar"):
        batches = list(build_eval_loader(config_for(npy_dir, skip_corrupt_shards=True)))
    assert SIZES["test"] - 5 <= sum(len(labels) for _, labels in batches) < SIZES["test"]


# ---------------------------------------------------------------------------------------------
# The real loop: stop and resume on decoded shards, bit for bit


@pytest.fixture(scope="module")
def npy_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The train test's synthetic images (same pixels), stored decoded."""
    def decoded(split: str, count: int, seed: int) -> list[Sample]:
        return [Sample(s.key, encode_npy(np.asarray(Image.open(io.BytesIO(s.image)))), "npy",
                       s.label) for s in synthetic_samples(split, count, seed)]

    out = tmp_path_factory.mktemp("npy_shards")
    splits = {"train": write_split(decoded("train", TRAIN_IMAGES, 0), out, "train",
                                   num_classes=len(CLASSES), max_per_shard=16),
              "test": write_split(decoded("test", TEST_IMAGES, 1), out, "test",
                                  num_classes=len(CLASSES), max_per_shard=12)}
    write_dataset_json(out, name="synthetic", classes=CLASSES, image_mode="L", splits=splits)
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_training_on_decoded_shards_resumes_exactly(npy_shards: Path, tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    # crops, flips, jitter, mixup and a worker: every draw the resumed run must repeat
    changes = {"color_jitter": 0.3, "crop_scale_min": 0.5}
    output = torchrun(tiny_args(npy_shards, straight, **changes))
    assert "test top-1:" in output
    torchrun(tiny_args(npy_shards, halves, stop_at_step=7, **changes))
    torchrun(tiny_args(npy_shards, halves, **changes) + ["--resume"])
    assert losses(halves) == losses(straight)
    assert len(losses(straight)) == 2 * TRAIN_IMAGES // 8


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST's preparer writes either format (the Debian package replaced by IDX files)


def test_fashion_mnist_prepares_decoded_or_png_and_rebuilds_on_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from data.fashion_mnist import prepare as fashion

    idx_dir = tmp_path / "idx"
    idx_dir.mkdir()
    arrays = {"train": textured(30, (28, 28), seed=1), "test": textured(10, (28, 28), seed=2)}
    for split, (images_name, labels_name) in fashion.IDX_FILES.items():
        images = arrays[split]
        header = np.array([fashion.IDX_IMAGES_MAGIC, len(images), 28, 28], ">i4").tobytes()
        (idx_dir / images_name).write_bytes(gzip.compress(header + images.tobytes()))
        labels = np.arange(len(images), dtype=np.uint8) % 10
        header = np.array([fashion.IDX_LABELS_MAGIC, len(images)], ">i4").tobytes()
        (idx_dir / labels_name).write_bytes(gzip.compress(header + labels.tobytes()))
    monkeypatch.setattr(fashion, "download_deb", lambda _dir: tmp_path / "unused.deb")
    monkeypatch.setattr(fashion, "extract_deb", lambda _deb, _into: idx_dir)

    out = tmp_path / "fmnist"
    info = fashion.prepare(out, val_size=5, max_per_shard=10)
    assert info["image_format"] == "npy" and info["splits"]["test"]["image_exts"] == ["npy"]
    config = config_for(out, dataset="fashion_mnist", num_classes=10, image_size=28,
                        mean=(0.0,), std=(1.0,), eval_batch_size=10)
    images, labels = next(iter(build_eval_loader(config)))
    assert torch.equal(images[:, 0], torch.from_numpy(arrays["test"]).float() / 255)
    assert labels.tolist() == list(range(10))

    info = fashion.prepare(out, val_size=5, max_per_shard=10, image_format="png")  # rebuilt
    assert info["image_format"] == "png" and info["splits"]["test"]["image_exts"] == ["png"]
    png_images, _ = next(iter(build_eval_loader(config)))
    assert torch.equal(png_images, images)  # the same pixels either way
