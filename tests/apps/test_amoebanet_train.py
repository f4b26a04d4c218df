"""AmoebaNet training end to end: the real loop under torchrun, exact resume, top-1, transparency."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gpipe_core as gp
from apps.amoebanet import evaluate as amoebanet_evaluate
from apps.amoebanet import train
from apps.amoebanet.config import (
    CONFIG_DIR,
    build_model,
    load_amoebanet_config,
    load_train_config,
)
from apps.amoebanet.data import DatasetNotFoundError
from apps.amoebanet.model import build_amoebanet
from apps.config import ConfigError, save_config
from apps.harness.checkpoints import CheckpointError
from data.image_shards import Sample, encode_png
from tests.distributed import launch
from tests.distributed.launch import spawn

CLASSES = ["hstripes", "vstripes", "square"]
TRAIN_IMAGES, TEST_IMAGES = 48, 24  # tiny_test's batch of 8: 6 steps per epoch


def synthetic_samples(split: str, count: int, seed: int) -> Iterator[Sample]:
    """16x16 grayscale images whose class is a pattern (stripes either way or a square)."""
    rng = np.random.default_rng(seed)
    for index in range(count):
        label = index % len(CLASSES)
        pixels = rng.integers(0, 60, (16, 16)).astype(np.uint8)
        if label == 0:
            pixels[::4] += 150
        elif label == 1:
            pixels[:, ::4] += 150
        else:
            pixels[5:11, 5:11] += 150
        yield Sample(f"{split}_{index:04d}", encode_png(pixels), "png", label)


def tiny_args(shards: Path, out_dir: Path, **changes: Any) -> list[str]:
    settings: dict[str, Any] = {
        "config": "tiny_test",
        "data_dir": shards,
        "out_dir": out_dir,
        "wandb_mode": "disabled",
        # resume must reproduce drop-path masks, mixup, worker augmentation and data order too
        "drop_path": 0.2,
        "dropout": 0.1,
        "mixup": 0.4,
        "num_workers": 1,
        "epochs": 2,
        "log_every": 3,
    }
    settings.update(changes)
    return [f"--{key}={value}" for key, value in settings.items()]


def torchrun(args: list[str], *, nproc: int = 2, timeout_s: float = 120.0) -> str:
    """apps.amoebanet.train under torchrun on 127.0.0.1; its output."""
    return launch.torchrun("apps.amoebanet.train", args, nproc=nproc, timeout_s=timeout_s)


def losses(out_dir: Path) -> list[tuple[int, float]]:
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [(record["step"], record["loss"]) for record in map(json.loads, lines)]


def latest(out_dir: Path) -> Path:
    return out_dir / (out_dir / "latest").read_text().strip()


# ---------------------------------------------------------------------------------------------
# The real loop, end to end


@pytest.mark.slow
@pytest.mark.distributed
def test_train_checkpoint_exact_resume_and_top1(shards: Path, tmp_path: Path) -> None:
    steps = 2 * TRAIN_IMAGES // 8
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    output = torchrun(tiny_args(shards, straight))
    assert "balance" in output and "test top-1:" in output and "epoch 1: test top-1" in output

    # what a run leaves behind
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == steps and summary["epochs"] == 2.0
    assert summary["stopped_by"] == "epochs=2" and summary["images_per_second"] > 0
    checkpoint = latest(straight)
    assert checkpoint.name == f"step-{steps:07d}"
    assert sorted(p.name for p in checkpoint.glob("shard-*")) == [
        "shard-000-of-002.pt", "shard-001-of-002.pt"]
    assert (checkpoint / "train-state-rank000.pt").is_file()
    assert (checkpoint / "train-state-rank001.pt").is_file()
    saved = load_amoebanet_config([f"--config={checkpoint / 'config.yaml'}"])
    assert saved.mixup == 0.4 and saved.drop_path == 0.2
    run_info = json.loads((checkpoint / "run.json").read_text())
    assert run_info["classes"] == CLASSES and sum(run_info["balance"]) == 9
    final = json.loads((straight / "eval_test.json").read_text())
    assert final["images"] == TEST_IMAGES and (straight / "eval_test.png").is_file()
    assert final["top1"] == summary["top1"]

    # 7 steps (across the epoch boundary), stop, resume to the end: the same losses and the
    # same weights and BatchNorm statistics, bit for bit
    torchrun(tiny_args(shards, halves, stop_at_step=7))
    assert latest(halves).name == "step-0000007"
    torchrun(tiny_args(shards, halves) + ["--resume"])
    assert losses(halves) == losses(straight)
    assert [step for step, _ in losses(halves)] == list(range(1, steps + 1))
    resumed = gp.load_shards(latest(halves))
    for name, value in gp.load_shards(checkpoint).items():
        assert torch.equal(resumed[name], value), name

    # the evaluation script on the plain model agrees with the pipeline's final evaluation
    report = amoebanet_evaluate.evaluate_checkpoint(straight, split="test", out=tmp_path / "eval")
    assert (tmp_path / "eval.json").is_file() and (tmp_path / "eval.png").is_file()
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["top1"] == report["top1"] and written["classes"] == CLASSES
    confusion = torch.tensor(report["confusion"])
    assert int(confusion.sum()) == TEST_IMAGES
    assert report["top1"] == pytest.approx(float(confusion.diag().sum()) / TEST_IMAGES)
    assert report["top1"] <= report["top5"] == 1.0  # 3 classes: the top 5 hold every class
    assert confusion.tolist() == final["confusion"]


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_replicas_read_their_own_shards(shards: Path, tmp_path: Path) -> None:
    """2 stages x 2 replicas: replica r reads every 2nd shard; the epoch ends when one runs dry."""
    out_dir = tmp_path / "dp"
    output = torchrun(tiny_args(shards, out_dir, epochs=1, mixup=0.0, num_workers=0), nproc=4)
    assert "2 replica(s), 4 rank(s)" in output
    summary = json.loads((out_dir / "summary.json").read_text())
    # the 3 train shards of 16 images split 2 + 1: the second replica has 2 batches of 8
    assert summary["steps"] == 2 and summary["images"] == 2 * 2 * 8
    checkpoint = latest(out_dir)
    assert sorted(p.name for p in checkpoint.glob("shard-*")) == [
        "shard-000-of-002.pt", "shard-001-of-002.pt"]  # one copy of the weights
    assert len(list(checkpoint.glob("train-state-rank*.pt"))) == 4
    # each replica scores its own test shard; together every test image once
    assert json.loads((out_dir / "eval_test.json").read_text())["images"] == TEST_IMAGES


# ---------------------------------------------------------------------------------------------
# Plain model == GPipe == DistributedGPipe on a small AmoebaNet with BatchNorm (float64)


def small_amoebanet() -> nn.Sequential:
    """AmoebaNet-D(3, 8) (BatchNorm everywhere), materialized as pipeline ranks do, float64."""
    meta = build_amoebanet("meta", genotype="D", num_normal_cells=3, filters=8, num_classes=3,
                           in_chans=1, stem_stride=1)
    return gp.materialize(meta, seed=5).double()


def problem() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 1, 16, 16, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (8,), generator=g)


def stats(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


def run_distributed(rank: int, world_size: int) -> dict[int, Any]:
    """One training step under DistributedGPipe with 1 and 4 micro-batches."""
    images, labels = problem()
    results = {}
    for chunks in (1, 4):
        pipe = gp.DistributedGPipe(small_amoebanet(), [4, 5], chunks=chunks, loss_fn=F.cross_entropy,
                                   checkpoint="except_last", deferred_batch_norm=True, seed=5)
        loss = pipe.step(images if pipe.is_first else None, labels if pipe.is_last else None)
        results[chunks] = (float(loss), {n: p.grad.clone() for n, p in pipe.named_parameters()},
                           stats(pipe))
    return results


@pytest.mark.distributed
def test_plain_gpipe_and_distributed_agree_with_batch_norm(tmp_path: Path) -> None:
    images, labels = problem()
    plain = small_amoebanet()
    plain_loss = F.cross_entropy(plain(images), labels)
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    plain_stats = stats(plain)  # running statistics of the whole mini-batch

    gpipe_results = {}
    seen_by_bn: dict[str, list[Tensor]] = {}  # with 4 micro-batches: each BN's inputs
    for chunks in (1, 4):
        model = small_amoebanet()
        pipe = gp.GPipe(model, [4, 5], chunks=chunks, deferred_batch_norm=True, seed=5)
        hooks = [
            module.register_forward_hook(
                lambda _m, args, _out, name=name: seen_by_bn.setdefault(name, []).append(args[0]))
            for name, module in model.named_modules()
            if isinstance(module, gp.DeferredBatchNorm) and chunks == 4
        ]
        output = pipe(images)  # forward only: recomputation in backward is not recorded
        for hook in hooks:
            hook.remove()
        loss = F.cross_entropy(output, labels)
        loss.backward()
        gpipe_results[chunks] = (loss.item(), {n: p.grad.clone() for n, p in
                                               model.named_parameters()}, stats(model))
    distributed = spawn(run_distributed, 2, tmp_path, timeout_s=120)

    # one micro-batch: exactly the plain module's loss and gradients
    loss, grads, running = gpipe_results[1]
    assert loss == plain_loss.item()
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name
    for name, value in running.items():  # DeferredBatchNorm's own (Chan) sums: to rounding
        torch.testing.assert_close(value, plain_stats[name], rtol=0, atol=1e-15, msg=name)
    seen: set[str] = set()
    for rank_results in distributed:
        loss, grads, running = rank_results[1]
        assert loss == plain_loss.item()
        for name, grad in grads.items():
            assert torch.equal(grad, plain_grads[name]), name
            seen.add(name)
        for name, value in running.items():
            torch.testing.assert_close(value, plain_stats[name], rtol=0, atol=1e-15, msg=name)
    assert seen == set(plain_grads)

    # four micro-batches: batch statistics per micro-batch, so the loss differs from the plain
    # module's, but GPipe and DistributedGPipe agree, and each BatchNorm's running statistics
    # are those of everything it saw in the mini-batch (its 4 micro-batches together)
    loss, grads, running = gpipe_results[4]
    assert abs(loss - plain_loss.item()) > 1e-6  # micro-batch statistics did change something
    assert len(seen_by_bn) == sum(1 for k in running if k.endswith("running_mean"))
    for name, inputs in seen_by_bn.items():
        assert len(inputs) == 4, name
        whole = torch.cat(inputs).transpose(0, 1).flatten(1)  # [channels, batch * H * W]
        momentum = 0.1  # from running_mean = 0, running_var = 1
        torch.testing.assert_close(running[f"{name}.running_mean"], momentum * whole.mean(1),
                                   rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(running[f"{name}.running_var"],
                                   1 - momentum + momentum * whole.var(1), rtol=0, atol=1e-12,
                                   msg=name)
    torch.testing.assert_close(running["stem.bn.running_mean"], plain_stats["stem.bn.running_mean"],
                               rtol=0, atol=1e-15)  # the first BatchNorm sees the same inputs
    for rank_results in distributed:
        dist_loss, dist_grads, dist_running = rank_results[4]
        assert dist_loss == pytest.approx(loss, rel=0, abs=1e-12)
        for name, grad in dist_grads.items():
            torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-12, msg=name)
        for name, value in dist_running.items():
            torch.testing.assert_close(value, running[name], rtol=0, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------------------------
# Data order: skipping batches on resume lands where a run that never stopped was


@pytest.mark.parametrize("num_workers", [0, 1])
def test_skipped_batches_resume_the_same_stream(shards: Path, num_workers: int) -> None:
    config = load_train_config(tiny_args(shards, Path("unused"), num_workers=num_workers))
    whole = list(train.train_batches(config, 1, skip=0, replica=0, num_replicas=1))
    torch.manual_seed(123)  # a resumed process starts from other global RNG states
    rest = list(train.train_batches(config, 1, skip=2, replica=0, num_replicas=1))
    assert len(whole) == TRAIN_IMAGES // 8 and len(rest) == len(whole) - 2
    for (images, targets), (images2, targets2) in zip(whole[2:], rest, strict=True):
        assert torch.equal(images, images2) and torch.equal(targets, targets2)
    other_epoch = next(train.train_batches(config, 2, skip=0, replica=0, num_replicas=1))
    assert not torch.equal(other_epoch[0], whole[0][0])


# ---------------------------------------------------------------------------------------------
# Errors that say the fix


def fake_checkpoint(directory: Path, shards: Path) -> Path:
    """A checkpoint as train.py writes it (shards + config.yaml) of an untrained tiny model."""
    config = load_amoebanet_config([f"--config={CONFIG_DIR / 'tiny_test.yaml'}",
                                    f"--data_dir={shards}"])
    model = gp.materialize(build_model(config, device="meta"), seed=0)
    gp.save_shards(model.state_dict(), directory)
    save_config(config, directory / "config.yaml")
    return directory


def test_eval_script_on_a_fake_checkpoint(shards: Path, tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt", shards)
    assert amoebanet_evaluate.main(["--ckpt", str(checkpoint), "--split", "test",
                                    "--eval_batch_size=5"]) == 0
    report = json.loads((checkpoint / "eval_test.json").read_text())
    assert report["images"] == TEST_IMAGES and (checkpoint / "eval_test.png").is_file()
    assert 0.0 <= report["top1"] <= report["top5"] <= 1.0


def test_missing_dataset_names_the_command(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="python -m data.imagenet.prepare"):
        train.main(["--config=tiny_test", f"--data_dir={tmp_path / 'nothing'}"])
    checkpoint = fake_checkpoint(tmp_path / "ckpt", shards)
    with pytest.raises(DatasetNotFoundError,
                       match=r"python -m data.fashion_mnist.prepare --out .*nothing"):
        amoebanet_evaluate.evaluate_checkpoint(checkpoint, overrides=[
            "--dataset=fashion_mnist", f"--data_dir={tmp_path / 'nothing'}"])
    with pytest.raises(DatasetNotFoundError, match=r"split 'val' not in"):
        amoebanet_evaluate.evaluate_checkpoint(checkpoint, split="val")


def test_missing_checkpoint_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="-m apps.amoebanet.train --out_dir="):
        amoebanet_evaluate.evaluate_checkpoint(tmp_path / "no_run")


def test_unknown_config_key_is_an_error(shards: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['lerning_rate'\]"):
        train.main(["--lerning_rate=1"])  # stops before any process group exists
    with pytest.raises(ConfigError, match="stop_at_step=-1 must be >= 0"):
        train.main(["--stop_at_step=-1"])
    checkpoint = fake_checkpoint(tmp_path / "ckpt", shards)
    assert amoebanet_evaluate.main(["--ckpt", str(checkpoint), "--lerning_rate=1"]) == 2
    assert "unknown config key(s) ['lerning_rate']" in capsys.readouterr().err
