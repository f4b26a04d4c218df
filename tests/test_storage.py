"""Verified checkpoints: atomic files, sizes and hashes in index.json, damaged files named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import gpipe_core as gp
from apps.config import ConfigError, load_config
from apps.harness import checkpoints


def write_run_checkpoint(out_dir: Path, step: int, keep: int = checkpoints.KEEP_CHECKPOINTS) -> Path:
    """A checkpoint folder as the apps write it (shard, train state, config), published."""
    path = checkpoints.checkpoint_dir(out_dir, step)
    torch.manual_seed(step)
    entries = gp.save_shards(nn.Linear(4, 3).state_dict(), path, index=False)
    entries["train-state-rank000.pt"] = gp.write_atomic(
        path / "train-state-rank000.pt", {"step": step, "moments": torch.randn(8)})
    entries["config.yaml"] = gp.write_atomic(path / "config.yaml", "lr: 0.1\n")
    gp.storage.write_index(path, 1, entries)
    checkpoints.publish_checkpoint(out_dir, path, keep=keep)
    return path


def flip_byte(path: Path, offset: int = -40) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_index_records_size_and_hash_of_every_file(tmp_path: Path) -> None:
    path = write_run_checkpoint(tmp_path, 3)
    index = json.loads((path / "index.json").read_text())
    assert sorted(index["files"]) == ["config.yaml", "shard-000-of-001.pt",
                                      "train-state-rank000.pt"]
    for name, entry in index["files"].items():
        assert entry["bytes"] == (path / name).stat().st_size and len(entry["sha256"]) == 64
    assert not list(path.glob(".*tmp*"))  # no temporary file left behind
    gp.verify_checkpoint(path)
    assert set(gp.load_shards(path)) == {"weight", "bias"}


def test_a_flipped_byte_in_a_shard_is_named_on_load(tmp_path: Path) -> None:
    path = write_run_checkpoint(tmp_path, 1)
    flip_byte(path / "shard-000-of-001.pt")
    with pytest.raises(gp.CheckpointCorruptError, match=r"shard-000-of-001\.pt is damaged: its "
                       r"SHA-256 differs"):
        gp.load_shards(path)
    with pytest.raises(gp.CheckpointCorruptError, match=r"shard-000-of-001\.pt"):
        checkpoints.resolve_checkpoint(tmp_path, train_command="train")


def test_a_truncated_shard_or_train_state_is_named(tmp_path: Path) -> None:
    path = write_run_checkpoint(tmp_path, 1)
    truncate(path / "train-state-rank000.pt")
    with pytest.raises(gp.CheckpointCorruptError,
                       match=r"train-state-rank000\.pt is damaged: \d+ bytes, but index.json "
                       r"recorded \d+ \(truncated\)"):
        checkpoints.load_train_state(path, 0, 1)
    truncate(path / "shard-000-of-001.pt")
    with pytest.raises(gp.CheckpointCorruptError, match=r"shard-000-of-001\.pt is damaged"):
        gp.load_shards(path)


def test_an_unverifiable_old_checkpoint_still_names_an_unreadable_file(tmp_path: Path) -> None:
    path = write_run_checkpoint(tmp_path, 1)
    (path / "index.json").write_text(json.dumps({"num_shards": 1}))  # written before hashes
    truncate(path / "shard-000-of-001.pt")
    with pytest.raises(gp.CheckpointCorruptError, match=r"shard-000-of-001\.pt is unreadable"):
        gp.load_shards(path)
    (path / "index.json").write_text('{"num_sh')
    with pytest.raises(gp.CheckpointCorruptError, match=r"index.json is damaged"):
        gp.load_shards(path)


def test_resume_falls_back_to_the_newest_intact_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run_checkpoint(tmp_path, 2)
    newest = write_run_checkpoint(tmp_path, 4)
    assert checkpoints.resume_checkpoint(tmp_path, train_command="t", verbose=True) == newest
    assert capsys.readouterr().err == ""
    flip_byte(newest / "train-state-rank000.pt")
    chosen = checkpoints.resume_checkpoint(tmp_path, train_command="t", verbose=True)
    assert chosen.name == "step-0000002"
    err = capsys.readouterr().err
    assert "step-0000004/train-state-rank000.pt is damaged" in err
    assert "resuming from the newest intact checkpoint" in err and "step-0000002" in err
    # a folder past `latest` (a crash mid-checkpoint) is never chosen, and the next publish
    # removes it with the damaged one
    (tmp_path / "step-0000009").mkdir()
    truncate(chosen / "shard-000-of-001.pt")
    with pytest.raises(gp.CheckpointCorruptError, match="no intact checkpoint in"):
        checkpoints.resume_checkpoint(tmp_path, train_command="t", verbose=False)
    write_run_checkpoint(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000002", "step-0000003"]


def test_publish_keeps_the_newest_steps_or_all_of_them(tmp_path: Path) -> None:
    names = lambda d: sorted(p.name[-2:] for p in d.glob("step-*"))  # noqa: E731
    for step in (1, 2, 3, 4):
        write_run_checkpoint(tmp_path / "default", step)
        write_run_checkpoint(tmp_path / "three", step, keep=3)
        write_run_checkpoint(tmp_path / "all", step, keep=0)
    assert names(tmp_path / "default") == ["03", "04"]
    assert names(tmp_path / "three") == ["02", "03", "04"]
    assert names(tmp_path / "all") == ["01", "02", "03", "04"]
    # keep=0 keeps every step up to `latest`, never one past it (an abandoned timeline)
    (tmp_path / "all" / "step-0000009").mkdir()
    write_run_checkpoint(tmp_path / "all", 5, keep=0)
    assert names(tmp_path / "all") == ["01", "02", "03", "04", "05"]


def test_no_checkpoint_says_how_to_train_one(tmp_path: Path) -> None:
    with pytest.raises(checkpoints.CheckpointError, match="train one with `python train.py`"):
        checkpoints.resume_checkpoint(tmp_path, train_command="python train.py", verbose=True)


def test_a_corrupt_yaml_config_is_named(tmp_path: Path) -> None:
    from apps.nmt.config import NMTConfig

    path = tmp_path / "bad.yaml"
    path.write_text("lr: [0.1\nbatch: 3\n")
    with pytest.raises(ConfigError, match=rf"config file {path} is not valid YAML"):
        load_config(NMTConfig, [f"--config={path}"])
