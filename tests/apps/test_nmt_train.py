"""NMT training end to end: the real loop under torchrun, exact resume, BLEU, and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import gpipe_core as gp
from apps.config import ConfigError, save_config
from apps.harness.checkpoints import CheckpointError
from apps.nmt import train
from apps.nmt.checkpoint_loading import TokenizerMismatch, load_checkpoint
from apps.nmt.config import NMTConfig, build_model, load_nmt_config, replace
from apps.nmt.data import CorpusError, load_tokenizer
from apps.nmt.decoding import mean_token_loss
from apps.nmt.evaluate import evaluate_checkpoint
from apps.nmt.model import token_cross_entropy_sum
from tests.conftest import FLOAT32_REORDERED_REL
from tests.distributed import launch
from tests.distributed.launch import spawn

VOCAB = 400  # the smallest the synthetic corpus allows (bytes + specials + tags + pieces)


def tiny_args(corpus: Path, out_dir: Path, **changes: Any) -> list[str]:
    settings: dict[str, Any] = {
        "config": "tiny",
        "data_dir": corpus,
        "packages": "none",  # use the test's corpus as it is
        "vocab_size": VOCAB,
        "out_dir": out_dir,
        "wandb_mode": "disabled",
        "dropout": 0.1,  # resume must reproduce the dropout masks too
        "eval_every": 0,
        "ckpt_every": 0,
        "log_every": 2,
        "eval_max_sentences": 6,
        "beam_size": 2,
        "max_decode_len": 12,
    }
    settings.update(changes)
    return [f"--{key}={value}" for key, value in settings.items()]


def torchrun(args: list[str], *, timeout_s: float = 150.0, nproc: int = 2) -> str:
    """apps.nmt.train under torchrun with ``nproc`` ranks on 127.0.0.1; its output."""
    return launch.torchrun("apps.nmt.train", args, timeout_s=timeout_s, nproc=nproc)


def losses(out_dir: Path) -> list[tuple[int, float]]:
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [(record["step"], record["loss"]) for record in map(json.loads, lines)]


# ---------------------------------------------------------------------------------------------
# The real loop, end to end


@pytest.mark.slow
@pytest.mark.distributed
def test_train_checkpoint_exact_resume_and_bleu(corpus: Path, tmp_path: Path) -> None:
    steps = 6
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    output = torchrun(tiny_args(corpus, straight, max_steps=steps))
    assert "dev BLEU" in output and "copy BLEU" in output and "sacrebleu" in output

    # what a run leaves behind
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == steps and summary["tokens"] > 0
    checkpoint = straight / (straight / "latest").read_text().strip()
    assert checkpoint.name == f"step-{steps:07d}"
    assert sorted(p.name for p in checkpoint.glob("shard-*")) == [
        "shard-000-of-002.pt", "shard-001-of-002.pt"
    ]
    assert (checkpoint / "train-state-rank001.pt").is_file()
    fingerprint = json.loads((checkpoint / "tokenizer.json").read_text())["fingerprint"]
    assert fingerprint == load_tokenizer(corpus).fingerprint
    saved = load_nmt_config([f"--config={checkpoint / 'config.yaml'}"])
    assert saved.vocab_size == VOCAB and saved.dropout == 0.1
    dev = json.loads((straight / "dev_bleu.json").read_text())
    assert set(dev["buckets"]) == {"high", "medium", "low"}
    assert dev["signature"]["bleu"].startswith("nrefs:1")

    # N/2 steps, stop, resume, N/2 steps: the same losses and the same weights, bit for bit
    torchrun(tiny_args(corpus, halves, max_steps=steps // 2))
    torchrun(tiny_args(corpus, halves, max_steps=steps, resume="true"))
    assert losses(halves) == losses(straight)
    assert [step for step, _ in losses(halves)] == list(range(1, steps + 1))
    resumed = gp.load_shards(resolve(halves))
    for name, value in gp.load_shards(checkpoint).items():
        assert torch.equal(resumed[name], value), name

    # beam search and BLEU with the evaluation script's function (JSON and PNG)
    report = evaluate_checkpoint(straight, split="test", beam_size=2, max_per_lang=5,
                                 out=tmp_path / "test_bleu")
    assert (tmp_path / "test_bleu.json").is_file() and (tmp_path / "test_bleu.png").is_file()
    assert set(report["languages"]) == {"de", "fr", "ru", "pt_BR"}
    for row in report["languages"].values():
        assert 0.0 <= row["bleu"] <= 100.0 and row["copy_bleu"] >= 0.0
        assert row["sentences"] <= 5


def resolve(out_dir: Path) -> Path:
    return out_dir / (out_dir / "latest").read_text().strip()


@pytest.mark.slow
@pytest.mark.distributed
def test_evaluation_during_training_runs_through_the_pipeline(corpus: Path,
                                                              tmp_path: Path) -> None:
    """2 stages x 2 replicas, evaluating at step 2 and at the end: the dev report and loss equal
    the one-process evaluation of the checkpoint, and at every evaluation each rank of the
    evaluating pipeline held its own stage's parameters and nothing more (a census of the
    process's live parameters: tests/apps/nmt_census.py); the other replica did not evaluate;
    and evaluating at step 2 left training as it was (the losses of a run that did not, with
    dropout)."""
    out_dir = tmp_path / "run"
    balance = [3, 3]
    launch.torchrun("tests.apps.nmt_census", tiny_args(
        corpus, out_dir, max_steps=4, eval_every=2, balance=",".join(map(str, balance))),
        nproc=4, timeout_s=300)

    reported = json.loads((out_dir / "dev_bleu.json").read_text())
    single = evaluate_checkpoint(out_dir, split="dev", beam_size=2, max_per_lang=6)
    assert reported["languages"] == single["languages"]  # scores and example hypotheses
    assert reported["buckets"] == single["buckets"]
    loaded = load_checkpoint(out_dir)
    assert loaded.model is not None
    plain_loss = mean_token_loss(loaded.model, loaded.config, split="dev", max_per_lang=6)
    summary = json.loads((out_dir / "summary.json").read_text())
    # float32: the pipeline's micro-batches against one process's batches (FLOAT32_REORDERED_REL)
    assert summary["dev_loss"] == pytest.approx(plain_loss, rel=FLOAT32_REORDERED_REL)

    model = build_model(loaded.config, device="meta")
    stage_parameters = [sum(p.numel() for p in model[:balance[0]].parameters()),
                        sum(p.numel() for p in model[balance[0]:].parameters())]
    for rank, own in enumerate(stage_parameters):
        census = (out_dir / f"census-rank{rank:03d}.jsonl").read_text().splitlines()
        assert [json.loads(line)["parameters"] for line in census] == [own, own], rank
    assert own < sum(stage_parameters)  # a stage is not the whole model
    assert not list(out_dir.glob("census-rank00[23].jsonl"))  # replica 1 waited

    quiet = tmp_path / "no_periodic_evaluation"
    torchrun(tiny_args(corpus, quiet, max_steps=4, balance="3,3"), nproc=4)
    assert losses(quiet) == losses(out_dir)


# ---------------------------------------------------------------------------------------------
# Plain model == GPipe == DistributedGPipe on the NMT model


def nmt_problem() -> tuple[NMTConfig, tuple[Tensor, Tensor], Tensor, int]:
    """Tiny config (dropout 0), a padded batch of 6 pairs, its target-token count."""
    config = replace(load_nmt_config(["--config=tiny"]), label_smoothing=0.1)
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, config.vocab_size, (6, 9), generator=g)
    tgt = torch.randint(4, config.vocab_size, (6, 8), generator=g)
    for row, (s, t) in enumerate([(9, 8), (5, 3), (7, 8), (2, 1), (9, 6), (4, 4)]):
        src[row, s:] = config.pad_id
        tgt[row, t:] = config.pad_id
    tgt_in = torch.cat([torch.full((6, 1), config.bos_id), tgt[:, :-1]], dim=1)
    tgt_in[tgt.eq(config.pad_id)] = config.pad_id
    return config, (src, tgt_in), tgt, int(tgt.ne(config.pad_id).sum())


def double_model(config: NMTConfig) -> torch.nn.Sequential:
    return gp.materialize(build_model(config, device="meta"), seed=11).double()


def nmt_loss_fn(config: NMTConfig) -> Any:
    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        return token_cross_entropy_sum(logits, target, pad_id=config.pad_id,
                                       label_smoothing=config.label_smoothing)

    return loss_fn


def run_distributed_nmt(rank: int, world_size: int, balance: list[int]) -> Any:
    config, inputs, targets, tokens = nmt_problem()
    pipe = gp.DistributedGPipe(double_model(config), balance, chunks=3, checkpoint="except_last",
                               loss_fn=nmt_loss_fn(config), loss_reduction="sum", seed=11)
    loss = pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None,
                     normalizer=tokens)
    return float(loss), {name: p.grad.clone() for name, p in pipe.named_parameters()}


@pytest.mark.distributed
def test_plain_gpipe_and_distributed_give_the_same_loss_and_gradients(tmp_path: Path) -> None:
    config, inputs, targets, tokens = nmt_problem()
    loss_fn = nmt_loss_fn(config)
    plain = double_model(config)
    plain_loss = loss_fn(plain(inputs), targets) / tokens
    plain_loss.backward()
    expected = {name: p.grad.clone() for name, p in plain.named_parameters()}

    model = double_model(config)
    pipe = gp.GPipe(model, [2, 4], chunks=3)
    gpipe_loss = loss_fn(pipe(inputs), targets) / tokens
    gpipe_loss.backward()
    torch.testing.assert_close(gpipe_loss, plain_loss, rtol=0, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-10, msg=name)

    seen: set[str] = set()
    for loss, grads in spawn(run_distributed_nmt, 2, tmp_path, [3, 3], timeout_s=120):
        assert loss == pytest.approx(plain_loss.item(), abs=1e-10)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-10, msg=name)
            seen.add(name)
    assert seen == set(expected)


# ---------------------------------------------------------------------------------------------
# Errors that say the fix


def fake_checkpoint(directory: Path, corpus: Path, fingerprint: str) -> Path:
    """A checkpoint as train.py writes it, of an untrained tiny model, without training."""
    config = replace(load_nmt_config(["--config=tiny"]), data_dir=str(corpus), vocab_size=VOCAB)
    model = gp.materialize(build_model(config, device="meta"), seed=0)
    gp.save_shards(model.state_dict(), directory)
    save_config(config, directory / "config.yaml")
    (directory / "tokenizer.json").write_text(json.dumps({"fingerprint": fingerprint}))
    return directory


def test_tokenizer_mismatch_is_an_error(corpus: Path, tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt", corpus, "0123456789abcdef")
    with pytest.raises(TokenizerMismatch, match="trained with tokenizer 0123456789abcdef"):
        evaluate_checkpoint(checkpoint, split="dev", max_per_lang=2)


def test_eval_of_a_matching_fake_checkpoint_runs(corpus: Path, tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt", corpus, load_tokenizer(corpus).fingerprint)
    report = evaluate_checkpoint(checkpoint, split="dev", beam_size=1, max_per_lang=2,
                                 languages=["de", "fr"])
    assert set(report["languages"]) == {"de", "fr"}
    with pytest.raises(CorpusError, match=r"no dev data for language\(s\) \['xx'\]"):
        evaluate_checkpoint(checkpoint, split="dev", languages=["xx"])


def test_missing_corpus_names_the_command(corpus: Path, tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt", corpus, "x")
    with pytest.raises(CorpusError, match="python -m data.gettext_m2en.prepare --out"):
        evaluate_checkpoint(checkpoint, data_dir=str(tmp_path / "nothing"))
    config = replace(NMTConfig(), data_dir=str(tmp_path / "nothing"), packages="none")
    with pytest.raises(CorpusError, match="python -m data.gettext_m2en.prepare --out"):
        train.prepare_corpus(config)


def test_missing_checkpoint_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="-m apps.nmt.train --out_dir="):
        evaluate_checkpoint(tmp_path / "no_run")


def test_corpus_prepared_with_other_settings_is_not_overwritten(corpus: Path) -> None:
    config = replace(NMTConfig(), data_dir=str(corpus), packages="quick")
    with pytest.raises(ConfigError, match="prepared with other settings"):
        train.prepare_corpus(config)


def test_unknown_config_key_stops_before_any_process_group() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['lerning_rate'\]"):
        train.main(["--lerning_rate=1"])


def test_learning_rate_warms_up_then_decays() -> None:
    config = replace(NMTConfig(), lr=1e-3, warmup_steps=100, lr_schedule="inverse_sqrt")
    assert train.learning_rate(config, 0) == pytest.approx(1e-5)
    assert train.learning_rate(config, 49) == pytest.approx(5e-4)
    assert train.learning_rate(config, 99) == pytest.approx(1e-3)
    assert train.learning_rate(config, 399) == pytest.approx(5e-4)  # sqrt(100 / 400)
    constant = replace(config, lr_schedule="constant")
    assert train.learning_rate(constant, 10_000) == pytest.approx(1e-3)


def run_data_parallel_nmt(rank: int, world_size: int) -> Any:
    """2 stages x 2 replicas: replica r trains on half r of the batch."""
    config, (src, tgt_in), targets, tokens = nmt_problem()
    pipeline_group, data_group = gp.init_process_groups(2)
    replica = rank // 2
    rows = slice(0, 3) if replica == 0 else slice(3, 6)
    pipe = gp.DistributedGPipe(double_model(config), [3, 3], chunks=2, loss_fn=nmt_loss_fn(config),
                               loss_reduction="sum", seed=11, group=pipeline_group,
                               data_parallel_group=data_group)
    loss = pipe.step((src[rows], tgt_in[rows]) if pipe.is_first else None,
                     targets[rows] if pipe.is_last else None,
                     normalizer=train.loss_normalizer(tokens, 2))
    torch.distributed.all_reduce(loss, group=data_group)  # as train.py: the step's loss
    return float(loss) / 2, {name: p.grad.clone() for name, p in pipe.named_parameters()}


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_replicas_give_the_whole_batch_gradient(tmp_path: Path) -> None:
    config, inputs, targets, tokens = nmt_problem()
    plain = double_model(config)
    plain_loss = nmt_loss_fn(config)(plain(inputs), targets) / tokens
    plain_loss.backward()
    expected = {name: p.grad for name, p in plain.named_parameters()}
    for loss, grads in spawn(run_data_parallel_nmt, 4, tmp_path, timeout_s=180):
        assert loss == pytest.approx(plain_loss.item(), abs=1e-10)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-10, msg=name)


def test_training_seeds_share_one_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus is prepared with ``corpus_seed``, never the training ``seed``: runs of other
    seeds reuse it (a seed-1 run must not rebuild the seed-0 corpus under a seed-0 run)."""
    import data.gettext_m2en.prepare as prepare_module
    from data.gettext_m2en.fetch import resolve_packages

    asked: list[int] = []
    monkeypatch.setattr(prepare_module, "prepare", lambda *a, seed, **k: asked.append(seed))
    config = replace(NMTConfig(), data_dir=str(tmp_path / "corpus"), seed=5)
    train.prepare_corpus(config)
    train.prepare_corpus(replace(config, corpus_seed=3))
    assert asked == [0, 3]
    # a corpus built with another corpus seed is refused, not rebuilt under a running sweep
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text(json.dumps({"format": 2, "config": {
        "packages": list(resolve_packages("quick")), "languages": sorted(config.languages),
        "vocab_size": config.vocab_size, "seed": 1}}))
    with pytest.raises(ConfigError, match=r"'seed': \(1, 0\)"):
        train.prepare_corpus(config)
