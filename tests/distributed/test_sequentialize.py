"""A sequentialized Hugging Face GPT-2, built on meta, through DistributedGPipe on 2 gloo ranks:
the plain module's loss and gradients for gpipe, 1f1b and interleaved 1F1B (virtual stages),
with the tied embedding carried between layers or held at both ends (``tied=seq.tied``), and a
checkpoint that loads into the original class with strict=True."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import gpipe_core as gp
from tests import sequentialize_models as models
from tests.distributed.launch import spawn

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed
TOL = 1e-10
CHUNKS = 3
# (schedule, balance over the 6 segments: embeddings, 4 blocks, final norm + head, how the
# tied embedding / output projection is kept)
RUNS = (("gpipe", [3, 3], "carry"), ("1f1b", [2, 4], "carry"),
        ("interleaved_1f1b", [2, 1, 1, 2], "carry"), ("1f1b", [3, 3], "ends"))


def loss_fn(out: dict[str, Tensor], targets: Tensor) -> Tensor:
    return F.cross_entropy(out["logits"].flatten(0, 1), targets.flatten())


def reference_weights() -> dict[str, Tensor]:
    torch.manual_seed(0)
    return models.gpt2(0.0).double().state_dict()


def batch() -> tuple[dict[str, Any], Tensor]:
    inputs = models.token_batch(batch=7)  # 7 samples over 3 micro-batches: 3 + 2 + 2
    targets = torch.roll(inputs["input_ids"], -1, dims=1)
    return inputs, targets


def run(rank: int, world: int, checkpoint_dir: str) -> list[Any]:
    torch.set_num_threads(1)
    weights = reference_weights()
    inputs, targets = batch()
    with torch.device("meta"):
        model = models.gpt2(0.0).double()
    example = {k: v.to("meta") for k, v in inputs.items()}
    seqs = {tied: gp.sequentialize(model, (), {**example, "use_cache": False},
                                   tied_weights=tied) for tied in ("carry", "ends")}
    assert seqs["carry"].tied is None and seqs["ends"].tied is not None
    results = []
    for schedule, balance, tied in RUNS:
        seq = seqs[tied]
        pipe = gp.DistributedGPipe(seq, balance, chunks=CHUNKS, schedule=schedule,
                                   loss_fn=loss_fn, device="cpu", tied=seq.tied,
                                   init_fn=lambda layer, index: None)
        local = set(pipe.state_dict())
        pipe.load_state_dict({k: v for k, v in weights.items() if k in local}, strict=True)
        pipe.zero_grad(set_to_none=True)
        loss = pipe.step(seq.inputs(**inputs, use_cache=False) if pipe.is_first else None,
                         targets if pipe.is_last else None)
        grads = {name.split(".", 1)[1]: p.grad.clone() for name, p in pipe.named_parameters()}
        if tied == "ends" and "lm_head.weight" in grads:  # the second copy of the tied weight
            grads["transformer.wte.weight"] = grads.pop("lm_head.weight")
        results.append((schedule, float(loss), grads))
        if schedule == "gpipe":
            pipe.save_checkpoint(checkpoint_dir)
    return results


def test_meta_gpt2_on_two_ranks(tmp_path: Path) -> None:
    per_rank = spawn(run, 2, tmp_path, str(tmp_path / "checkpoint"), timeout_s=300.0)
    model = models.gpt2(0.0).double()
    model.load_state_dict(reference_weights())
    inputs, targets = batch()
    pieces = list(zip(*(v.tensor_split(CHUNKS) for v in (*inputs.values(), targets)),
                      strict=True))
    loss = sum(loss_fn(model(input_ids=ids, attention_mask=mask, use_cache=False), target)
               for ids, mask, target in pieces) / CHUNKS
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for index, (schedule, _, tied) in enumerate(RUNS):
        seen: set[str] = set()
        for results in per_rank:
            got_schedule, got_loss, grads = results[index]
            assert got_schedule == schedule
            assert got_loss == pytest.approx(loss.item(), abs=TOL), schedule
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected[name], rtol=0, atol=TOL,
                                           msg=f"{schedule} {tied} {name}")
                seen.add(name)
        assert seen == set(expected), schedule  # every parameter on a rank
    # the pipeline's checkpoint loads into the user's unmodified class, strictly
    fresh = models.gpt2(0.0).double()
    fresh.load_state_dict(gp.load_shards(tmp_path / "checkpoint"), strict=True)
    for key, value in reference_weights().items():
        assert torch.equal(fresh.state_dict()[key], value), key
