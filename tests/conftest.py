"""Shared fixtures: every test starts from the same seed, on one CPU thread."""

from __future__ import annotations

import pytest
import torch

# Relative tolerance between float32 results of the same arithmetic done in another order:
# another number of processes, replicas or micro-batches (so other batch shapes, other kernel
# accumulation orders, sums gathered in another order). Each float32 operation rounds at
# eps = 2**-23 (1.2e-7) relative, a logit is a chain of accumulations that can differ by a few
# ulps between two such orders, and a loss averages many of them: 64 eps (7.6e-6) covers that,
# while a real fault (a lost or doubled sample, a stale weight) moves a loss by 1e-3 or more.
# Where the arithmetic is float64 and in the same order, tests compare exactly or at 1e-10.
FLOAT32_REORDERED_REL = 64 * torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
