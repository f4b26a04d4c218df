"""A disk that fills between checkpoints: the run's writes fail with one line naming the file, the
free space, the intact checkpoint and the ``--resume`` command, and ``log.jsonl`` keeps whole
records (``apps.harness.writes``).

The failures are real: the process runs under a file size limit (``RLIMIT_FSIZE``), so a write
past it fails with EFBIG in the kernel as a full disk's fails with ENOSPC (and needs no mount or
root). A real ENOSPC on a small tmpfs, tried by hand, is in docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from apps.harness.checkpoints import checkpoint_dir, publish_checkpoint
from gpipe_core.shards import save_shards
from tests.apps.test_bad_inputs import size_limited
from tests.apps.test_failures import finish, launch
from tests.apps.test_nmt_train import tiny_args as nmt_args

REPO = Path(__file__).resolve().parents[2]

# rank 0's log, as the train loop keeps it, until the size limit stops it
LOG_FILLER = """
import sys
from pathlib import Path
from apps.harness.run_log import RunLogger
from apps.harness.writes import RunWriteError
from apps.nmt.config import NMTConfig
out_dir = Path(sys.argv[1])
logger = RunLogger(NMTConfig(wandb_mode="disabled"), out_dir, resume_step=0, enabled=True)
step = 0
try:
    for step in range(1, 100_000):
        logger.step({"step": step, "loss": 1.0 / step, "note": "x" * (step % 37)})
except RunWriteError as error:
    print(step - 1)
    print(error)
"""


def test_a_log_record_that_does_not_fit_names_the_file_and_leaves_whole_records(
        tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    step = checkpoint_dir(out_dir, 4)
    save_shards({"w": torch.zeros(4)}, step)
    publish_checkpoint(out_dir, step)
    (tmp_path / "log_filler.py").write_text(LOG_FILLER)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "log_filler", str(out_dir), "--max_steps=9"], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=120, check=True,
        preexec_fn=size_limited(5000))
    written, message = result.stdout.splitlines()
    log = out_dir / "log.jsonl"
    assert message.startswith(f"could not write {log}: [Errno 27] File too large: '{log}' (")
    assert " free on its filesystem); " in message
    assert f"the last checkpoint {step} is intact and latest names it; " in message
    assert message.endswith(
        "free space (or fix out_dir) and continue with --resume: `python -m torch.distributed.run "
        "--standalone --nproc-per-node 2 -m log_filler " f"{out_dir} --max_steps=9 --resume`")
    # the record that hit the limit was cut back off: the log ends with the last whole one
    text = log.read_text()
    assert text.endswith("\n") and len(text.encode()) <= 5000
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in records] == list(range(1, int(written) + 1))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_disk_that_fills_between_checkpoints_stops_the_run_with_one_line(
        corpus: Path, tmp_path: Path) -> None:
    """The issue's case, with real processes: a resumed NMT run whose ``log.jsonl`` stops
    fitting before its next checkpoint."""
    out_dir = tmp_path / "run"
    args = nmt_args(corpus, out_dir, log_every=1, ckpt_every=0, timeout_s=20)
    log = tmp_path / "first.txt"
    process = launch([*args, "--max_steps=2"], log, module="apps.nmt.train")
    assert (output := finish(process, log, timeout_s=150)) and process.returncode == 0, output
    intact = out_dir / "step-0000002"
    limit = (out_dir / "log.jsonl").stat().st_size + 3000  # a few more steps, far from a shard
    assert limit < min(p.stat().st_size for p in intact.glob("shard-*.pt"))
    log = tmp_path / "second.txt"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # inherited by torchrun's ranks
    try:
        process = launch([*args, "--resume", "--max_steps=400"], log, module="apps.nmt.train")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    began = time.monotonic()
    output = finish(process, log, timeout_s=150)
    elapsed = time.monotonic() - began
    assert process.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    path = out_dir / "log.jsonl"
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"error: could not write {path}: [Errno 27] File too large: "
                                f"'{path}' ("), errors[0]
    assert f"the last checkpoint {intact} is intact and latest names it" in errors[0]
    assert "continue with --resume: `python -m torch.distributed.run --standalone " \
           "--nproc-per-node 2 -m apps.nmt.train " in errors[0]
    assert errors[0].endswith(" --resume`"), errors[0]
    assert 'File "' + str(REPO / "apps") not in output, output[-3000:]  # torchrun's own summary only
    records = [json.loads(line) for line in path.read_text().splitlines()]  # none torn
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert (out_dir / "latest").read_text() == "step-0000002\n"
    print(f"\nthe run stopped {elapsed:.1f} s after launch, after step {len(records)}:\n"
          f"{errors[0]}")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_that_does_not_fit_is_one_line_from_one_rank(
        corpus: Path, tmp_path: Path) -> None:
    """Every rank writes its own shards, so a full disk at checkpoint time fails on each: the
    run says it once (rank 0 names its file; the folder is the same failure), not once per
    rank, and the line starts a line of its own (not glued to rank 0's progress bar)."""
    out_dir = tmp_path / "run"
    args = nmt_args(corpus, out_dir, log_every=1, ckpt_every=2, timeout_s=20)
    log = tmp_path / "first.txt"
    process = launch([*args, "--max_steps=2"], log, module="apps.nmt.train")
    assert (output := finish(process, log, timeout_s=150)) and process.returncode == 0, output
    intact = out_dir / "step-0000002"
    shards = sorted(intact.glob("shard-*.pt"))
    assert len(shards) >= 2, shards  # one (at least) per rank
    limit = (out_dir / "log.jsonl").stat().st_size + 3000  # the log goes on; no shard fits
    assert limit < min(p.stat().st_size for p in shards)
    log = tmp_path / "second.txt"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # inherited by torchrun's ranks
    try:
        process = launch([*args, "--resume", "--max_steps=4"], log, module="apps.nmt.train")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    output = finish(process, log, timeout_s=150)
    assert process.returncode != 0
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"error: could not write checkpoint {out_dir / 'step-0000004'}: "
                                "[Errno 27] File too large: "), errors[0]
    assert (f"the previous checkpoint {intact} is intact and latest still names it"
            in errors[0]), errors[0]
    assert errors[0].endswith(" --resume`"), errors[0]
    assert (out_dir / "latest").read_text() == "step-0000002\n"
    assert not (out_dir / "step-0000004" / "index.json").exists()
