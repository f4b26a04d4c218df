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


def latest(out_dir: Path) -> Path:
    return out_dir / (out_dir / "latest").read_text().strip()


def assert_same_weights(first: Path, second: Path) -> None:
    resumed = gp.load_shards(latest(second))
    for name, value in gp.load_shards(latest(first)).items():
        assert value.dtype in (torch.float32, torch.int64), name  # weights stay float32
        assert torch.equal(resumed[name], value), name


@pytest.mark.slow
@pytest.mark.distributed
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


@pytest.mark.slow
@pytest.mark.distributed
def test_amoebanet_trains_and_resumes_exactly_in_bf16(shards: Path, tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    amoebanet.torchrun(amoebanet.tiny_args(shards, straight, precision="bf16"))
    amoebanet.torchrun(amoebanet.tiny_args(shards, halves, precision="bf16", stop_at_step=7))
    amoebanet.torchrun(amoebanet.tiny_args(shards, halves, precision="bf16") + ["--resume"])
    losses = amoebanet.losses(straight)
    assert amoebanet.losses(halves) == losses
    assert sum(v for _, v in losses[-3:]) < sum(v for _, v in losses[:3])  # it learns
    assert_same_weights(straight, halves)


def test_nmt_bf16_gradients_do_not_depend_on_the_cut() -> None:
    # A stage's inputs are leaves that require grad, and autocast caches its cast of such a
    # leaf (meant for weights): the encoder's output, read by both decoder layers, then shared
    # one bf16 cast within a stage and its gradients were summed in bf16, so a cut between the
    # two decoder layers ([4, 2]) changed every encoder gradient (found when the balance by
    # time differed between two runs of one test). The stage now reads its inputs as views.
    import copy

    from apps.nmt.config import build_model, load_nmt_config
    from apps.nmt.model import token_cross_entropy

    config = load_nmt_config(["--config=tiny", "--vocab_size=400", "--dropout=0"])
    base = gp.materialize(build_model(config, device="meta"), seed=0)
    g = torch.Generator().manual_seed(0)
    src, tgt = (torch.randint(4, 400, (4, 9), generator=g),
                torch.randint(4, 400, (4, 8), generator=g))
    grads = {}
    for balance in ([6], [3, 3], [4, 2], [2, 4], [5, 1], [1, 1, 2, 2]):
        model = copy.deepcopy(base)
        pipe = gp.GPipe(model, balance, chunks=2, checkpoint="except_last", precision="bf16")
        token_cross_entropy(pipe((src, tgt)), tgt, pad_id=0, label_smoothing=0.0).backward()
        grads[str(balance)] = {n: p.grad for n, p in model.named_parameters()}
    whole = grads["[6]"]
    for balance, got in grads.items():
        for name, grad in whole.items():
            assert torch.equal(got[name], grad), (balance, name)
