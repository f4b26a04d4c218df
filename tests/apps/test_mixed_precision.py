"""Both apps train in bf16 (and NMT in fp16, loss-scaled) through the pipeline: the loss falls,
and a run stopped halfway resumes to the same losses and weights, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gpipe_core as gp
from tests.apps import test_amoebanet_train as amoebanet
from tests.apps import test_nmt_train as nmt

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def latest(out_dir: Path) -> Path:
    return out_dir / (out_dir / "latest").read_text().strip()


def assert_same_weights(first: Path, second: Path) -> None:
    resumed = gp.load_shards(latest(second))
    for name, value in gp.load_shards(latest(first)).items():
        assert value.dtype in (torch.float32, torch.int64), name  # weights stay float32
        assert torch.equal(resumed[name], value), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nmt_trains_and_resumes_exactly(corpus: Path, tmp_path: Path, precision: str) -> None:
    steps = 8
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    nmt.torchrun(nmt.tiny_args(corpus, straight, max_steps=steps, precision=precision))
    nmt.torchrun(nmt.tiny_args(corpus, halves, max_steps=steps // 2, precision=precision))
    nmt.torchrun(nmt.tiny_args(corpus, halves, max_steps=steps, precision=precision,
                               resume="true"))
    losses = nmt.losses(straight)
    assert nmt.losses(halves) == losses
    assert [step for step, _ in losses] == list(range(1, steps + 1))
    assert sum(v for _, v in losses[-2:]) < sum(v for _, v in losses[:2])  # it learns
    assert_same_weights(straight, halves)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == steps
    if precision == "fp16":  # the loss scale is part of the checkpoint, and resumed
        state = torch.load(latest(halves) / "train-state-rank001.pt", weights_only=False)
        assert state["loss_scaler"]["scale"] > 0


def test_amoebanet_trains_and_resumes_exactly_in_bf16(shards: Path, tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    amoebanet.torchrun(amoebanet.tiny_args(shards, straight, precision="bf16"))
    amoebanet.torchrun(amoebanet.tiny_args(shards, halves, precision="bf16", max_steps=7))
    amoebanet.torchrun(amoebanet.tiny_args(shards, halves, precision="bf16") + ["--resume"])
    losses = amoebanet.losses(straight)
    assert amoebanet.losses(halves) == losses
    assert sum(v for _, v in losses[-3:]) < sum(v for _, v in losses[:3])  # it learns
    assert_same_weights(straight, halves)
