"""Selective re-materialization (``checkpoint=gp.Remat(...)`` or per-stage sets of kept layers):
exact for every choice of kept layers, with dropout, tuples and bf16 autocast, for B and I/W."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import Tensor, nn

import gpipe_core as gp
from gpipe_core.remat import Remat, as_checkpoint, check_pipeline_args
from gpipe_core.stage import Stage
from tests.test_gpipe import TOL, assert_same_grads, dropout_net, mlp, skip_net
from tests.test_precision import build as residual_net


def subsets(count: int) -> list[set[int]]:
    return [set(c) for r in range(count + 1) for c in itertools.combinations(range(count), r)]


def run(model: nn.Sequential, balance: list[int], checkpoint: object, x: Tensor,
        *, chunks: int = 3) -> tuple[Tensor, Tensor, gp.GPipe]:
    pipe = gp.GPipe(model, balance, chunks=chunks, checkpoint=checkpoint, seed=1234)  # type: ignore[arg-type]
    x = x.clone().requires_grad_()
    out = pipe(x)
    out.pow(2).sum().backward()
    assert all(stage.num_saved == 0 for stage in pipe.stages)
    assert x.grad is not None
    return out.detach(), x.grad, pipe


# -- the API -------------------------------------------------------------------------------


def test_forms_of_the_choice_and_their_text() -> None:
    choice = as_checkpoint([{0, 2}, []])
    assert choice == Remat([[2, 0], set()])
    assert str(choice) == "keep:[[0, 2], []]"
    assert as_checkpoint(str(choice)) == choice
    assert as_checkpoint("never") == "never"
    assert check_pipeline_args(chunks=2, checkpoint=(range(3), {1}), balance=[3, 2]) == \
        Remat([{0, 1, 2}, {1}])


@pytest.mark.parametrize(("checkpoint", "error", "match"), [
    ([{0}], ValueError, r"kept layers for 1 stages but balance=\[3, 2\] has 2; give one set"),
    ([{0}, {2}], ValueError, r"keeps layers \[2\] of stage 1, which has 2 layers \(0..1\)"),
    ([{0}, {-1}], ValueError, r"keep\[1\] has \[-1\]: layer indices are integers >= 0"),
    ([{0}, {1.5}], ValueError, r"keep\[1\] has \[1.5\]"),
    ([{0}, "01"], TypeError, r"keep\[1\]='01' is not a collection of layer indices"),
    ([], ValueError, r"names no stage"),
    ("sometimes", ValueError, r"checkpoint='sometimes' is not one of"),
    ("keep:[[0]", ValueError, r"keep: followed by a JSON list"),
    (3, TypeError, r"checkpoint=3 must be one of"),
])
def test_a_bad_choice_names_its_values_and_the_fix(checkpoint: object, error: type,
                                                    match: str) -> None:
    with pytest.raises(error, match=match):
        gp.GPipe(nn.Sequential(*list(mlp())[:5]), [3, 2], checkpoint=checkpoint)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        check_pipeline_args(chunks=1, checkpoint=checkpoint, balance=[3, 2])


def test_a_stage_checks_its_own_layers() -> None:
    layers = list(mlp()._modules.items())[:2]
    with pytest.raises(ValueError, match=r"stage 1 has none"):
        Stage(layers, stage_index=1, num_stages=2, first_layer_index=0,  # type: ignore[arg-type]
              device=torch.device("cpu"), checkpoint=Remat([{0}]), seed=0)
    with pytest.raises(ValueError, match=r"keeps layers \[5\] of stage 0, which has 2 layers"):
        Stage(layers, stage_index=0, num_stages=1, first_layer_index=0,  # type: ignore[arg-type]
              device=torch.device("cpu"), checkpoint=Remat([{5}]), seed=0)


def test_runs_are_maximal() -> None:
    assert Remat([{0, 1, 4}]).runs(0, 6) == [(0, 2, True), (2, 4, False), (4, 5, True),
                                             (5, 6, False)]
    assert Remat([set()]).runs(0, 3) == [(0, 3, False)]


# -- exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("balance", [[6], [3, 3], [2, 4]])
def test_every_choice_equals_the_plain_module(balance: list[int]) -> None:
    """Every set of kept layers on every stage: outputs and gradients of the plain module."""
    torch.manual_seed(0)
    base = mlp()
    x = torch.randn(7, 5, dtype=torch.float64)
    ref = copy.deepcopy(base)
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.pow(2).sum().backward()
    choices = list(itertools.product(*[subsets(count) for count in balance]))
    assert len(choices) == 2 ** 6
    for keep in choices:
        out, grad, pipe = run(copy.deepcopy(base), balance, list(keep), x)
        torch.testing.assert_close(out, out_ref.detach(), rtol=0, atol=TOL, msg=str(keep))
        torch.testing.assert_close(grad, x_ref.grad, rtol=0, atol=TOL, msg=str(keep))
        assert_same_grads(pipe, ref)


def test_tuples_with_a_skip_cross_every_boundary() -> None:
    torch.manual_seed(0)
    base = skip_net()
    x = torch.randn(5, 6, dtype=torch.float64)
    out_ref, grad_ref, ref = run(copy.deepcopy(base), [3, 3], "never", x)
    for keep in [[{0}, {1}], [{1}, {0, 2}], [{2}, set()], [{0, 2}, {1, 2}]]:
        out, grad, pipe = run(copy.deepcopy(base), [3, 3], keep, x)
        assert torch.equal(out, out_ref), keep
        torch.testing.assert_close(grad, grad_ref, rtol=0, atol=TOL)
        assert_same_grads(pipe, ref)


def test_dropout_is_bitwise_equal_for_every_choice() -> None:
    """The per-layer random streams: recomputed dropout masks equal the first forward's, so
    every choice gives the bits of ``checkpoint="never"``."""
    torch.manual_seed(1)
    base = dropout_net()
    x = torch.randn(12, 6, dtype=torch.float64)
    out0, grad0, pipe0 = run(copy.deepcopy(base), [2, 3], "never", x, chunks=4)
    grads0 = [p.grad for p in pipe0.parameters()]
    for keep in itertools.product(subsets(2), subsets(3)):
        out, grad, pipe = run(copy.deepcopy(base), [2, 3], list(keep), x, chunks=4)
        assert torch.equal(out, out0), keep
        assert torch.equal(grad, grad0), keep
        for g, g0 in zip((p.grad for p in pipe.parameters()), grads0, strict=True):
            assert torch.equal(g, g0), keep


def test_bf16_autocast_is_bitwise_equal_for_every_choice() -> None:
    """A recomputed run runs in the autocast state of its first forward."""
    torch.manual_seed(2)
    base = residual_net(p=0.2)
    x = torch.randn(8, 16)

    def bf16(checkpoint: object) -> tuple[Tensor, list[Tensor]]:
        pipe = gp.GPipe(copy.deepcopy(base), [4, 3], chunks=2, checkpoint=checkpoint,  # type: ignore[arg-type]
                        seed=5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pipe(x)
        assert out.dtype == torch.bfloat16
        out.float().pow(2).sum().backward()
        return out.detach(), [p.grad for p in pipe.parameters()]  # type: ignore[misc]

    out0, grads0 = bf16("never")
    for keep in [[set(), {0}], [{1, 3}, {2}], [{0, 1, 2}, set()], [{2}, {0, 1}]]:
        out, grads = bf16(keep)
        assert torch.equal(out, out0), keep
        for g, g0 in zip(grads, grads0, strict=True):
            assert torch.equal(g, g0), keep


def stage_of(model: nn.Sequential, keep: set[int]) -> Stage:
    """Layers 1.. of ``model`` as the middle stage of a pipeline (its input needs a grad)."""
    layers = list(model._modules.items())[1:]
    return Stage(layers, stage_index=1, num_stages=3, first_layer_index=1,  # type: ignore[arg-type]
                 device=torch.device("cpu"), checkpoint=Remat([set(), keep, set()]), seed=3)


@pytest.mark.parametrize("keep", subsets(4))
def test_split_backward_equals_the_fused_one(keep: set[int]) -> None:
    """I then W (the zero-bubble schedules' split) gives B's input and parameter gradients."""
    torch.manual_seed(3)
    base = dropout_net(p=0.3)
    x = torch.randn(6, 32, dtype=torch.float64)
    grad_out = torch.randn(6, 3, dtype=torch.float64)
    results = []
    for split in (False, True):
        model = copy.deepcopy(base)
        stage = stage_of(model, keep)
        stage.begin_step(0, 2)
        for mb in range(2):
            stage.forward(0, mb, x.clone().requires_grad_())
        for mb in range(2):
            if split:
                (grad_in,) = stage.backward_input(0, mb, [grad_out])
                stage.backward_weight(0, mb)
            else:
                (grad_in,) = stage.backward(0, mb, [grad_out])
        assert stage.num_saved == 0
        results.append((grad_in, [p.grad for _, layer in stage.layers for p in layer.parameters()]))
    (grad_b, params_b), (grad_i, params_w) = results
    assert grad_b is not None and grad_i is not None
    torch.testing.assert_close(grad_i, grad_b, rtol=0, atol=TOL)
    for got, want in zip(params_w, params_b, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_a_recomputed_run_keeps_only_its_input() -> None:
    """Between forward and backward a recomputed run holds no outputs (no graph); a kept run
    holds its outputs; each run's input is the previous run's output, detached."""
    torch.manual_seed(4)
    stage = stage_of(dropout_net(), {1, 2})
    stage.begin_step(0, 1)
    out = stage.forward(0, 0, torch.randn(3, 32, dtype=torch.float64).requires_grad_())
    runs = stage._saved[(0, 0)].runs
    assert runs is not None
    assert [(r.start, r.stop, r.outputs is not None) for r in runs] == [
        (0, 1, False), (1, 3, True), (3, 4, False)]
    assert all(x.grad_fn is None for r in runs for x in r.inputs)
    assert out.requires_grad and out.grad_fn is None  # the last run's, computed without graph


def test_the_architecture_page_example_runs() -> None:
    """docs/ARCHITECTURE.md's selective re-materialization example, whose asserts run."""
    from tests.test_docs import ROOT, blocks

    (code,) = blocks(ROOT / "docs" / "ARCHITECTURE.md", "python")[-1:]
    assert "checkpoints=[\"selective\"]" in code
    exec(compile(code, "ARCHITECTURE.md", "exec"), {})  # noqa: S102
