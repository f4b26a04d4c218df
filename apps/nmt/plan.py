"""Plan T(L, H, A) training for a cluster: ``python -m apps.nmt.plan --config t64_16384_32``.

Prints the fastest plan (K, M, schedule, re-materialization, balance, step time, tokens per
second, memory per device) for the config's model, counted on ``meta``; ``--largest`` grows
L (encoder and decoder layers each) and prints the largest that fits for each K. A batch is
``max_tokens`` split in sentence pairs of ``max_len`` tokens a side (``--batch`` overrides).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import torch

from apps.config import ConfigError
from apps.nmt.config import CONFIG_DIR, NMTConfig, build_model, load_nmt_config
from apps.nmt.model import token_cross_entropy_sum
from apps.planning import (
    AppModel,
    config_error,
    optimizer_name,
    parser,
    run,
    split_overrides,
)


def app_model(config: NMTConfig) -> AppModel:
    """The planner's view of the config's model: built on ``meta``, one sentence pair of
    ``max_len`` tokens a side, a batch of ``max_tokens`` split in such pairs."""
    seq = config.max_len

    def build(depth: int) -> torch.nn.Sequential:
        return build_model(dataclasses.replace(config, num_layers=depth), device="meta")

    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")

    def loss(logits: torch.Tensor) -> torch.Tensor:
        target = torch.full(logits.shape[:-1], config.eos_id, dtype=torch.long,
                            device=logits.device)
        return token_cross_entropy_sum(logits, target, pad_id=config.pad_id,
                                       label_smoothing=config.label_smoothing,
                                       z_loss=config.z_loss)

    def example(n: int) -> tuple[torch.Tensor, torch.Tensor]:  # tokens, none of them special
        generator = torch.Generator().manual_seed(config.seed)
        tokens = torch.randint(4, config.vocab_size, (2, n, seq), generator=generator)
        return tokens[0], tokens[1]

    return AppModel(
        build=build, depth=config.num_layers, depth_name="L", sample=(ids, ids),
        example=example,
        batch_size=max(1, config.max_tokens // (2 * seq)), unit="sentence pairs",
        tokens_per_sample=2 * seq, optimizer=optimizer_name(config.optimizer),
        describe=f"T({config.num_layers}, {config.ffn_dim}, {config.num_heads}) d_model "
                 f"{config.d_model}, vocabulary {config.vocab_size}, {seq} tokens a side",
        loss=loss)


def main(argv: Sequence[str] | None = None) -> int:
    options, overrides = split_overrides(argv)
    args = parser("nmt").parse_args(options)
    try:
        config = load_nmt_config([f"--config={args.config}", *overrides])
    except ConfigError as error:
        return config_error(error, CONFIG_DIR)
    return run(app_model(config), args)


if __name__ == "__main__":
    sys.exit(main())
