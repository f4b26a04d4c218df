"""Evaluating a run while it trains: the reader pins the checkpoint it verified, the trainer's
rotation keeps a pinned folder, and a folder rotated away before it was pinned makes the reader
take the run's newest one with a warning (``gpipe_core.storage.pin_checkpoint``,
``apps.harness.checkpoints``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gpipe_core as gp
from apps.harness import checkpoints
from apps.harness.checkpoints import publish_checkpoint, resolve_checkpoint, unpin
from gpipe_core.storage import CheckpointGoneError, pin_checkpoint, remove_checkpoint
from tests.apps import test_nmt_train as nmt_tests
from tests.apps.test_failures import finish, launch, wait_for

REPO = Path(__file__).resolve().parents[2]

# A trainer reduced to its checkpoint writes: every step a new folder (one shard whose every
# value is the step, so a reader can tell a consistent load from a mixed one), ``latest`` moved
# to it, and all but the newest removed (keep=1, the most aggressive rotation).
ROTATING_WRITER = """
import sys, torch
from pathlib import Path
from apps.harness.checkpoints import checkpoint_dir, publish_checkpoint
from gpipe_core.shards import save_shards
out, steps = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
for step in range(1, steps + 1):
    # told to stop (the reader has released its last pin): one more step, whose rotation is
    # then sure to come after that release (one that started before it keeps the pinned one)
    stopping = (out / "stop").exists()
    path = checkpoint_dir(out, step)
    save_shards({"w": torch.full((4096,), float(step)), "b": torch.full((7,), float(step))}, path)
    publish_checkpoint(out, path, keep=1)
    if stopping:
        break
print(step)
"""


def write_step(out_dir: Path, step: int) -> Path:
    path = checkpoints.checkpoint_dir(out_dir, step)
    gp.shards.save_shards({"w": torch.full((8,), float(step)), "b": torch.full((7,), float(step))},
                          path)
    return path


def test_a_pinned_checkpoint_survives_rotation_until_released(tmp_path: Path) -> None:
    first = write_step(tmp_path, 1)
    publish_checkpoint(tmp_path, first, keep=1)
    assert resolve_checkpoint(tmp_path, train_command="train") == first  # pinned
    second = write_step(tmp_path, 2)
    publish_checkpoint(tmp_path, second, keep=1)
    assert (first / "index.json").is_file()  # kept: a reader holds it
    assert gp.load_shards(first)["w"][0] == 1.0
    unpin(first)
    third = write_step(tmp_path, 3)
    publish_checkpoint(tmp_path, third, keep=1)
    assert not first.exists() and not second.exists() and third.exists()


def test_a_folder_removed_before_it_is_pinned_is_named(tmp_path: Path) -> None:
    path = write_step(tmp_path, 4)
    assert remove_checkpoint(path) and not path.exists()
    with pytest.raises(CheckpointGoneError, match="step-0000004 holds no checkpoint"):
        pin_checkpoint(path)


def test_a_reader_that_loses_the_race_takes_the_newest_checkpoint_with_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = write_step(tmp_path, 6)
    publish_checkpoint(tmp_path, old, keep=1)
    new = write_step(tmp_path, 7)

    # the rotation strikes between the reader's look at `latest` and its pin (as a trainer
    # does at any moment): the pin finds step 6 gone, the reader looks again
    real_pin = checkpoints.pin_checkpoint
    calls: list[Path] = []

    def pin_after_rotation(directory: Path) -> Path:
        if not calls:
            publish_checkpoint(tmp_path, new, keep=1)
        calls.append(Path(directory))
        return real_pin(directory)

    checkpoints.pin_checkpoint = pin_after_rotation  # type: ignore[assignment]
    try:
        chosen = resolve_checkpoint(tmp_path, train_command="train")
    finally:
        checkpoints.pin_checkpoint = real_pin  # type: ignore[assignment]
    assert chosen == new and calls == [old, new]
    err = capsys.readouterr().err
    assert f"warning: {old} holds no checkpoint" in err
    assert f"using the run's newest intact checkpoint {new} instead" in err
    unpin(chosen)


def test_reading_while_a_writer_rotates_every_step_loads_one_consistent_checkpoint(
        tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    publish_checkpoint(out_dir, write_step(out_dir, 0), keep=1)
    writer = subprocess.Popen(
        [sys.executable, "-c", ROTATING_WRITER, str(out_dir), "100000"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 25 and time.monotonic() < deadline:
            path = resolve_checkpoint(out_dir, train_command="train")  # verified and pinned
            time.sleep(0.01)  # the trainer publishes and rotates meanwhile
            state = gp.load_shards(path)
            step = int(path.name.removeprefix("step-"))
            assert set(state["w"].tolist()) == {float(step)} == set(state["b"].tolist())
            unpin(path)
            seen.add(step)
    finally:
        (out_dir / "stop").touch()
        stdout, stderr = writer.communicate(timeout=60)
    assert writer.returncode == 0, stderr
    assert len(seen) >= 25, f"the reader loaded only {sorted(seen)} in 60 s"
    last = int(stdout.split()[-1])
    assert last > max(seen)  # the writer went on rotating while the reader read
    # nothing pinned is left behind: the writer's last rotation kept only its newest folder
    assert sorted(p.name for p in out_dir.glob("step-*")) == [f"step-{last:07d}"]


@pytest.mark.slow
@pytest.mark.distributed
def test_nmt_evaluate_scores_a_run_that_checkpoints_every_step(corpus: Path,
                                                               tmp_path: Path) -> None:
    """The issue's case: ``apps.nmt.evaluate --ckpt <run>`` while the real trainer (2 ranks)
    writes a checkpoint every step and keeps one."""
    from apps.nmt.evaluate import evaluate_checkpoint

    out_dir = tmp_path / "run"
    args = nmt_tests.tiny_args(corpus, out_dir, max_steps=400, ckpt_every=1,
                               keep_checkpoints=1, log_every=1)
    log = tmp_path / "train.txt"
    trainer = launch(args, log, module="apps.nmt.train")
    scored: list[str] = []
    try:
        wait_for(lambda: (out_dir / "latest").is_file(), trainer, log, timeout_s=200)
        deadline = time.monotonic() + 200
        while trainer.poll() is None and len(scored) < 3 and time.monotonic() < deadline:
            report = evaluate_checkpoint(out_dir, split="dev", beam_size=1, max_per_lang=1,
                                         out=tmp_path / f"eval{len(scored)}")
            scored.append(str(report["checkpoint"]))
        trainer_was_running = trainer.poll() is None
    finally:
        trainer.send_signal(signal.SIGTERM)  # torchrun forwards it: a checkpoint, then exit
        output = finish(trainer, log, timeout_s=120)
    # the workers checkpoint and exit (torchrun's own agent prints a traceback for the signal)
    ended = ("interrupted (SIGTERM) at step" in output  # or it had ended its 400 steps first
             or "trained 400 steps" in output)
    assert ended and "error:" not in output, output[-3000:]
    assert len(scored) == 3 and trainer_was_running, (scored, output[-3000:])
    assert len(set(scored)) > 1  # the trainer moved on between evaluations
