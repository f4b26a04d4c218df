"""Shared fixtures: every test starts from the same seed, on one CPU thread; the apps' data
(an NMT corpus with its SentencePiece model, AmoebaNet shards) is built once per session.

The data fixtures import the apps' modules when first used, so the library's own tests
(``make test-unit``) never import them.
"""

from __future__ import annotations

from pathlib import Path

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


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test's catalogs (4 languages, 40-600 messages) prepared like the real corpus, with a
    400-piece SentencePiece model; shared by every test that reads it (none writes into it)."""
    from data.gettext_m2en.prepare import prepare
    from tests.apps.test_nmt_data import PREPARE_ARGS, build_locale_tree

    root = tmp_path_factory.mktemp("catalogs")
    build_locale_tree(root)
    out = tmp_path_factory.mktemp("corpus")
    prepare(out, locale_roots=[root], **PREPARE_ARGS)
    return out


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test's images as AmoebaNet shards with dataset.json, written with the shard format's
    writer (read-only for the tests)."""
    from data.image_shards import write_dataset_json, write_split
    from tests.apps.test_amoebanet_train import (
        CLASSES,
        TEST_IMAGES,
        TRAIN_IMAGES,
        synthetic_samples,
    )

    out = tmp_path_factory.mktemp("shards")
    splits = {
        "train": write_split(synthetic_samples("train", TRAIN_IMAGES, 0), out, "train",
                             num_classes=len(CLASSES), max_per_shard=16),
        "test": write_split(synthetic_samples("test", TEST_IMAGES, 1), out, "test",
                            num_classes=len(CLASSES), max_per_shard=12),
    }
    write_dataset_json(out, name="synthetic", classes=CLASSES, image_mode="L", splits=splits)
    return out
