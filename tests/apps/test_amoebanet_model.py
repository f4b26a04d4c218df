"""AmoebaNet model and config: paper parameter counts, the (x, skip) contract, shapes, errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from apps.amoebanet.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    AmoebaNetConfig,
    build_model,
    load_amoebanet_config,
    optimizer_kwargs,
)
from apps.amoebanet.genotype import CellGenotype, get_genotype
from apps.amoebanet.model import (
    Cell,
    ImageTooSmallError,
    amoebanet,
    build_amoebanet,
    cell_layout,
    count_parameters,
    min_image_size,
)
from apps.config import ConfigError

# (YAML, the paper's rounded parameter count with 1000 classes)
PAPER_CONFIGS = [
    ("d_18_208.yaml", 82e6),
    ("d_18_416.yaml", 318e6),
    ("d_18_544.yaml", 542e6),
    ("d_36_544.yaml", 1.05e9),
    ("d_72_512.yaml", 1.8e9),
    ("b_18_512.yaml", 557e6),
]


def tiny(**overrides: object) -> nn.Sequential:
    kwargs: dict[str, object] = {"num_normal_cells": 3, "filters": 8, "num_classes": 5,
                                 "in_chans": 1, "stem_stride": 1}
    kwargs.update(overrides)
    return amoebanet(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("yaml_name", "paper_count"), PAPER_CONFIGS)
def test_parameter_counts_match_the_paper(yaml_name: str, paper_count: float) -> None:
    config = load_amoebanet_config([f"--config={CONFIG_DIR / yaml_name}"])
    assert config.num_classes == 1000
    model = build_model(config, device="meta")
    count = count_parameters(model)
    assert abs(count / paper_count - 1) < 0.03, f"{yaml_name}: {count:,} vs paper {paper_count:,}"


def test_meta_build_of_the_largest_model_is_fast_and_allocates_nothing() -> None:
    start = time.perf_counter()
    model = build_amoebanet("meta", genotype="D", num_normal_cells=72, filters=512)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"building AmoebaNet-D(72,512) on meta took {elapsed:.1f} s"
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    # a meta model still runs shape inference end to end
    logits = model(torch.empty(2, 3, 224, 224, device="meta"))
    assert logits.shape == (2, 1000)


def test_cell_names_and_layout() -> None:
    model = tiny(num_normal_cells=6)
    assert list(dict(model.named_children())) == [
        "stem", "cell1_reduction", "cell2_reduction", "cell3_normal", "cell4_normal",
        "cell5_reduction", "cell6_normal", "cell7_normal", "cell8_reduction", "cell9_normal",
        "cell10_normal", "classify",
    ]
    names = [name for name, _ in build_amoebanet("meta", num_normal_cells=18).named_children()]
    assert len(names) == 18 + 6
    assert [n for n in names if n.endswith("reduction")] == [
        "cell1_reduction", "cell2_reduction", "cell9_reduction", "cell16_reduction"]
    assert cell_layout(1) == ["reduction", "reduction", "reduction", "reduction", "normal"]
    assert cell_layout(0).count("reduction") == 4


def test_filters_double_at_each_reduction() -> None:
    model = build_amoebanet("meta", num_normal_cells=6, filters=64)
    widths = {name: cell.preprocess_x[1].out_channels
              for name, cell in model.named_children() if isinstance(cell, Cell)}
    assert widths["cell1_reduction"] == 16 and widths["cell2_reduction"] == 32
    assert widths["cell3_normal"] == 64 and widths["cell5_reduction"] == 128
    assert widths["cell7_normal"] == 128 and widths["cell10_normal"] == 256


@pytest.mark.parametrize("genotype", ["D", "B"])
def test_tuple_contract_layer_by_layer(genotype: str) -> None:
    model = tiny(genotype=genotype).eval()
    image = torch.randn(2, 1, 28, 28)
    state = model.stem(image)
    assert isinstance(state, tuple) and len(state) == 2 and state[0] is state[1]
    for name, layer in list(model.named_children())[1:-1]:
        x, skip = state
        state = layer(state)
        assert isinstance(state, tuple) and len(state) == 2, name
        assert state[1] is x, f"{name} must return its input x as the next skip"
    logits = model.classify(state)
    assert logits.shape == (2, 5)
    torch.testing.assert_close(logits, model(image))


@pytest.mark.parametrize(
    ("genotype", "in_chans", "height", "width", "num_classes", "stem_stride"),
    [
        ("D", 1, 28, 28, 10, 1),
        ("D", 1, 28, 28, 10, 2),
        ("D", 3, 32, 32, 1000, 2),
        ("D", 3, 37, 45, 7, 2),  # odd, non-square: every stride-2 op rounds up alike
        ("B", 3, 17, 17, 2, 2),  # the smallest size with a stride-2 stem
        ("B", 1, 9, 9, 3, 1),  # the smallest size with a stride-1 stem
        ("B", 4, 64, 48, 1, 2),
    ],
)
def test_forward_shapes(genotype: str, in_chans: int, height: int, width: int,
                        num_classes: int, stem_stride: int) -> None:
    model = tiny(genotype=genotype, in_chans=in_chans, num_classes=num_classes,
                 stem_stride=stem_stride)
    logits = model(torch.randn(3, in_chans, height, width))
    assert logits.shape == (3, num_classes)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("genotype", ["D", "B"])
def test_full_batch_equals_concatenated_half_batches_in_eval(genotype: str) -> None:
    # what the pipeline relies on: in eval, samples do not interact across a batch
    model = tiny(genotype=genotype, drop_path=0.3, dropout=0.5).double()
    model.train()
    model(torch.randn(8, 1, 20, 20, dtype=torch.float64))  # non-trivial BN running stats
    model.eval()
    images = torch.randn(6, 1, 20, 20, dtype=torch.float64)
    halves = torch.cat([model(images[:3]), model(images[3:])])
    torch.testing.assert_close(model(images), halves, rtol=0, atol=1e-12)


def test_every_parameter_gets_a_gradient() -> None:
    model = tiny(genotype="B")
    model(torch.randn(4, 1, 16, 16)).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_image_too_small_names_size_reductions_and_minimum() -> None:
    model = tiny(stem_stride=2)
    with pytest.raises(ImageTooSmallError) as info:
        model(torch.randn(1, 1, 16, 16))
    message = str(info.value)
    assert "16x16" in message and "5 stride-2 reductions" in message and "17x17" in message
    assert min_image_size(stem_stride=1) == 9
    with pytest.raises(ConfigError, match="4 stride-2 reductions"):
        load_amoebanet_config(["--image_size=8", "--stem_stride=1"])


def test_drop_path_is_random_in_training_and_identity_in_eval() -> None:
    torch.manual_seed(1)
    dropped = tiny(drop_path=0.5)
    plain = tiny(drop_path=0.0)
    plain.load_state_dict(dropped.state_dict())  # DropPath has no parameters
    images = torch.randn(4, 1, 16, 16)

    dropped.train()
    plain.train()
    torch.manual_seed(2)
    first = dropped(images)
    torch.manual_seed(3)
    second = dropped(images)
    assert not torch.allclose(first, second), "drop-path should resample paths per forward"
    torch.manual_seed(2)
    torch.testing.assert_close(dropped(images), first)  # reproducible from the RNG state
    assert not torch.allclose(first, plain(images))

    dropped.eval()
    plain.eval()
    plain.load_state_dict(dropped.state_dict())  # same BatchNorm running statistics
    torch.testing.assert_close(dropped(images), plain(images))


def test_genotype_errors() -> None:
    assert get_genotype("d").name == "D"
    with pytest.raises(ValueError, match="unknown genotype 'C'"):
        get_genotype("C")
    with pytest.raises(ValueError, match="unknown op"):
        CellGenotype(ops=("conv_9x9", "none"), inputs=(0, 1), concat=(2,))
    with pytest.raises(ValueError, match="reads state 3"):
        CellGenotype(ops=("none", "none"), inputs=(0, 3), concat=(2,))


# --- config ------------------------------------------------------------------------------------


def test_config_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="fliters"):
        load_amoebanet_config(["--fliters=32"])


def test_config_yaml_then_command_line_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("filters: 48\nnum_normal_cells: 9\nmean: [0.5, 0.5, 0.5]\n"
                    "std: [0.25, 0.25, 0.25]\nin_chans: 3\n")
    config = load_amoebanet_config([f"--config={path}", "--num_normal_cells=12", "--lr=0.1"])
    assert config.filters == 48  # from YAML
    assert config.num_normal_cells == 12  # command line beats YAML
    assert config.lr == 0.1 and config.mean == (0.5, 0.5, 0.5)
    assert config.dropout == AmoebaNetConfig().dropout  # untouched default
    with pytest.raises(ConfigError, match="one value per channel"):
        load_amoebanet_config([f"--config={path}", "--in_chans=1"])
    with pytest.raises(ConfigError, match="genotype='C'"):
        load_amoebanet_config(["--genotype=C"])


def test_default_config_is_the_cpu_fashion_mnist_model() -> None:
    config = load_amoebanet_config([f"--config={DEFAULT_CONFIG}"])
    assert config.dataset == "fashion_mnist" and config.in_chans == 1
    assert config.num_classes == 10 and config.num_stages == 2
    model = build_model(config)
    assert count_parameters(model) < 2_000_000
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_optimizer_kwargs_feed_timm() -> None:
    from timm.optim import create_optimizer_v2

    config = load_amoebanet_config(["--optimizer=rmsproptf", "--opt_eps=1.0"])
    optimizer = create_optimizer_v2(tiny(), **optimizer_kwargs(config))
    assert type(optimizer).__name__ == "RMSpropTF"
    assert optimizer.defaults["alpha"] == 0.9 and optimizer.defaults["eps"] == 1.0
