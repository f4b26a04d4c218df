"""gp.sequentialize: any traceable module as a pipeline-ready nn.Sequential, exactly.

Transparency: the sequentialized model through GPipe at K = 1..4 stages and M = 1, 3, 8
micro-batches gives the plain module's loss and every parameter's gradient within 1e-10 in
float64 (dropout off), and with dropout on the same result for every K (the per-layer random
streams are keyed by the segment index, which does not depend on K).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import gpipe_core as gp
from tests import sequentialize_models as models

pytest.importorskip("transformers")

ROOT_DIR = Path(__file__).resolve().parents[1]
TOL = 1e-10
STAGES = (1, 2, 3, 4)
MICROBATCHES = (1, 3, 8)
# The fast suite runs these (K, M); the slow one the whole grid.
FAST_GRID = ((1, 1), (2, 3), (4, 8))
FULL_GRID = tuple(itertools.product(STAGES, MICROBATCHES))


def _weights(output: Any) -> list[Tensor]:
    """Fixed random weights for every floating-point output leaf: the loss reads all of it."""
    generator = torch.Generator().manual_seed(1)
    leaves = [x for x in pytree.tree_leaves(output)
              if isinstance(x, Tensor) and x.is_floating_point()]
    return [torch.randn(x.shape, generator=generator, dtype=x.dtype) for x in leaves]


def _loss(output: Any, weights: list[Tensor]) -> Tensor:
    leaves = [x for x in pytree.tree_leaves(output)
              if isinstance(x, Tensor) and x.is_floating_point()]
    return sum(((x * w).sum() for x, w in zip(leaves, weights, strict=True)),
               torch.zeros((), dtype=torch.float64))


class Case:
    """A model, its sequentialized form, how to call each, and the reference result."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 **options: Any) -> None:
        self.model = model.double()
        self.args = tuple(a.double() if isinstance(a, Tensor) and a.is_floating_point() else a
                          for a in args)
        self.kwargs = kwargs
        self.seq = gp.sequentialize(self.model, self.args, self.kwargs, **options)
        self.weights = _weights(self.model(*self.args, **self.kwargs))

    def plain(self) -> tuple[Tensor, dict[str, Tensor]]:
        self.model.zero_grad(set_to_none=True)
        loss = _loss(self.model(*self.args, **self.kwargs), self.weights)
        loss.backward()
        return loss.detach(), self.grads()

    def piped(self, stages: int, chunks: int, **options: Any) -> tuple[Tensor, dict[str, Tensor]]:
        self.model.zero_grad(set_to_none=True)
        balance = gp.balance_by_params(self.seq, stages)
        pipe = gp.GPipe(self.seq, balance, chunks=chunks, seed=7, **options)
        loss = _loss(pipe(self.seq.inputs(*self.args, **self.kwargs)), self.weights)
        loss.backward()
        return loss.detach(), self.grads()

    def grads(self) -> dict[str, Tensor]:
        return {name: p.grad.clone() for name, p in self.model.named_parameters()
                if p.grad is not None}

    def set_mode(self, training: bool) -> None:
        self.model.train(training)
        self.seq.train(training)


def _assert_close(got: tuple[Tensor, dict[str, Tensor]],
                  expected: tuple[Tensor, dict[str, Tensor]]) -> None:
    loss, grads = got
    ref_loss, ref_grads = expected
    assert abs(loss.item() - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item()))
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, grad in grads.items():
        diff = (grad - ref_grads[name]).abs().max().item()
        assert diff <= TOL, f"{name}: gradient differs by {diff}"


_CASES: dict[str, Case] = {}


def _case(name: str) -> Case:
    """Each model is traced once per test session (a trace takes seconds)."""
    if name not in _CASES:
        torch.manual_seed(0)
        builders: dict[str, Callable[[], Case]] = {
            "gpt2": lambda: Case(models.gpt2(0.0), (), {**models.token_batch(),
                                                        "use_cache": False}),
            "gpt2_dropout": lambda: Case(models.gpt2(0.1), (), {**models.token_batch(),
                                                                "use_cache": False}),
            "llama": lambda: Case(models.llama(0.1), (), {**models.token_batch(),
                                                          "use_cache": False}),
            "resnet18": lambda: Case(torchvision.models.resnet18(weights=None, num_classes=10),
                                     (torch.randn(8, 3, 32, 32),), {}),
            "unet": lambda: Case(models.UNet(p=0.1), (torch.randn(8, 3, 16, 16),), {}),
            "translator": lambda: Case(models.Translator(p=0.1), models.translation_batch(), {}),
        }
        _CASES[name] = builders[name]()
    return _CASES[name]


# -- transparency, dropout off ----------------------------------------------------------------

def _transparency(name: str, stages: int, chunks: int, *, training: bool) -> None:
    case = _case(name)
    case.set_mode(training)
    try:
        _assert_close(case.piped(stages, chunks), case.plain())
    finally:
        case.set_mode(True)


@pytest.mark.parametrize(("stages", "chunks"), FAST_GRID)
def test_gpt2_transparent_in_training_mode(stages: int, chunks: int) -> None:
    """GPT-2 with dropout 0 in training mode: the training program, tied head, mask."""
    _transparency("gpt2", stages, chunks, training=True)


@pytest.mark.parametrize(("stages", "chunks"), FAST_GRID)
@pytest.mark.parametrize("name", ["unet", "translator"])
def test_transparent_without_dropout(name: str, stages: int, chunks: int) -> None:
    """Evaluation mode turns dropout off: the plain module's loss and gradients exactly."""
    _transparency(name, stages, chunks, training=False)


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "chunks"), FULL_GRID)
@pytest.mark.parametrize("name", ["gpt2", "gpt2_dropout", "llama", "resnet18", "unet",
                                  "translator"])
def test_transparent_full_grid(name: str, stages: int, chunks: int) -> None:
    _transparency(name, stages, chunks, training=name == "gpt2")


@pytest.mark.parametrize("name", ["llama", "resnet18"])
def test_transparent_heavier_models(name: str) -> None:
    """Rotary embeddings (Llama) and BatchNorm with its running statistics frozen (ResNet in
    evaluation mode), once at K=3, M=3 in the fast suite."""
    _transparency(name, 3, 3, training=False)


# -- dropout on ---------------------------------------------------------------------------------

def _same_for_every_k(name: str, chunks: int) -> None:
    case = _case(name)
    case.set_mode(True)
    first = case.piped(1, chunks)
    case.set_mode(False)
    without = case.plain()
    case.set_mode(True)
    # the check could not fail if dropout did nothing
    assert abs(first[0].item() - without[0].item()) > 1e-6
    for stages in STAGES[1:]:
        _assert_close(case.piped(stages, chunks), first)
    _assert_close(case.piped(2, chunks, checkpoint="always"), first)


@pytest.mark.parametrize("name", ["gpt2_dropout", "unet", "translator"])
def test_dropout_equal_for_every_k(name: str) -> None:
    _same_for_every_k(name, 3)


@pytest.mark.slow
@pytest.mark.parametrize("chunks", MICROBATCHES)
@pytest.mark.parametrize("name", ["gpt2_dropout", "llama", "unet", "translator"])
def test_dropout_equal_for_every_k_full(name: str, chunks: int) -> None:
    _same_for_every_k(name, chunks)


# -- BatchNorm in training mode -----------------------------------------------------------------

def test_batchnorm_running_statistics_updated_once() -> None:
    """ResNet-18 in training mode at M=1: the running statistics move as in the plain module,
    although re-materialization runs every forward twice (BatchNorm is called as the module,
    which GPipe switches off while recomputing)."""
    case = _case("resnet18")
    case.set_mode(True)
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    expected = case.plain()
    plain_stats = {k: v.clone() for k, v in case.model.state_dict().items() if "running" in k
                   or "num_batches" in k}
    case.model.load_state_dict(before)
    got = case.piped(3, 1, checkpoint="always")
    _assert_close(got, expected)
    for key, value in plain_stats.items():
        assert torch.allclose(case.model.state_dict()[key], value, atol=TOL, rtol=0), key
    case.model.load_state_dict(before)


# -- structure of inputs and outputs --------------------------------------------------------------

def test_output_structure() -> None:
    """A Hugging Face ModelOutput comes back as a dict with its keys; a tuple as a tuple."""
    gpt2 = _case("gpt2")
    out = gpt2.seq(gpt2.seq.inputs(**gpt2.kwargs))
    assert type(out) is dict and list(out) == ["logits"]
    translator = _case("translator")
    translator.set_mode(False)
    logits, memory = translator.seq(translator.seq.inputs(*translator.args))
    expected = translator.model(*translator.args)
    assert torch.equal(logits, expected[0]) and torch.equal(memory, expected[1])
    translator.set_mode(True)


class MaskedMixer(nn.Module):
    """Takes a (T, T) mask shared by all samples and a 0-dim temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: Tensor, mask: Tensor, temperature: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + torch.softmax(block(x) @ x.transpose(1, 2) / temperature + mask, -1) @ x
        return x


def test_shared_and_scalar_inputs_reach_every_microbatch() -> None:
    model = MaskedMixer().double()
    x = torch.randn(8, 5, 6, dtype=torch.float64)
    mask = torch.zeros(5, 5, dtype=torch.float64).masked_fill(
        torch.ones(5, 5, dtype=torch.bool).triu(1), -1e9)
    temperature = torch.tensor(2.0, dtype=torch.float64)
    seq = gp.sequentialize(model, (x, gp.Shared(mask), temperature))
    pipe = gp.GPipe(seq, gp.balance_by_params(seq, 2), chunks=3)
    out = pipe(seq.inputs(x, gp.Shared(mask), temperature))
    assert torch.allclose(out, model(x, mask, temperature), atol=TOL, rtol=0)
    with pytest.raises(TypeError, match="gp.Shared"):
        seq(seq.inputs(x, mask, temperature))


def test_non_tensor_inputs_are_fixed_by_the_trace() -> None:
    case = _case("gpt2")
    with pytest.raises(ValueError, match="traced with False"):
        case.seq(case.seq.inputs(**{**case.kwargs, "use_cache": True}))


# -- names, checkpoints, cuts ---------------------------------------------------------------

def test_state_dict_round_trip_into_the_original_class() -> None:
    case = _case("gpt2")
    pipe = gp.GPipe(case.seq, gp.balance_by_params(case.seq, 3), chunks=2)
    state = pipe.state_dict()
    assert list(state) == list(case.model.state_dict()) or set(state) == set(
        case.model.state_dict())
    fresh = models.gpt2(0.0).double()
    fresh.load_state_dict(state, strict=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, case.model.state_dict()[key]), key
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    # and back: the original module's checkpoint loads into the pipeline, strictly
    changed = {k: v + 1.0 for k, v in fresh.state_dict().items()}
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    pipe.load_state_dict(changed, strict=True)
    for key, value in case.model.state_dict().items():
        assert torch.equal(value, changed[key]), key
    case.model.load_state_dict(before)


def test_checkpoint_shards_keyed_by_original_names(tmp_path: Any) -> None:
    case = _case("translator")
    pipe = gp.GPipe(case.seq, gp.balance_by_params(case.seq, 2), chunks=2)
    gp.save_shards(pipe.state_dict(), tmp_path)
    fresh = models.Translator(p=0.1).double()
    fresh.load_state_dict(gp.load_shards(tmp_path), strict=True)
    assert fresh.target_embed.weight is fresh.source_embed.weight


def test_cut_report_counts_the_tensors_sent() -> None:
    case = _case("unet")
    case.set_mode(True)
    x: Any = case.seq.inputs(*case.args)
    for index, layer in enumerate(list(case.seq)[:-1]):
        x = layer(x)
        sent = sum(t.nbytes for t in x if isinstance(t, Tensor))
        assert case.seq.cuts[index].bytes == sent
    # the U-Net's skips cross several cuts: more than the main path at the deepest one
    assert len(case.seq.cuts[1].values) > 1
    assert "sends" in case.seq.describe()


@pytest.mark.slow
def test_split_points_and_parts() -> None:
    model = models.gpt2(0.0, layers=4).double()
    batch = {**models.token_batch(), "use_cache": False}
    seq = gp.sequentialize(model, (), batch, split_points=["transformer.h.2", "lm_head"])
    assert [s.label for s in seq] == ["transformer", "transformer.h.2", "lm_head"]
    merged = gp.sequentialize(model, (), batch, parts=3)
    assert len(merged) == 3
    model.eval()
    for candidate in (seq, merged):
        candidate.eval()
        out = candidate(candidate.inputs(**batch))["logits"]
        assert torch.equal(out, model(**batch).logits)
    with pytest.raises(gp.SequentializeError, match="not a submodule"):
        gp.sequentialize(model, (), batch, split_points=["transformer.h.9"])


def test_balancers_and_costs_take_the_sequential() -> None:
    case = _case("translator")
    sample = case.seq.inputs(*case.args)
    assert sum(gp.balance_by_time(case.seq, sample, 2, repeats=1)) == len(case.seq)
    assert sum(gp.balance_by_memory(case.seq, sample, 2)) == len(case.seq)
    costs = gp.layer_costs(case.seq, sample)
    assert len(costs) == len(case.seq) and sum(costs.forward_flops) > 0


def test_meta_device() -> None:
    """Traced on meta: no memory, the same layers and keys; moved to CPU and loaded, exact."""
    real = models.gpt2(0.0).double()
    with torch.device("meta"):
        meta = models.gpt2(0.0).double()
    batch = {**models.token_batch(), "use_cache": False}
    meta_batch = {k: v.to("meta") if isinstance(v, Tensor) else v for k, v in batch.items()}
    seq = gp.sequentialize(meta, (), meta_batch)
    assert all(p.is_meta for p in seq.parameters())
    assert set(seq.state_dict()) == set(real.state_dict())
    seq.to_empty(device="cpu")
    seq.load_state_dict(real.state_dict(), strict=True)
    seq.eval()
    real.eval()
    assert torch.equal(seq(seq.inputs(**batch))["logits"], real(**batch).logits)


# -- what cannot be cut ---------------------------------------------------------------------------

class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
            if x.sum() > 0:
                x = -x
        return x


class InPlace(nn.Module):
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            x.mul_(2)
            return self.linear(x)

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(self.Block() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


class CalledTwice(nn.Module):
    """``project`` runs before the blocks and after them; ``tied`` gives the second call its
    own module sharing both tensors (the fix the error names)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.project = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.tied = tied
        if tied:
            self.project_out = nn.Linear(4, 4)
            self.project_out.weight = self.project.weight
            self.project_out.bias = self.project.bias

    def forward(self, x: Tensor) -> Tensor:
        x = self.project(x)
        for block in self.blocks:
            x = F.relu(block(x))
        return self.project_out(x) if self.tied else self.project(x)


def test_data_dependent_control_flow_is_named() -> None:
    with pytest.raises(gp.SequentializeError) as error:
        gp.sequentialize(Branchy(), (torch.randn(3, 4),))
    message = str(error.value)
    assert "data-dependent control flow" in message and "if x.sum() > 0" in message
    assert "torch.where" in message


def test_in_place_update_across_a_cut_is_named() -> None:
    with pytest.raises(gp.SequentializeError) as error:
        gp.sequentialize(InPlace(), (torch.randn(3, 4),))
    message = str(error.value)
    assert "in-place update across a cut" in message and "'blocks.0'" in message
    assert "mul_" in message and "out of place" in message


def test_module_called_twice_across_a_cut_is_named() -> None:
    with pytest.raises(gp.SequentializeError) as error:
        gp.sequentialize(CalledTwice(), (torch.randn(3, 4),))
    message = str(error.value)
    assert "module 'project' is called 2 times across a cut" in message
    assert "split_points" in message
    # the fix it names works: a module per call, the tensors tied; they ride between stages
    model = CalledTwice(tied=True).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    seq = gp.sequentialize(model, (x,))
    case_loss = model(x).square().sum()
    case_loss.backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    pipe = gp.GPipe(seq, gp.balance_by_params(seq, len(seq)), chunks=3)
    loss = pipe(x).square().sum()
    loss.backward()
    assert abs(loss.item() - case_loss.item()) < TOL
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=TOL, rtol=0), name
    assert set(pipe.state_dict()) == set(model.state_dict())


def test_tied_weights_at_the_ends() -> None:
    """tied_weights="ends": the first and the last layer each hold the tied weight under its
    own name (for DistributedGPipe(tied=seq.tied)); nothing rides between the layers."""
    case = _case("gpt2")
    model, batch, carried = case.model, case.kwargs, case.seq
    seq = gp.sequentialize(model, (), batch, tied_weights="ends")
    last = len(seq) - 1
    assert seq.tied == ("seg0.transformer.wte.weight", f"seg{last}.lm_head.weight")
    assert set(seq.state_dict()) == set(model.state_dict())
    assert all(c.bytes < c2.bytes for c, c2 in zip(seq.cuts, carried.cuts, strict=True))
    out = seq(seq.inputs(**batch))["logits"]
    assert torch.equal(out, model(**batch).logits)
    with pytest.raises(ValueError, match="shared with"):
        gp.GPipe(seq, [3, 3])  # one process: GPipe keeps a shared weight in one partition


def test_other_sizes_than_the_batch_are_fixed_by_the_trace() -> None:
    case = _case("gpt2")
    longer = {k: torch.cat([v, v], dim=1) if isinstance(v, Tensor) else v
              for k, v in case.kwargs.items()}
    with pytest.raises(ValueError, match=r"traced with \(None, 16\)"):
        case.seq(case.seq.inputs(**longer))
    smaller = {k: v[:5] if isinstance(v, Tensor) else v for k, v in case.kwargs.items()}
    case.seq(case.seq.inputs(**smaller))  # the batch may vary


def test_deferred_batch_norm() -> None:
    """GPipe(deferred_batch_norm=True) replaces the BatchNorm modules inside the segments;
    the traced program calls whatever module is there."""
    model = torchvision.models.resnet18(weights=None, num_classes=10).double()
    x = torch.randn(8, 3, 32, 32, dtype=torch.float64)
    seq = gp.sequentialize(model, (x,), split_points=["layer2", "layer4"])
    pipe = gp.GPipe(seq, [1, 1, 1], chunks=4, deferred_batch_norm=True)
    pipe(x).sum().backward()
    bn = pipe.seg0.bn1
    assert isinstance(bn, gp.DeferredBatchNorm) and int(bn.num_batches_tracked) == 1
    reference = torchvision.models.resnet18(weights=None, num_classes=10).double()
    reference.load_state_dict(model.state_dict())
    reference.bn1.reset_running_stats()
    reference(x)  # the whole mini-batch's statistics, as DeferredBatchNorm accumulates them
    torch.testing.assert_close(bn.running_mean, reference.bn1.running_mean, rtol=0, atol=TOL)
    torch.testing.assert_close(bn.running_var, reference.bn1.running_var, rtol=0, atol=TOL)


def test_docs_page_runs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/SEQUENTIALIZE.md's example runs, asserts included (so it cannot go stale)."""
    from tests.test_docs import ROOT, load_page

    monkeypatch.syspath_prepend(str(tmp_path))
    page = load_page(ROOT / "docs" / "SEQUENTIALIZE.md", tmp_path, "sequentialize_page")
    assert len(page.seq) == 6


@pytest.mark.slow
def test_benchmark_script_runs(tmp_path: Any) -> None:
    """scripts/bench_sequentialize.py on a tiny model: the two models agree, a JSON is written."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "scripts.bench_sequentialize", "--tiny", "--rounds",
                    "2", "--warmup", "1", "--json", str(out)], check=True, cwd=ROOT_DIR,
                   capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 2 and result["median_ratio"] > 0
    assert result["max_output_difference"] <= 1e-5 and "load_average_after" in result[
        "provenance"]
