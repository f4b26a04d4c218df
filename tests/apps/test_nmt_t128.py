"""The 128-layer configuration (issue 39): it builds on meta, balances, and trains a step on 2
ranks (tiny data) with its own settings, the largest logits recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpipe_core as gp
from apps.nmt.config import build_model, load_nmt_config
from tests.apps import test_nmt_train as nmt


def test_t128_builds_on_meta_and_balances() -> None:
    config = load_nmt_config(["--config=cpu_t128"])
    assert config.num_layers == 64 and config.scaled_init and config.clip_logits
    model = build_model(config, device="meta")
    assert len(model) == 130  # embedding, 64 encoder layers, 64 decoder layers, output
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated
    parameters = sum(p.numel() for p in model.parameters())
    assert 7.9e6 < parameters < 8.1e6
    balance = gp.balance_by_params(model, config.num_stages)
    assert sum(balance) == 130 and min(balance) > 30


@pytest.mark.slow
@pytest.mark.distributed
def test_t128_takes_a_step_on_two_ranks(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "t128"
    nmt.torchrun(nmt.tiny_args(corpus, out, config="cpu_t128", train_steps=2, max_tokens=128,
                               languages="[]", bucket_thresholds="null", warmup_steps=1,
                               max_decode_len=4, eval_max_sentences=2, beam_size=1,
                               dropout=0.1), timeout_s=300)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["loss"] > 0
        assert len(record["attn_logit_enc"]) == 64  # every layer's largest attention logit
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    balance = json.loads((out / (out / "latest").read_text().strip() / "index.json")
                         .read_text())["pipeline"]["balance"]
    assert sum(balance) == 130
