"""Costs counted on meta match a real CPU run byte for byte and hand-counted FLOPs; the
planner built on them refuses a budget nothing fits, saying by how much."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor, nn

import gpipe_core as gp
from gpipe_core.partition import _bisected_balance, optimal_balance
from scripts.harness import LiveTensorBytes
from scripts.reproduction import layer_memory


class SquareOfViews(nn.Module):
    """Saves two views of one storage for backward (``a * b`` keeps both operands)."""

    def forward(self, x: Tensor) -> Tensor:
        h = x * 2.0
        return (h.view(-1) * h.view(-1)).view_as(x)


class EncoderBlock(nn.Module):
    """The NMT app's encoder layer on a plain tensor: attention then feed-forward."""

    def __init__(self, d_model: int, ffn_dim: int, num_heads: int) -> None:
        super().__init__()
        from apps.nmt.model import EncoderLayer

        self.layer = EncoderLayer(d_model, ffn_dim, num_heads=num_heads,
                                  head_dim=d_model // num_heads, dropout=0.0,
                                  attention_dropout=0.0, ffn_init_scale=1.0)

    def forward(self, x: Tensor) -> Tensor:
        pad = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        return self.layer((x, x, pad, pad))[0]


class TwoBranches(nn.Module):
    """Two branches concatenated, as an AmoebaNet cell ends: the branches' outputs exist only
    while the layer runs, beside the concatenation made of them; nothing is saved."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x * 2.0, x * 3.0], dim=1)


def small_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.LayerNorm(12),
                         SquareOfViews(), nn.Tanh(), nn.Linear(12, 4))


def test_saved_bytes_match_a_real_cpu_run_exactly() -> None:
    model, x = small_model(), torch.randn(5, 8)
    costs = gp.layer_costs(model, x)
    assert costs.batch_size == 5 and costs.param_count == [
        sum(p.numel() for p in layer.parameters()) for layer in model]
    # Layer by layer against the storages autograd saves on real tensors (the first layer's
    # input is the model's, which the CPU count leaves out, as a stage's received input).
    measured = layer_memory(model, x, None, None).saved
    counted = [s + i for s, i in zip(costs.saved_bytes, costs.saved_input_bytes, strict=True)]
    assert counted[1:] == measured[1:]
    assert counted[0] == costs.input_bytes[0] == 5 * 8 * 4  # Linear saves its input
    assert costs.saved_bytes[4] == 5 * 12 * 4  # two views of one storage, counted once
    # The whole forward: what stays alive holding the output is what the model keeps for
    # backward (bar its input) plus the output, which the last Linear does not save.
    with LiveTensorBytes([x, list(model.parameters())]) as live:
        y = model(x)
    kept = costs.kept_bytes(0, len(model)) - costs.input_bytes[0]
    assert live.current == kept + costs.output_bytes[-1] == kept + y.numel() * 4


def test_costs_scale_with_the_batch_and_a_meta_model_allocates_nothing() -> None:
    with torch.device("meta"):
        model = small_model()
    one = gp.layer_costs(model, torch.empty(1, 8, device="meta"))
    five = gp.layer_costs(model, torch.empty(5, 8, device="meta"))
    scaled = one.scaled(5)
    assert scaled.saved_bytes == five.saved_bytes and scaled.forward_flops == five.forward_flops
    assert scaled.param_bytes == five.param_bytes and scaled.forward_ops == five.forward_ops
    assert all(p.device.type == "meta" for p in model.parameters())


def test_outputs_a_layer_did_not_save_and_saved_bytes_that_do_not_grow_with_the_batch() -> None:
    # Linear saves its input, not its output; ReLU saves its output; BatchNorm1d saves its
    # input (ReLU's output, saved already) and two per-channel statistics, whatever the batch
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16))
    four = gp.layer_costs(model, torch.randn(4, 8))
    assert four.output_unsaved_bytes == [4 * 16 * 4, 0.0, 4 * 16 * 4]
    assert four.saved_fixed_bytes == [0.0, 0.0, 2 * 16 * 4] == [0.0, 0.0, four.saved_bytes[2]]
    # so a batch's count scales to another batch's exactly, the statistics kept whole
    sixteen = gp.layer_costs(model, torch.randn(16, 8))
    assert four.scaled(16).saved_bytes == sixteen.saved_bytes
    assert four.scaled(16).output_unsaved_bytes == sixteen.output_unsaved_bytes


def test_what_a_forward_holds_only_while_it_runs_is_the_hand_count() -> None:
    # TwoBranches on a (4, 16) float input (256 bytes): two branch outputs of 256 bytes beside
    # the 512-byte concatenation, which alone remains; on the ReLU's (4, 32), twice that. A
    # layer's input is freed once it returns where neither it nor the layer before saved it:
    # TwoBranches' after the Linear (which saves its input, not its output), the ReLU's (it
    # saves its output), not TwoBranches' after the ReLU; the model's input (the caller's) never
    model = nn.Sequential(nn.Linear(8, 16), TwoBranches(), nn.ReLU(), TwoBranches())
    costs = gp.layer_costs(model, torch.randn(4, 8))
    size = 4 * 16 * 4
    assert costs.forward_working_bytes == [0.0, 2 * size, 0.0, 4 * size]
    assert costs.input_freed_bytes == [0.0, size, 2 * size, 0.0]
    # and they are what a real run holds at its peak: the chain's state after the layer
    # before, plus the layer's new storages at their most
    x = torch.randn(4, 8)
    with LiveTensorBytes([x, *model.parameters()]) as live:
        h = model[0](x.requires_grad_())
        before = live.current
        h = model[1](h)
        after = live.current
        assert live.peak == after + costs.forward_working_bytes[1] + costs.input_freed_bytes[1]
        assert after == before - size + 2 * size  # its input freed, its output made
        del h


def test_linear_flops_are_the_hand_count() -> None:
    batch, fan_in, fan_out = 3, 7, 5
    costs = gp.layer_costs(nn.Sequential(nn.Linear(fan_in, fan_out)), torch.randn(batch, fan_in))
    assert costs.forward_flops == [2 * batch * fan_in * fan_out]
    # input gradient and weight gradient: two products of the forward's size
    assert costs.backward_flops == [4 * batch * fan_in * fan_out]


def test_attention_layer_flops_are_the_hand_count() -> None:
    batch, length, d_model, ffn_dim, heads = 2, 6, 16, 32, 4
    costs = gp.layer_costs(nn.Sequential(EncoderBlock(d_model, ffn_dim, heads)),
                           torch.randn(batch, length, d_model))
    tokens = batch * length
    projections = 4 * 2 * tokens * d_model * d_model  # query, key, value, out
    scores_and_context = 2 * 2 * batch * length * length * d_model  # QK^T and PV, all heads
    feed_forward = 2 * 2 * tokens * d_model * ffn_dim
    assert costs.forward_flops == [projections + scores_and_context + feed_forward]
    assert costs.backward_flops == [2 * costs.forward_flops[0]]


def test_device_runs_small_work_below_peak() -> None:
    device = gp.DEVICES["h100_80gb"]
    assert device.utilisation(1e14, 10) == pytest.approx(device.achievable, rel=1e-3)
    assert device.utilisation(1e6, 10) < 0.01
    assert device.transfer_seconds(0) == 0.0
    with pytest.raises(ValueError, match="unknown device 'tpu_v9'; presets: tpu_v2"):
        gp.get_device("tpu_v9")


def test_plan_from_costs_refuses_an_impossible_budget_saying_by_how_much() -> None:
    model, x = small_model(), torch.randn(4, 8)
    costs = gp.layer_costs(model, x)
    params = costs.num_parameters * 16  # Adam: 16 bytes per parameter
    tiny = gp.DEVICES["a100_80gb"].with_memory(params / 4)
    with pytest.raises(gp.NoPlanFits, match=r"needs .* GiB, .* over; allow more stages") as error:
        gp.plan(costs, device=tiny, optimizer="adam", batch_size=8, max_stages=2)
    assert error.value.smallest_peak > tiny.memory_bytes
    roomy = gp.plan(costs, device=gp.DEVICES["a100_80gb"], optimizer="adam", batch_size=8,
                    max_stages=2)
    best = roomy[0]
    assert best.peak_bytes == max(p + a for p, a in zip(best.param_bytes, best.activation_bytes,
                                                        strict=True))
    assert sum(best.param_bytes) == pytest.approx(params * 1.0)
    assert best.step_time > 0


def test_plan_largest_finds_the_last_fitting_size() -> None:
    ladder = [1, 2, 4, 8, 16]

    def costs_for(width: int) -> gp.LayerCosts:
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(8 * width, 8 * width) for _ in range(4)])
        return gp.layer_costs(model, torch.empty(2, 8 * width, device="meta"))

    per_parameter = 12.0
    device = gp.DEVICES["p100"].with_memory(per_parameter * 4 * (64 * 64 + 64) * 1.3)
    found = gp.plan_largest(ladder, costs_for, stages=[1, 2, 4], device=device,
                            optimizer=per_parameter, batch_size=2)
    assert found[1] is not None and ladder[found[1][0]] == 8  # 64 wide fits, 128 not
    assert found[4] is not None and ladder[found[4][0]] == 16
    assert found[4][1].num_ranks == 4
    # Models with fewer layers than K are too small, not too big: the search goes up.
    deep = gp.plan_largest(ladder, costs_for, stages=[8], device=device.with_memory(1e12),
                           optimizer=per_parameter, batch_size=2)
    assert deep[8] is None  # every entry has 4 layers: none can be cut in 8


def test_bisected_balance_matches_the_dynamic_programme() -> None:
    rng = random.Random(0)
    for n, k in [(40, 5), (25, 25), (60, 7), (9, 1)]:
        costs = [rng.random() * 10 for _ in range(n)]
        prefix = [0.0]
        for c in costs:
            prefix.append(prefix[-1] + c)
        fast = _bisected_balance(prefix, k)
        assert len(fast) == k and sum(fast) == n and min(fast) >= 1
        assert fast.max_cost == pytest.approx(optimal_balance(costs, k).max_cost, rel=1e-9)


def test_identical_layers_counted_once_give_the_full_count() -> None:
    from apps.amoebanet.model import build_amoebanet
    from apps.nmt.model import transformer

    def amoeba() -> nn.Sequential:
        return build_amoebanet("meta", genotype="D", num_normal_cells=9, filters=8,
                               num_classes=10, in_chans=3, stem_stride=1)

    def nmt() -> nn.Sequential:
        with torch.device("meta"):
            return transformer(num_layers=4, d_model=32, ffn_dim=64, num_heads=2, head_dim=16,
                               vocab_size=100)

    ids = torch.zeros(2, 7, dtype=torch.long, device="meta")
    for build, sample in ((amoeba, torch.empty(2, 3, 16, 16, device="meta")),
                          (nmt, (ids, ids))):
        # fresh models: the NMT layers record activation statistics, which adds operators
        # after a layer's first call
        full = gp.layer_costs(build(), sample)
        reused = gp.layer_costs(build(), sample, same_layer=gp.costs.structural_key)
        assert reused == full


def _backward_peak_on_cpu(layer: nn.Module, x: Tensor) -> tuple[int, int]:
    """(the most bytes one backward of ``layer`` on real tensors holds at once above what its
    forward saved, its received gradient included; the bytes of the parameter gradients it
    left)."""
    from gpipe_core.costs import _Allocations

    x = x.detach().requires_grad_(True)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    grad = torch.ones_like(y)
    allocations = _Allocations()  # what the forward saved counts from the start
    allocations.hold([t for t in saved if not any(t.untyped_storage()._cdata
                                                  == p.untyped_storage()._cdata
                                                  for p in layer.parameters())])
    saved.clear()
    with allocations:
        y.backward(grad)
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    return (allocations.peak() + grad.numel() * grad.element_size(),
            sum(g.numel() * g.element_size() for g in grads))


@pytest.mark.parametrize("trainable", [False, True])
def test_backward_bytes_match_a_real_cpu_run(trainable: bool) -> None:
    """What each layer's backward holds at once, counted on meta, against the same backward on
    real tensors: exactly, with frozen parameters and with trainable ones (whose fresh
    gradients the count includes: beside the gradients held from an earlier micro-batch they
    are temporaries). (Attention runs another kernel on meta than on the CPU, the math one
    against flash attention, holding the same bytes.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*small_model(), nn.Sequential(nn.Linear(4, 16), nn.GELU()))
    block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1))
    for module, x in ((model, torch.randn(5, 8)), (block, torch.randn(4, 3, 10, 10)),
                      (nn.Sequential(EncoderBlock(16, 32, 2)), torch.randn(3, 7, 16))):
        module.requires_grad_(trainable)
        costs = gp.layer_costs(module, x)
        for i, layer in enumerate(module):
            peak, _ = _backward_peak_on_cpu(layer, x)
            x = layer(x).detach()
            assert costs.backward_bytes[i] + costs.backward_fixed_bytes[i] == peak, (i, layer)


class TwoLookups(nn.Module):
    """One embedding read twice (the NMT app's source and target tokens): its backward sums two
    weight-sized gradients, whatever the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 8)

    def forward(self, tokens: tuple[Tensor, Tensor]) -> Tensor:
        return self.embedding(tokens[0]) + self.embedding(tokens[1])


def test_the_part_of_a_backward_that_does_not_grow_with_the_batch_is_apart() -> None:
    """Both weight-sized gradients of a weight used twice are alive when they are summed, and
    so is their sum (a fresh gradient, beside the one held from an earlier micro-batch):
    counted once, as ``backward_fixed_bytes``, while the received gradient scales with the
    batch (counting the whole as per-sample multiplied the embedding's 4 MB by the batch)."""
    for batch in (3, 6):
        tokens = (torch.randint(0, 50, (batch, 5)), torch.randint(0, 50, (batch, 5)))
        costs = gp.layer_costs(nn.Sequential(TwoLookups()), tokens)
        assert costs.backward_fixed_bytes == [3 * 50 * 8 * 4]
        assert costs.backward_bytes == costs.output_bytes == [batch * 5 * 8 * 4]
        doubled = costs.scaled(2 * batch)
        assert doubled.backward_fixed_bytes == [3 * 50 * 8 * 4]
        assert doubled.backward_bytes == [2 * batch * 5 * 8 * 4]


def test_traffic_counts_the_bytes_of_the_operators_without_flops() -> None:
    """ReLU reads its input and writes its output; its backward reads the received gradient
    and the saved output and writes the input's gradient. A linear layer's work is all FLOPs
    (``addmm``); its backward's bias gradient is a reduction of the received gradient."""
    x = torch.randn(8, 100)
    relu = gp.layer_costs(nn.Sequential(nn.ReLU()), x)
    assert relu.forward_traffic_bytes == [2 * 8 * 100 * 4]
    assert relu.backward_traffic_bytes == [3 * 8 * 100 * 4]
    assert relu.forward_traffic_fixed_bytes == relu.backward_traffic_fixed_bytes == [0.0]
    linear = gp.layer_costs(nn.Sequential(nn.Linear(100, 10)), x)
    assert linear.forward_traffic_bytes == [0.0]
    assert linear.backward_traffic_bytes == [8 * 10 * 4]  # the received gradient, read once
    assert linear.backward_traffic_fixed_bytes == [10 * 4]  # the bias gradient, written once
    halved = relu.scaled(4)
    assert halved.forward_traffic_bytes == [4 * 100 * 4 * 2]


def test_traffic_of_a_weight_sized_gradient_does_not_grow_with_the_batch() -> None:
    """The embedding's backward writes a gradient the size of its table at any batch: counted
    as fixed traffic, the tokens' part growing with the batch."""
    for batch in (3, 6):
        tokens = torch.randint(0, 50, (batch, 5))
        costs = gp.layer_costs(nn.Sequential(nn.Embedding(50, 8)), tokens)
        assert costs.backward_traffic_fixed_bytes[0] >= 50 * 8 * 4
        assert costs.backward_traffic_bytes[0] > 0
        grown = costs.scaled(2 * batch)
        assert grown.backward_traffic_fixed_bytes == costs.backward_traffic_fixed_bytes
        assert grown.backward_traffic_bytes[0] == 2 * costs.backward_traffic_bytes[0]


def test_a_device_with_memory_bandwidth_prices_the_traffic() -> None:
    device = gp.Device("core", memory_bytes=2**30, peak_flops=1e9, achievable=0.5,
                       op_overhead=1e-6, memory_bandwidth=1e9)
    assert device.compute_seconds(1e9, 10, 3e9) == pytest.approx(10e-6 + 2.0 + 3.0)
    unpriced = gp.Device("core", memory_bytes=2**30, peak_flops=1e9, achievable=0.5,
                         op_overhead=1e-6)
    assert unpriced.compute_seconds(1e9, 10, 3e9) == pytest.approx(10e-6 + 2.0)
    with pytest.raises(ValueError, match=r"memory_bandwidth=-1.0 must be bytes/s >= 0"):
        gp.Device("core", memory_bytes=2**30, peak_flops=1e9, memory_bandwidth=-1.0)


def test_the_planner_adds_each_layers_traffic_over_the_bandwidth() -> None:
    """One stage, one micro-batch, nothing recomputed: the step is the layers' forward and
    backward seconds, so the bandwidth adds exactly the counted traffic over it."""
    model, x = small_model(), torch.randn(16, 8)
    costs = gp.layer_costs(model, x)
    traffic = sum(costs.forward_traffic_bytes + costs.backward_traffic_bytes
                  + costs.forward_traffic_fixed_bytes + costs.backward_traffic_fixed_bytes)
    assert traffic > 0
    steps = {}
    for bandwidth in (0.0, 1e8):
        device = gp.Device("core", memory_bytes=2**30, peak_flops=1e9, op_overhead=1e-6,
                           memory_bandwidth=bandwidth)
        steps[bandwidth] = gp.plan(costs, device=device, optimizer="sgd", batch_size=16,
                                   stages=[1], microbatches=[1], checkpoints=["never"])[0]
    assert steps[1e8].step_time - steps[0.0].step_time == pytest.approx(traffic / 1e8,
                                                                          rel=1e-9)
