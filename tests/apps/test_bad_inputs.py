"""Bad inputs (issue 20): each gets one line naming the value and the fix, or a warning and a
safe fallback, never a traceback per rank nor a silent wrong answer.

`latest` is a hint (a damaged one falls back to the newest intact step folder), a torn last
line of log.jsonl is dropped, every float option rejects NaN and infinity, `out_dir` is checked
before any process group and locked against a second run, a checkpoint that cannot be written
says which earlier one is intact, and the inference commands refuse or warn about inputs they
cannot honour. Multi-process rows run the real training script under torchrun on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
import typing
import zlib
from pathlib import Path
from typing import Any

import pytest

import gpipe_core as gp
from apps.amoebanet import classify
from apps.amoebanet import evaluate as amoebanet_evaluate
from apps.amoebanet.config import AmoebaNetConfig, load_amoebanet_config
from apps.config import ConfigError, save_config
from apps.harness import checkpoints, run_log
from apps.harness.out_dir import check_out_dir, lock_out_dir
from apps.nmt import evaluate as nmt_evaluate
from apps.nmt import translate
from apps.nmt.config import NMTConfig, build_model, load_nmt_config
from apps.nmt.data import load_tokenizer
from tests.apps.test_amoebanet_train import fake_checkpoint, tiny_args
from tests.apps.test_failures import finish, launch, logged_steps, long_run, wait_for
from tests.apps.test_nmt_train import tiny_args as nmt_args
from tests.test_storage import write_run_checkpoint

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# `latest` is a hint: validated, and a damaged one falls back to the newest intact step folder


def other_run(tmp_path: Path) -> Path:
    return write_run_checkpoint(tmp_path / "other-run", 9)


BAD_LATEST: dict[str, Any] = {
    "non-utf8": (b"\xff\xfe\x00step", "holds 7 bytes that are not a step folder name"),
    "garbage": (b"garbage\n", "holds 'garbage', not the name of one of this run's"),
    "empty": (b"", "is empty"),
    "absolute path to another run": (None, "not the name of one of this run's"),
    "a step folder that is gone": (b"step-0000007\n", "names step-0000007, which holds no "
                                                        "complete checkpoint"),
}


@pytest.mark.parametrize("case", list(BAD_LATEST))
def test_a_bad_latest_falls_back_to_the_newest_intact_step_folder(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    write_run_checkpoint(run, 2)
    newest = write_run_checkpoint(run, 4)
    content, why = BAD_LATEST[case]
    if content is None:  # eval used to score that run silently
        other = str(other_run(tmp_path))
        content, why = other.encode(), f"holds {other!r}, {why}"
    (run / "latest").write_bytes(content)
    # apps.nmt.evaluate / apps.amoebanet.evaluate / translate / classify
    assert checkpoints.resolve_checkpoint(run, train_command="t") == newest
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {run / 'latest'} {why}") and err.count("\n") == 1, err
    assert err.strip().endswith(f"; using the newest intact checkpoint {newest} instead")
    # --resume, on every rank
    assert checkpoints.resume_checkpoint(run, train_command="t", verbose=True) == newest
    assert f"resuming from the newest intact checkpoint {newest}" in capsys.readouterr().err
    assert checkpoints.resume_checkpoint(run, train_command="t", verbose=False) == newest
    assert capsys.readouterr().err == ""  # only rank 0 says it


def test_amoebanet_evaluate_scores_the_newest_step_folder_past_a_non_utf8_latest(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = fake_checkpoint(tmp_path / "run" / "step-0000003", shards)
    (tmp_path / "run" / "latest").write_bytes(b"\xff\xfe")  # raw UnicodeDecodeError before
    assert amoebanet_evaluate.main(["--ckpt", str(tmp_path / "run"), "--split", "test",
                                    "--eval_batch_size=5"]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {tmp_path / 'run' / 'latest'} holds 2 bytes that are not a step folder "
            f"name (not text); using the newest intact checkpoint {checkpoint} instead") in err


def test_a_bad_latest_skips_a_damaged_step_folder_too(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    older = write_run_checkpoint(tmp_path, 2)
    newest = write_run_checkpoint(tmp_path, 4)
    (newest / "config.yaml").write_text("lr: 0.2\n")  # altered after the index was written
    (tmp_path / "latest").write_text("garbage")
    assert checkpoints.resolve_checkpoint(tmp_path, train_command="t") == older
    err = capsys.readouterr().err
    assert "holds 'garbage'" in err and f"{newest / 'config.yaml'} is damaged" in err


def test_a_bad_latest_without_checkpoints_says_how_to_train_and_a_new_run_may_start(
    tmp_path: Path,
) -> None:
    (tmp_path / "latest").write_text("garbage\n")
    with pytest.raises(checkpoints.CheckpointError,
                       match=rf"^no checkpoint in {tmp_path} \({tmp_path / 'latest'} holds "
                       r"'garbage', .*\); train one with `python train.py`$"):
        checkpoints.resume_checkpoint(tmp_path, train_command="python train.py", verbose=True)
    checkpoints.refuse_existing_run(tmp_path)  # following that advice is not refused
    write_run_checkpoint(tmp_path, 2)
    with pytest.raises(ConfigError, match="already holds a run"):
        checkpoints.refuse_existing_run(tmp_path)


def test_a_valid_latest_is_used_and_a_damaged_one_is_refused_by_evaluation(
    tmp_path: Path,
) -> None:
    older = write_run_checkpoint(tmp_path, 2)
    newest = write_run_checkpoint(tmp_path, 4)
    assert checkpoints.read_latest(tmp_path) == ("step-0000004", None)
    (tmp_path / "latest").write_text("step-0000002\n")  # a folder past latest is ignored
    assert checkpoints.resolve_checkpoint(tmp_path, train_command="t") == older
    (tmp_path / "latest").write_text("step-0000004\n")
    (newest / "config.yaml").write_text("lr: 0.2\n")
    with pytest.raises(gp.CheckpointCorruptError, match="config.yaml is damaged"):
        checkpoints.resolve_checkpoint(tmp_path, train_command="t")  # evaluation scores what it's told


# ---------------------------------------------------------------------------------------------
# log.jsonl with a torn last line


def test_resume_drops_a_torn_last_log_record_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "log.jsonl"
    records = [json.dumps({"step": step, "loss": 1.0 / step}) for step in (1, 2, 3)]
    log.write_text("\n".join(records) + '\n{"step": 4, "lo')  # what a crash or full disk leaves
    config = NMTConfig(wandb_mode="disabled")
    logger = run_log.RunLogger(config, tmp_path, resume_step=3, enabled=True)
    logger.step({"step": 4, "loss": 0.25})
    logger.close()
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]
    err = capsys.readouterr().err
    assert err == (f"warning: dropped line(s) 4 of {log}: not JSON records (cut off by a crash "
                   "or a full disk?)\n")


# ---------------------------------------------------------------------------------------------
# Float options: NaN and infinity rejected, by field type, in both apps


def float_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] is float
            or float in typing.get_args(hints[f.name])]


LOADERS = {"nmt": (NMTConfig, load_nmt_config), "amoebanet": (AmoebaNetConfig,
                                                               load_amoebanet_config)}


@pytest.mark.parametrize("app", list(LOADERS))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_every_float_option_rejects_nan_and_infinity(app: str, value: str) -> None:
    cls, load = LOADERS[app]
    names = float_fields(cls)
    assert "lr" in names and "timeout_s" in names  # the loop below covers the keys
    for name in names:
        with pytest.raises(ConfigError, match=rf"^{name}=-?(nan|inf) is not a finite number"):
            load([f"--{name}={value}"])


def test_a_nan_in_a_yaml_config_is_rejected_too(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("clip_norm: .nan\n")  # YAML's NaN: clipping used to be silently off
    with pytest.raises(ConfigError, match=r"^clip_norm=nan is not a finite number"):
        load_nmt_config([f"--config={path}"])


@pytest.mark.parametrize(("app", "override", "message"), [
    ("nmt", "--lr=-1", "lr=-1.0 must be positive"),
    ("nmt", "--clip_norm=-1", "clip_norm=-1.0 must be >= 0"),
    ("nmt", "--length_penalty=-0.5", "length_penalty=-0.5 must be >= 0"),
    ("nmt", "--adam_beta2=1", "adam_beta2=1.0 must be in [0, 1)"),
    ("amoebanet", "--lr=-1", "lr=-1.0 must be positive"),
    ("amoebanet", "--momentum=-0.1", "momentum=-0.1 must be in [0, 1)"),
    ("amoebanet", "--crop_pct=0", "crop_pct=0.0 must be in (0, 1]"),
    ("amoebanet", "--std=0", "std=(0.0,) must be positive"),
])
def test_negative_values_that_make_no_sense_are_rejected(app: str, override: str,
                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        LOADERS[app][1]([override])


def test_the_inference_scripts_reject_a_nan_length_penalty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert translate.main(["--ckpt", str(tmp_path), "--lang", "de",
                           "--length-penalty", "nan"]) == 2
    assert capsys.readouterr().err == ("error: --length-penalty=nan must be a finite number >= 0 "
                                       "(0 = no penalty)\n")
    assert nmt_evaluate.main(["--ckpt", str(tmp_path), "--alpha", "inf"]) == 2
    assert capsys.readouterr().err == ("error: --alpha=inf must be a finite number >= 0 (0 = no "
                                       "length penalty)\n")


# ---------------------------------------------------------------------------------------------
# --balance in YAML's list syntax


@pytest.mark.parametrize("form", ["{},{}", "[{},{}]", "[{}, {}]", "({},{})"])
def test_balance_accepts_the_list_syntax(form: str) -> None:
    # AmoebaNet's default: stem + 10 cells + classifier = 12 layers (balance is checked
    # against the model now: (5, 4) was accepted before, and failed on every rank)
    assert load_amoebanet_config([f"--balance={form.format(7, 5)}"]).balance == (7, 5)
    # NMT: 2 * 3 + 2 = 8 layers
    assert load_nmt_config(["--num_layers=3", f"--balance={form.format(5, 3)}"]).balance == [5, 3]


def test_a_bad_balance_item_says_the_form() -> None:
    with pytest.raises(ConfigError, match=r"^balance='x' is not a valid int \(in balance='\[5,x\]'"
                       r"\); give a list as 2,2 or \[2, 2\]$"):
        load_amoebanet_config(["--balance=[5,x]"])


# ---------------------------------------------------------------------------------------------
# out_dir: a file, unwritable, or in use by another run


def test_an_out_dir_that_is_a_file_or_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ConfigError, match=rf"^out_dir={file} is a file, not a folder; pass "
                       r"another --out_dir"):
        check_out_dir(file)
    with pytest.raises(ConfigError, match=rf"^out_dir={file / 'run'} cannot be written \(Not a "
                       rf"directory at {file / 'run'}\); pass another --out_dir"):
        check_out_dir(file / "run")
    if os.geteuid() == 0:  # root writes through permission bits: a read-only filesystem then
        unwritable = Path("/sys/gpipe-test-run")
    else:
        (tmp_path / "locked").mkdir(mode=0o500)
        unwritable = tmp_path / "locked" / "run"
    with pytest.raises(ConfigError, match=rf"^out_dir={unwritable} cannot be written \(.*\); "
                       "pass another --out_dir, or make it writable for this user$"):
        check_out_dir(unwritable)
    check_out_dir(tmp_path / "new" / "run")  # created
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())


def test_a_second_process_cannot_lock_an_out_dir_in_use(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from apps.harness.out_dir "
         "import lock_out_dir; lock_out_dir(Path(sys.argv[1])); print('locked', flush=True); "
         "time.sleep(60)", str(tmp_path)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        with pytest.raises(ConfigError, match=rf"^out_dir={tmp_path} is in use by another run "
                           rf"\(pid {holder.pid} on host {socket.gethostname()}, since .*; see "
                           rf"{tmp_path / '.lock'}\); wait for it to end"):
            lock_out_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_out_dir(tmp_path)  # the lock died with its process: no stale lock


@pytest.mark.slow
@pytest.mark.distributed
def test_an_out_dir_that_is_a_file_stops_every_rank_with_one_line(
    shards: Path, tmp_path: Path
) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    log = tmp_path / "out.txt"
    process = launch(tiny_args(shards, file, lr="nan"), log)
    output = finish(process, log)
    assert process.returncode != 0
    assert output.count("error: lr=nan is not a finite number") == 1, output
    process = launch(tiny_args(shards, file), log)
    output = finish(process, log)
    assert process.returncode != 0
    assert output.count(f"error: out_dir={file} is a file, not a folder") == 1, output
    # torchrun's own ChildFailedError traceback follows; none from the script itself
    assert "apps/amoebanet/train.py" not in output and "FileExistsError" not in output
    assert "hangs" not in output, output


@pytest.mark.slow
@pytest.mark.distributed
def test_a_second_run_on_the_same_out_dir_is_refused_naming_the_first(
    shards: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "run"
    first = launch(long_run(shards, out_dir), tmp_path / "first.txt")
    try:
        wait_for(lambda: logged_steps(out_dir) >= 1, first, tmp_path / "first.txt", timeout_s=90)
        log = tmp_path / "second.txt"
        second = launch(long_run(shards, out_dir), log)
        output = finish(second, log)
        assert second.returncode != 0
        holder = (out_dir / ".lock").read_text().strip()
        assert holder.startswith("pid ") and f"on host {socket.gethostname()}" in holder
        assert output.count(f"error: out_dir={out_dir} is in use by another run ({holder}; "
                            f"see {out_dir / '.lock'})") == 1, output
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()


# ---------------------------------------------------------------------------------------------
# A full disk (or a size limit) during a checkpoint


def size_limited(limit_bytes: int) -> Any:
    """A ``preexec_fn`` that caps the size of any file the process writes (RLIMIT_FSIZE): a
    write past it fails with EFBIG as a full disk's fails with ENOSPC (Python ignores SIGXFSZ)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def test_a_write_that_fails_leaves_the_previous_file_and_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "shard.pt"
    gp.write_atomic(path, b"old")
    script = ("import sys, torch; import gpipe_core as gp\n"
              "for content in (b'x' * 100_000, {'w': torch.zeros(100_000)}):\n"
              "    try:\n        gp.write_atomic(sys.argv[1], content)\n"
              "    except OSError as error:\n        print(error)\n")
    result = subprocess.run([sys.executable, "-c", script, str(path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=60, preexec_fn=size_limited(50_000), check=True)
    # torch.save's own RuntimeError ("unexpected pos ...") is replaced by the OSError it hid
    assert result.stdout == f"[Errno 27] File too large: '{path}'\n" * 2, result.stderr
    assert path.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [path]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_that_cannot_be_written_says_which_one_is_intact(
    shards: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "run"
    args = tiny_args(shards, out_dir, mixup=0.0, num_workers=0, ckpt_every=2, timeout_s=20)
    log = tmp_path / "first.txt"
    process = launch([*args, "--stop_at_step=2"], log)
    assert (output := finish(process, log)) and process.returncode == 0, output[-3000:]
    previous = out_dir / "step-0000002"
    limit = min(p.stat().st_size for p in previous.glob("train-state-*.pt")) // 2
    log = tmp_path / "second.txt"
    # the checkpoint of step 4 hits the size limit (the log and the small files fit)
    resource_limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource_limits[1]))
    try:
        process = launch([*args, "--resume", "--stop_at_step=4"], log)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, resource_limits)
    began = time.monotonic()
    output = finish(process, log, timeout_s=120)
    assert process.returncode != 0
    assert time.monotonic() - began < 90
    line = next(line for line in output.splitlines()
                if line.startswith("error: could not write checkpoint"))
    step4 = out_dir / "step-0000004"
    assert f"could not write checkpoint {step4}: [Errno 27] File too large: '{step4}/" in line
    assert " free on its filesystem); " in line  # the free space, beside the error
    assert (f"; the previous checkpoint {previous} is intact and latest still names it; free "
            "space (or fix out_dir) and continue with --resume: `python -m torch.distributed.run "
            "--standalone --nproc-per-node 2 -m apps.amoebanet.train ") in line, line
    assert line.endswith(" --stop_at_step=4 --resume`"), line
    assert (out_dir / "latest").read_text() == "step-0000002\n"
    gp.verify_checkpoint(previous)
    assert "apps/harness/checkpoints.py" not in output and "hangs" not in output, output[-3000:]


# ---------------------------------------------------------------------------------------------
# Resume through a torn log and a damaged `latest`, with real processes


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_survives_a_garbage_latest_and_a_torn_log(shards: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = tiny_args(shards, out_dir, mixup=0.0, num_workers=0, ckpt_every=2)
    log = tmp_path / "first.txt"
    process = launch([*args, "--stop_at_step=4"], log)
    assert (output := finish(process, log)) and process.returncode == 0, output[-3000:]
    (out_dir / "latest").write_bytes(b"\xff\xfegarbage")
    text = (out_dir / "log.jsonl").read_text()
    (out_dir / "log.jsonl").write_text(text[: len(text) - 9])  # the last record cut off
    log = tmp_path / "second.txt"
    process = launch([*args, "--resume", "--stop_at_step=5"], log)
    output = finish(process, log, timeout_s=120)
    assert process.returncode == 0, output[-3000:]
    assert (f"warning: {out_dir / 'latest'} holds 9 bytes that are not a step folder name (not "
            f"text); resuming from the newest intact checkpoint {out_dir / 'step-0000004'}"
            in output), output[-3000:]
    assert f"warning: dropped line(s) 4 of {out_dir / 'log.jsonl'}" in output
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 5]  # step 4's record was lost, said so
    assert (out_dir / "latest").read_text() == "step-0000005\n"


# ---------------------------------------------------------------------------------------------
# The inference commands: a decompression bomb, an untrained language


def png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose header says ``width`` x ``height`` (what PIL checks before decoding)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (len(data).to_bytes(4, "big") + kind + data
                + zlib.crc32(kind + data).to_bytes(4, "big"))
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def test_classify_refuses_a_huge_image_in_one_line_and_allows_it_on_request(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt", shards)
    bomb = tmp_path / "bomb.png"
    png_header_only(bomb, 20000, 20000)
    assert classify.main([str(bomb), "--ckpt", str(checkpoint)]) == 2
    assert capsys.readouterr().err == (
        f"error: cannot classify {bomb}: 20000x20000 = 400,000,000 pixels is more than "
        "--max-image-pixels=178,956,970 (a guard against decompression bombs); if you trust "
        "the file, pass a larger --max-image-pixels, or 0 for no limit\n")
    # the documented way to allow big images, shown on a small one under a small limit
    from PIL import Image
    image = tmp_path / "image.png"
    Image.new("L", (40, 40), 128).save(image)
    assert classify.main([str(image), "--ckpt", str(checkpoint),
                          "--max-image-pixels=1000"]) == 2
    assert "40x40 = 1,600 pixels is more than --max-image-pixels=1,000" in capsys.readouterr().err
    assert classify.main([str(image), "--ckpt", str(checkpoint), "--max-image-pixels=0"]) == 0
    assert capsys.readouterr().out.startswith(f"{image}\n")
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # PIL's global left as it was


def fake_nmt_checkpoint(directory: Path, corpus: Path, languages: str) -> Path:
    """An untrained NMT checkpoint as train.py writes it, on ``corpus``'s tokenizer."""
    tokenizer = load_tokenizer(corpus)
    args = nmt_args(corpus, directory, languages=languages, vocab_size=tokenizer.vocab_size)
    config = load_nmt_config([a for a in args if not a.startswith("--out_dir")])
    model = gp.materialize(build_model(config, device="meta"), seed=0)
    gp.save_shards(model.state_dict(), directory)
    save_config(config, directory / "config.yaml")
    (directory / "tokenizer.json").write_text(json.dumps({"fingerprint": tokenizer.fingerprint}))
    return directory


def test_translate_warns_about_a_language_the_model_never_trained_on(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = load_tokenizer(corpus)
    trained, untrained = tokenizer.languages[0], tokenizer.languages[1]
    checkpoint = fake_nmt_checkpoint(tmp_path / "ckpt", corpus, trained)
    source = tmp_path / "in.txt"
    source.write_text("hallo welt\n")
    args = ["--ckpt", str(checkpoint), "--input", str(source), "--beam-size", "1",
            "--max-len", "4"]
    assert translate.main([*args, "--lang", untrained]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"warning: --lang={untrained} is in the tokenizer but this model was "
                            f"not trained on it (trained: {trained}); expect poor translations\n")
    assert captured.out.count("\n") == 1  # still one line out per line in
    assert translate.main([*args, "--lang", trained]) == 0
    assert capsys.readouterr().err == ""
