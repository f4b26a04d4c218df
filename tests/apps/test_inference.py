"""The inference commands end to end: ``apps.nmt.translate`` and ``apps.amoebanet.classify`` as
subprocesses on checkpoints the real training loops wrote (tiny configs, 2 ranks), and their
errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from apps.amoebanet.checkpoint_loading import load_model as load_amoebanet
from apps.harness.checkpoints import resolve_checkpoint
from apps.nmt.checkpoint_loading import load_checkpoint
from apps.nmt.decoding import load_eval_sentences, translate
from data.gettext_m2en.prepare import prepare
from tests.apps import test_amoebanet_train as amoebanet_tests
from tests.apps import test_nmt_train as nmt_tests
from tests.apps.test_amoebanet_train import CLASSES
from tests.apps.test_nmt_data import build_locale_tree
from tests.conftest import FLOAT32_REORDERED_REL
from tests.distributed import launch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def command(module: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m module args`` from the repository, as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def nmt_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny NMT checkpoint written by the real training loop (2 pipeline ranks)."""
    out_dir = tmp_path_factory.mktemp("nmt") / "run"
    nmt_tests.torchrun(nmt_tests.tiny_args(corpus, out_dir, max_steps=4, dropout=0.0))
    return out_dir


@pytest.fixture(scope="module")
def amoebanet_run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny AmoebaNet checkpoint written by the real training loop (2 pipeline ranks)."""
    out_dir = tmp_path_factory.mktemp("amoebanet") / "run"
    amoebanet_tests.torchrun(amoebanet_tests.tiny_args(shards, out_dir, epochs=1))
    return out_dir


# ---------------------------------------------------------------------------------------------
# apps.nmt.translate


def test_translate_gives_one_line_per_line_as_evaluation_does(nmt_run: Path,
                                                             corpus: Path) -> None:
    loaded = load_checkpoint(nmt_run)
    assert loaded.model is not None
    sentences, _ = load_eval_sentences(corpus, "test", ["de"], max_per_lang=4,
                                       pad_id=loaded.tokenizer.pad_id)
    sources = [sentence.source for sentence in sentences]
    # the corpus's own ids are the tokenizer's ids of the raw text
    assert [loaded.tokenizer.encode_source(s, "de") for s in sources] == [
        s.src_ids for s in sentences]
    expected = translate(loaded.model, sentences, loaded.tokenizer, beam_size=2, alpha=0.6,
                         max_decode_len=loaded.config.max_decode_len,
                         device=torch.device("cpu"))
    lines = [sources[0], "", sources[1], "   ", *sources[2:]]
    result = command("apps.nmt.translate", "--ckpt", str(nmt_run), "--lang", "de",
                     "--beam-size", "2", "--length-penalty", "0.6", "--batch-lines", "3",
                     stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)  # one line per line, in order
    assert out[:-1] == [expected[0], "", expected[1], "", *expected[2:]]

    # --input reads a file; the config's defaults (beam_size 2 in the tiny run) apply
    source_file = nmt_run / "sources.de"
    source_file.write_text("\n".join(sources) + "\n")
    by_file = command("apps.nmt.translate", "--ckpt", str(nmt_run), "--lang", "de",
                      "--input", str(source_file))
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout.splitlines() == expected


def test_translate_truncates_a_line_longer_than_the_positions(nmt_run: Path) -> None:
    max_positions = load_checkpoint(nmt_run, model=False).config.max_positions
    long_line = " ".join(["number"] * (2 * max_positions))
    result = command("apps.nmt.translate", "--ckpt", str(nmt_run), "--lang", "fr",
                     "--max-len", "6", stdin=f"short\n{long_line}\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    assert "warning: line 2 has" in result.stderr
    assert f"max_positions={max_positions}; translating its first {max_positions}" in (
        result.stderr)
    assert "line 1" not in result.stderr


def test_translate_errors_say_the_fix(nmt_run: Path, amoebanet_run: Path,
                                      tmp_path: Path) -> None:
    def error(*args: str) -> str:
        result = command("apps.nmt.translate", *args, stdin="hallo\n")
        assert result.returncode == 2 and result.stdout == "", result
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
        return result.stderr

    missing = tmp_path / "no_run"
    assert "-m apps.nmt.train --out_dir=" in error("--ckpt", str(missing), "--lang", "de")
    other = resolve_checkpoint(amoebanet_run, train_command="")
    assert (f"{other} is an AmoebaNet checkpoint, not an NMT one: use `python "
            f"-m apps.amoebanet.evaluate") in error("--ckpt", str(amoebanet_run), "--lang", "de")
    assert "use one of: de fr pt_BR ru" in error("--ckpt", str(nmt_run), "--lang", "xx")
    assert "cannot read --input" in error("--ckpt", str(nmt_run), "--lang", "de",
                                          "--input", str(tmp_path / "absent.txt"))
    assert "--beam-size=0 must be >= 1" in error("--ckpt", str(nmt_run), "--lang", "de",
                                                 "--beam-size", "0")

    # a corpus whose tokenizer is not the checkpoint's (another vocabulary size)
    root = tmp_path / "catalogs"
    build_locale_tree(root)
    other_corpus = tmp_path / "other_corpus"
    prepare(other_corpus, packages=None, locale_roots=[root], vocab_size=nmt_tests.VOCAB + 40,
            dev_fraction=0.1, test_fraction=0.1, block_size=64, verbose=False)
    message = error("--ckpt", str(nmt_run), "--lang", "de", "--data-dir", str(other_corpus))
    assert "was trained with tokenizer" in message and "use the corpus it was trained on" in (
        message)


# ---------------------------------------------------------------------------------------------
# apps.amoebanet.classify


def write_image(path: Path, label: int, *, size: int = 16, mode: str = "L") -> Path:
    """An image of class ``label`` as the test's dataset draws them."""
    pixels = np.random.default_rng(label).integers(0, 60, (size, size)).astype(np.uint8)
    if label == 0:
        pixels[::4] += 150
    elif label == 1:
        pixels[:, ::4] += 150
    else:
        pixels[size // 3 : 2 * size // 3, size // 3 : 2 * size // 3] += 150
    Image.fromarray(pixels).convert(mode).save(path)
    return path


def test_classify_prints_the_top_classes_as_the_model_scores_them(amoebanet_run: Path,
                                                                  tmp_path: Path) -> None:
    images = [write_image(tmp_path / f"img{label}.png", label) for label in range(3)]
    colour = write_image(tmp_path / "colour.jpg", 2, mode="RGB")  # converted to 1 channel
    result = command("apps.amoebanet.classify", "--ckpt", str(amoebanet_run),
                     *map(str, [*images, colour]))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4 * (1 + len(CLASSES))  # 3 classes: top-5 shows all 3
    checkpoint = resolve_checkpoint(amoebanet_run, train_command="")
    from apps.amoebanet.checkpoint_loading import load_checkpoint_config
    from apps.amoebanet.classify import load_images

    config = load_checkpoint_config(checkpoint)
    model = load_amoebanet(config, checkpoint, torch.device("cpu"))
    batch, _ = load_images([str(p) for p in [*images, colour]], config)
    with torch.no_grad():
        probabilities = model(batch).softmax(dim=-1)
    for index, path in enumerate([*images, colour]):
        block = lines[4 * index : 4 * index + 4]
        assert block[0] == str(path)
        ranked = [line.split() for line in block[1:]]
        values = [float(p) for p, _ in ranked]
        assert values == sorted(values, reverse=True)
        assert {name for _, name in ranked} == set(CLASSES)
        for value, name in ranked:
            assert abs(float(value) - float(probabilities[index, CLASSES.index(name)])) < 1e-4
    top2 = command("apps.amoebanet.classify", "--ckpt", str(amoebanet_run), "--top", "2",
                   str(images[0]))
    assert len(top2.stdout.splitlines()) == 3


def test_classify_refuses_bad_images_naming_each(amoebanet_run: Path, tmp_path: Path) -> None:
    good = write_image(tmp_path / "good.png", 0)
    tiny = write_image(tmp_path / "tiny.png", 0, size=4)
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    result = command("apps.amoebanet.classify", "--ckpt", str(amoebanet_run), str(good),
                     str(tiny), str(text), str(tmp_path / "absent.png"))
    assert result.returncode == 2 and result.stdout == ""
    err = result.stderr
    assert err.startswith("error: cannot classify ")
    assert f"{tiny}: 4x4 is too small for this AmoebaNet" in err and "at least 9 pixels" in err
    assert f"{text}: not an image PIL can read" in err
    assert f"{tmp_path / 'absent.png'}: no such file" in err
    assert str(good) + ":" not in err

    small = write_image(tmp_path / "small.png", 1, size=12)  # 9 <= 12 < 16: upscaled, warned
    result = command("apps.amoebanet.classify", "--ckpt", str(amoebanet_run), str(small))
    assert result.returncode == 0 and "12x12 is smaller than the model's 16x16" in result.stderr

    run = command("apps.amoebanet.classify", "--ckpt", str(tmp_path / "none"), str(good))
    assert run.returncode == 2 and "-m apps.amoebanet.train --out_dir=" in run.stderr


def test_classify_names_the_other_apps_checkpoint(nmt_run: Path, tmp_path: Path) -> None:
    image = write_image(tmp_path / "x.png", 0)
    result = command("apps.amoebanet.classify", "--ckpt", str(nmt_run), str(image))
    assert result.returncode == 2
    assert "is an NMT checkpoint, not an AmoebaNet one" in result.stderr


# ---------------------------------------------------------------------------------------------
# apps.amoebanet.evaluate through the pipeline under torchrun


@pytest.mark.parametrize("stages", [2, 1])  # 1 pipeline of 2 stages; 2 replicas of 1 stage
def test_pipelined_top1_equals_the_single_process_numbers(amoebanet_run: Path, tmp_path: Path,
                                                          stages: int) -> None:
    from apps.amoebanet import evaluate

    single = evaluate.evaluate_checkpoint(amoebanet_run, out=tmp_path / "single",
                                          overrides=["--eval_batch_size=5"])
    output = launch.torchrun("apps.amoebanet.evaluate", [
        "--ckpt", str(amoebanet_run), "--out", str(tmp_path / "piped"), "--stages", str(stages),
        "--eval_batch_size=5"])
    assert output.count("test top-1") == 1  # rank 0 reports
    piped = json.loads((tmp_path / "piped.json").read_text())
    assert piped["stages"] == stages and piped["replicas"] == 2 // stages
    if stages == 2:
        saved = json.loads((resolve_checkpoint(amoebanet_run, train_command="") /
                            "run.json").read_text())
        assert piped["balance"] == saved["balance"]  # each rank read only its own shard
    for key in ("images", "top1", "top5", "confusion", "per_class_top1"):
        assert piped[key] == single[key], key
    # float32 logits of other batch shapes (micro-batches, or replicas taking every other
    # batch) summed in another order: 1e-9 failed once at 1.46e-9 (2 replicas x 1 stage)
    assert piped["loss"] == pytest.approx(single["loss"], rel=FLOAT32_REORDERED_REL)


# ---------------------------------------------------------------------------------------------
# NMT decoding through DistributedGPipe


def pipelined_hypotheses(rank: int, world_size: int, checkpoint: str, src_ids: torch.Tensor,
                         balance: list[int]) -> dict[int, list[list[int]]]:
    """Greedy and beam-2 hypotheses of ``src_ids`` through a pipeline of ``balance``."""
    from apps.nmt.config import build_model
    from apps.nmt.pipelined_search import pipelined_beam_search
    from gpipe_core import DistributedGPipe

    config = load_checkpoint(checkpoint, model=False).config
    pipe = DistributedGPipe(build_model(config, device="meta"), balance, chunks=1,
                            loss_fn=lambda out, target: out.sum())
    pipe.load_checkpoint(checkpoint)
    return {(beam, groups): pipelined_beam_search(
                pipe, src_ids, vocab_size=config.vocab_size, pad_id=config.pad_id,
                bos_id=config.bos_id, eos_id=config.eos_id, beam_size=beam, alpha=0.6,
                max_len=12, groups=groups)
            for beam in (1, 2) for groups in (1, None)}


def test_pipelined_decoding_gives_the_single_process_hypotheses(
    nmt_run: Path, corpus: Path, tmp_path: Path
) -> None:
    from apps.nmt.decoding import pad_batch
    from apps.nmt.search import beam_search

    loaded = load_checkpoint(nmt_run)
    assert loaded.model is not None
    config = loaded.config
    sentences, _ = load_eval_sentences(corpus, "test", ["de", "ru"], max_per_lang=3,
                                       pad_id=config.pad_id)
    src_ids = pad_batch([s.src_ids for s in sentences], config.pad_id, torch.device("cpu"))
    # groups=1: the whole batch at once; None: 2 groups (one per stage), as one process
    # decodes them with groups=2 (tests/apps/test_pipelined_search.py has the rest)
    expected = {(beam, groups): beam_search(loaded.model, src_ids, bos_id=config.bos_id,
                                            eos_id=config.eos_id, beam_size=beam, alpha=0.6,
                                            max_len=12, groups=groups or 2)
                for beam in (1, 2) for groups in (1, None)}
    assert any(len(ids) > 1 for ids in expected[(1, 1)])
    checkpoint = resolve_checkpoint(nmt_run, train_command="")
    layers = 2 * config.num_layers + 2
    # embed alone on stage 0; encoders | decoders; the first decoder on stage 0; project alone
    for balance in ([1, layers - 1], [layers // 2, layers // 2], [layers - 2, 2],
                    [layers - 1, 1]):
        ranks = launch.spawn(pipelined_hypotheses, 2, tmp_path / "x".join(map(str, balance)),
                             str(checkpoint), src_ids, balance)
        for per_rank in ranks:
            assert per_rank == expected, balance


def test_held_out_sources_longer_than_the_model_reads_are_cut_with_a_warning(
    corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # evaluation loads them with max_src_len=max_positions: a longer source would stop the
    # beam search (the model's position table ends there)
    full, _ = load_eval_sentences(corpus, "test", ["de", "fr"], max_per_lang=3, pad_id=0,
                                  max_src_len=1000)
    assert capsys.readouterr().err == "" and all(len(s.src_ids) > 3 for s in full)
    cut, _ = load_eval_sentences(corpus, "test", ["de", "fr"], max_per_lang=3, pad_id=0,
                                 max_src_len=3)
    assert [s.src_ids for s in cut] == [s.src_ids[:3] for s in full]
    assert [s.source for s in cut] == [s.source for s in full]  # the text is scored whole
    longest = max(len(s.src_ids) for s in full)
    assert (f"warning: {len(full)} of {len(full)} test sources have more than max_positions=3 "
            f"tokens (the longest {longest}); they are cut to their first 3"
            ) in capsys.readouterr().err


def test_translate_under_torchrun_gives_the_single_process_output(
    nmt_run: Path, corpus: Path, tmp_path: Path
) -> None:
    sentences, _ = load_eval_sentences(corpus, "test", ["fr"], max_per_lang=4, pad_id=0)
    lines = [s.source for s in sentences]
    source_file = tmp_path / "sources.fr"
    source_file.write_text("\n".join([lines[0], "", *lines[1:]]) + "\n")
    for beam in ("1", "2"):
        args = ["--ckpt", str(nmt_run), "--lang", "fr", "--input", str(source_file),
                "--beam-size", beam, "--batch-lines", "2"]
        single = command("apps.nmt.translate", *args)
        assert single.returncode == 0, single.stderr
        piped = command(*launch.torchrun_command("apps.nmt.translate", args)[2:])
        assert piped.returncode == 0, piped.stderr
        assert piped.stdout == single.stdout and len(piped.stdout.splitlines()) == 5
    wrong = command(*launch.torchrun_command("apps.nmt.translate", [
        "--ckpt", str(nmt_run), "--lang", "xx", "--input", str(source_file)])[2:])
    assert wrong.returncode != 0 and wrong.stderr.count("error: --lang=xx") == 1


def test_nmt_evaluate_under_torchrun_gives_the_single_process_report(nmt_run: Path,
                                                                   tmp_path: Path) -> None:
    from apps.nmt.evaluate import evaluate_checkpoint

    single = evaluate_checkpoint(nmt_run, split="test", beam_size=2, max_per_lang=3,
                                 out=tmp_path / "single")
    launch.torchrun("apps.nmt.evaluate", ["--ckpt", str(nmt_run), "--split", "test", "--beam",
                                          "2", "--max-per-lang", "3", "--out",
                                          str(tmp_path / "piped")])
    piped = json.loads((tmp_path / "piped.json").read_text())
    assert piped["languages"] == single["languages"]  # scores and example hypotheses
    assert piped["buckets"] == single["buckets"] and piped["sentences"] == single["sentences"]


# ---------------------------------------------------------------------------------------------
# The eval commands' own report files: a write that fails is one line naming the file


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_nmt_evaluate_names_a_report_file_it_cannot_write(
    nmt_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from apps.nmt import evaluate

    for blocked in (".json", ".png"):  # a folder where the file should be
        out = tmp_path / blocked[1:] / "report"
        out.with_suffix(blocked).mkdir(parents=True)
        assert evaluate.main(["--ckpt", str(nmt_run), "--split", "test", "--beam", "1",
                              "--max-per-lang", "2", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert len(error_lines(err)) == 1 and "Traceback" not in err, err
        line = error_lines(err)[0]
        assert line.startswith(f"error: could not write {out.with_suffix(blocked)}: "), line
        assert "free on its filesystem" in line and "another --out path" in line, line


def test_amoebanet_evaluate_names_a_report_file_it_cannot_write(
    amoebanet_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from apps.amoebanet import evaluate

    out = tmp_path / "eval"
    out.with_suffix(".png").mkdir()
    assert evaluate.main(["--ckpt", str(amoebanet_run), "--out", str(out),
                          "--eval_batch_size=5"]) == 1
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err
    assert error_lines(err)[0].startswith(f"error: could not write {out.with_suffix('.png')}: ")
    assert json.loads(out.with_suffix(".json").read_text())["images"] > 0  # written before
    # under torchrun: rank 0 says it once, the other rank does not wait for it in vain
    (tmp_path / "piped.json").mkdir()
    run = command(*launch.torchrun_command("apps.amoebanet.evaluate", [
        "--ckpt", str(amoebanet_run), "--out", str(tmp_path / "piped"),
        "--eval_batch_size=5"])[2:])
    assert run.returncode != 0
    assert len(error_lines(run.stderr)) == 1, run.stderr[-3000:]
    assert error_lines(run.stderr)[0].startswith(
        f"error: could not write {tmp_path / 'piped.json'}: "), run.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# A rank that stops (SIGSTOP) while translate decodes through the pipeline


@pytest.fixture(scope="module")
def nmt_run_short_timeout(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny NMT checkpoint whose config says timeout_s=4 (what its pipelines wait)."""
    out_dir = tmp_path_factory.mktemp("nmt_short") / "run"
    nmt_tests.torchrun(nmt_tests.tiny_args(corpus, out_dir, max_steps=2, dropout=0.0,
                                           timeout_s=4))
    return out_dir


def test_a_stopped_rank_in_pipelined_translation_is_named_with_rank_and_stage(
    nmt_run_short_timeout: Path, corpus: Path, tmp_path: Path
) -> None:
    import signal
    import time

    from tests.apps.test_failures import HUNG_BOUND_S, finish, launch, wait_for, worker_pids

    sentences, _ = load_eval_sentences(corpus, "test", ["de"], max_per_lang=50, pad_id=0)
    lines = [s.source for s in sentences]
    source_file = tmp_path / "sources.de"
    # groups of 3000 lines, each of which takes the pipeline seconds to decode (one process
    # decodes about 1500 lines a second), between messages of milliseconds: the stop comes
    # half a second after the first group's translations, in the second group's decoding
    size = 3000
    source_file.write_text("\n".join(lines * (4 * size // len(lines) + 1)) + "\n")
    log = tmp_path / "out.txt"
    process = launch(["--ckpt", str(nmt_run_short_timeout), "--lang", "de", "--input",
                      str(source_file), "--beam-size", "2", "--batch-lines", str(size)], log,
                     module="apps.nmt.translate")
    wait_for(lambda: len(log.read_text().splitlines()) >= size, process, log, timeout_s=90)
    time.sleep(0.5)
    pids = worker_pids(process.pid)
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(lambda: "error: " in log.read_text(), process, log, timeout_s=30)
        waited = time.monotonic() - stopped
    finally:
        os.kill(pids[1], signal.SIGKILL)
    output = finish(process, log)
    assert process.returncode != 0
    errors = error_lines(output)
    assert len(errors) == 1, output[-3000:]
    # torchrun's agent prints its ChildFailedError; no traceback comes from the command
    assert not [line for line in output.splitlines()
                if line.startswith("  File") and f"{REPO}/apps/" in line], output[-3000:]
    # this rank and stage, and the peer's rank and stage: "stage 1" alone is ambiguous when
    # the world holds several pipelines (data-parallel replicas)
    assert errors[0].startswith("error: rank 0 (stage 0) in pipelined decoding, "), errors[0]
    assert "rank 1 (stage 1)" in errors[0], errors[0]
    assert waited < HUNG_BOUND_S, waited
