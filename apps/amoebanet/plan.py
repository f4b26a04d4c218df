"""Plan AmoebaNet(L, D) training for a cluster: ``python -m apps.amoebanet.plan --config
apps/amoebanet/configs/d_72_512.yaml --device tpu_v2 --devices 8``.

Prints the fastest plan (K, M, schedule, re-materialization, balance, step time, images per
second, memory per device) for the config's model, counted on ``meta``; ``--largest`` grows L
(normal cells) at the config's D and prints the largest that fits for each K.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from apps.amoebanet.config import AmoebaNetConfig, build_model, load_amoebanet_config
from apps.config import ConfigError
from apps.planning import (
    AppModel,
    config_error,
    optimizer_name,
    parser,
    run,
    split_overrides,
)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def app_model(config: AmoebaNetConfig) -> AppModel:
    """The planner's view of the config's model: built on ``meta``, ``batch_size`` images."""

    def build(depth: int) -> torch.nn.Sequential:
        return build_model(dataclasses.replace(config, num_normal_cells=depth), device="meta")

    side = config.image_size

    def loss(logits: torch.Tensor) -> torch.Tensor:  # the train script's, on hard labels
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits.float(), target, label_smoothing=config.label_smoothing)

    return AppModel(
        build=build, depth=config.num_normal_cells, depth_name="L",
        # two images: training BatchNorm needs more than one value per channel (1x1 maps)
        sample=torch.empty(2, config.in_chans, side, side, device="meta"),
        example=lambda n: torch.randn(n, config.in_chans, side, side,
                                      generator=torch.Generator().manual_seed(config.seed)),
        batch_size=config.batch_size, unit="images", tokens_per_sample=1,
        optimizer=optimizer_name(config.optimizer, config.momentum),
        describe=f"AmoebaNet-{config.genotype}({config.num_normal_cells}, {config.filters}) at "
                 f"{side}x{side}", loss=loss)


def main(argv: Sequence[str] | None = None) -> int:
    options, overrides = split_overrides(argv)
    args = parser("amoebanet").parse_args(options)
    path = args.config
    if not Path(path).exists() and (CONFIG_DIR / f"{path}.yaml").is_file():
        path = str(CONFIG_DIR / f"{path}.yaml")
    try:
        config = load_amoebanet_config([f"--config={path}", *overrides])
    except ConfigError as error:
        return config_error(error, CONFIG_DIR)
    return run(app_model(config), args)


if __name__ == "__main__":
    sys.exit(main())
