"""Every option of both train scripts, fed its bad values: exit status 2 and exactly one
``error:`` line naming the option and the fix, from one rank only, before any process group
(``apps.validation``, ``apps.config``); and the inference commands' flags.

The table is the specification: for each option the kinds of value it must refuse. The train
scripts run as under torchrun (``RANK``, ``WORLD_SIZE=2``, ``MASTER_ADDR`` set) through their
real entry point (``run_main(main)``), once as rank 0 (one line) and once as rank 1 (silent).
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from apps.amoebanet import train as amoebanet_train
from apps.amoebanet.config import AmoebaNetConfig
from apps.config import ConfigError, _coerce
from apps.harness.entry import run_main
from apps.nmt import train as nmt_train
from apps.nmt.config import NMTConfig
from apps.validation import MIN_TIMEOUT_S, check_world
from tests.apps.test_failures import finish, launch

REPO = Path(__file__).resolve().parents[2]

# the kinds of bad value, as a user types them
BAD = {
    "nan": ["nan"],
    "inf": ["inf", "-inf", "1e999"],
    "negative": ["-1"],
    "zero": ["0"],
    "fraction": ["2.5", "2.5e0", "1e-3"],
    "wrong type": ["abc"],
    "empty": [""],
}
INT_KINDS = {"nan", "inf", "negative", "fraction", "wrong type", "empty"}
FLOAT_KINDS = {"nan", "inf", "negative", "wrong type", "empty"}

# int options where 0 is refused too (0 means "none" / "no limit" / "at the end" elsewhere)
NMT_ZERO_BAD = set(
    "num_layers ffn_dim num_heads head_dim d_model vocab_size max_positions max_tokens max_len "
    "num_stages chunks max_steps log_every beam_size max_decode_len num_threads "
    "eval_max_sentences eval_batch_tokens unk_id bos_id eos_id "  # 0 is pad_id's
    "logits_abs_max sampling_temperature lr timeout_s".split())
AMOEBANET_ZERO_BAD = set(
    "num_normal_cells filters num_classes in_chans image_size stem_stride batch_size "
    "eval_batch_size num_stages chunks epochs log_every lr opt_eps decay_epochs decay_rate "
    "crop_scale_min crop_pct std timeout_s".split())
NEGATIVE_ALLOWED = {"mean"}  # a normalisation mean may be below 0
CHOICES = {"norm", "schedule", "checkpoint", "optimizer", "lr_schedule", "device", "precision",
           "wandb_mode", "genotype", "dataset"}
OPEN_STRINGS = {"auto_augment"}  # optional: None by default
# options whose value is a relation, with values that break it (tiny configs: NMT 6 layers,
# AmoebaNet 9; both num_stages=2)
RELATIONS: dict[str, list[str]] = {
    "balance": ["[]", "[-1,5]", "[0,4]", "[1,1]", "[x]", "[2.5,3]", "nan", "[3,3,2]"],
    "timeout_s": ["0.001", str(MIN_TIMEOUT_S / 2)],
    "bucket_thresholds": ["[1,2]", "[5]", "nan", "[x,1]"],
    # a per-rank budget below the smallest feasible peak (everything re-materialized)
    "memory_budget_mb": ["0.001", "0.01"],
}


def bad_values(cls: type, zero_bad: set[str]) -> list[tuple[str, str]]:
    """(option, value) for every option of ``cls`` and every kind of value it must refuse."""
    hints = typing.get_type_hints(cls)
    rows: list[tuple[str, str]] = []
    for field in dataclasses.fields(cls):
        name, annotation = field.name, hints[field.name]
        text = str(annotation)
        if annotation is int:
            kinds = INT_KINDS | ({"zero"} if name in zero_bad else set())
        elif annotation is float or text.startswith("tuple[float"):
            kinds = FLOAT_KINDS | ({"zero"} if name in zero_bad else set())
            kinds -= {"negative"} if name in NEGATIVE_ALLOWED else set()
        elif annotation is bool:
            rows += [(name, "maybe"), (name, ""), (name, "2")]
            continue
        elif annotation is str:
            rows.append((name, ""))
            if name in CHOICES:
                rows.append((name, "bogus"))
            continue
        else:  # lists and optional values: their relations below
            kinds = set()
        rows += [(name, value) for kind in sorted(kinds) for value in BAD[kind]]
        rows += [(name, value) for value in RELATIONS.get(name, [])]
    return [row for row in rows if row[0] not in OPEN_STRINGS]


NMT_ROWS = bad_values(NMTConfig, NMT_ZERO_BAD)
AMOEBANET_ROWS = bad_values(AmoebaNetConfig, AMOEBANET_ZERO_BAD)


def run_as_rank(main: Callable[[list[str]], Any], argv: list[str], rank: int,
                capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                ) -> tuple[int, str]:
    """The train script's entry point as rank ``rank`` of 2 under torchrun (before any process
    group): its exit status and what it printed."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # a row that passes validation fails (timeout_s=5)
    capsys.readouterr()
    try:
        run_main(lambda: main(argv), command="torchrun ...")
        code = 0
    except SystemExit as stopped:
        code = int(stopped.code or 0)
    except Exception as error:  # noqa: BLE001 - the value got past validation: a failure
        code = -1
        print(f"passed validation, then {type(error).__name__}: {error}")
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def check_rows(rows: list[tuple[str, str]], main: Callable[[list[str]], Any],
               base: list[str], capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> None:
    failures = []
    for name, value in rows:
        argv = [*base, f"--{name}={value}"]
        code, output = run_as_rank(main, argv, 0, capsys, monkeypatch)
        lines = output.splitlines()
        errors = [line for line in lines if line.startswith("error:")]
        fix = ("must", "give", "use ", "pass", "one of", "set ", "raise", "lower")
        ok = (code == 2 and len(errors) == 1 and len(lines) == 1 and name in errors[0]
              and any(word in errors[0] for word in fix))
        code1, output1 = run_as_rank(main, argv, 1, capsys, monkeypatch)
        if not ok or code1 != 2 or output1:
            failures.append(f"--{name}={value!r}: rank 0 exit {code}: {output!r}; rank 1 exit "
                            f"{code1}: {output1!r}")
    assert not failures, f"{len(failures)} of {len(rows)}:\n" + "\n".join(failures)


def test_every_nmt_option_refuses_its_bad_values_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(NMT_ROWS) > 300
    base = ["--config=tiny", f"--data_dir={tmp_path / 'corpus'}", f"--out_dir={tmp_path / 'run'}",
            "--timeout_s=5"]
    check_rows(NMT_ROWS + [("num_stages", "3"), ("device", "cuda")], nmt_train.main, base,
               capsys, monkeypatch)


def test_every_amoebanet_option_refuses_its_bad_values_in_one_line(
        shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(AMOEBANET_ROWS) > 300
    base = ["--config=tiny_test", f"--data_dir={shards}", f"--out_dir={tmp_path / 'run'}",
            "--timeout_s=5"]
    check_rows(AMOEBANET_ROWS + [("num_stages", "3")], amoebanet_train.main, base, capsys,
               monkeypatch)


@pytest.mark.parametrize("value, expected", [
    ("2", 2), ("2e3", 2000), ("2.0", 2), (" 7 ", 7), (3, 3), (4.0, 4),
    ("2.5e0", None), ("1e-3", None), ("2.5", None), (2.5, None), ("nan", None), ("inf", None),
    (True, None), ("", None), ("x", None),
])
def test_integers_are_whole_numbers_never_truncated(value: Any, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(ConfigError, match="max_steps="):
            _coerce("max_steps", value, int)
    else:
        assert _coerce("max_steps", value, int) == expected


# The settings of a run's length that are no longer settings (issue 41.5), per app, with what the
# refusal must name instead. At 0 (their old "off") they load, so a config saved before does.
RETIRED = {
    "nmt": {"max_minutes": ("--budget_minutes", "--stop_at_step"),
            "max_train_tokens": ("--train_steps",)},
    "amoebanet": {"max_minutes": ("--budget_minutes", "--stop_at_step"),
                  "max_steps": ("--stop_at_step", "--train_steps")},
}


@pytest.mark.parametrize("app, key", [(app, key) for app, keys in RETIRED.items() for key in keys])
def test_a_retired_length_setting_is_refused_naming_what_replaces_it(
        app: str, key: str, tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.amoebanet.config import load_train_config
    from apps.nmt.config import load_nmt_config

    load = load_nmt_config if app == "nmt" else load_train_config
    base = ["--config=tiny"] if app == "nmt" else ["--config=tiny_test"]
    assert load([*base, f"--{key}=0"]) == load(base)  # the old "off" is no setting at all
    saved = tmp_path / "config.yaml"
    saved.write_text(f"{key}: 5\n")
    for argv in ([*base, f"--{key}=5"], [f"--config={saved}"]):
        with pytest.raises(ConfigError, match=rf"^{key}=5 in .* is no longer a setting: ") as error:
            load(argv)
        assert all(new in str(error.value) for new in RETIRED[app][key]), error.value
    # under torchrun's environment: one line, from rank 0 only, exit 2
    main = nmt_train.main if app == "nmt" else amoebanet_train.main
    data = tmp_path / "corpus" if app == "nmt" else shards
    check_rows([(key, "5")], main, [*base, f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}",
                                    "--timeout_s=5"], capsys, monkeypatch)


def test_the_issue_s_numbers_are_refused_with_their_fix() -> None:
    from apps.amoebanet.config import load_train_config
    from apps.nmt.config import load_nmt_config

    with pytest.raises(ConfigError, match=r"^stop_at_step='1e-3' is not a whole number; give an "
                                          r"integer such as 1;"):
        load_train_config(["--config=tiny_test", "--stop_at_step=1e-3"])
    with pytest.raises(ConfigError, match=r"^num_layers='2.5e0' is not a whole number"):
        load_nmt_config(["--config=tiny", "--num_layers=2.5e0"])
    with pytest.raises(ConfigError, match=r"^timeout_s=0.001 is below the floor of 1 s"):
        load_nmt_config(["--timeout_s=0.001"])
    for balance in ("[-1,5]", "[0,4]", "[1,1]", "[]"):
        with pytest.raises(ConfigError, match=r"^balance=\[.*\] must have num_stages=2 entries "
                                              r"summing to the model's 9 layers"):
            load_train_config(["--config=tiny_test", f"--balance={balance}"])
    with pytest.raises(ConfigError, match="must give every stage a layer"):
        load_train_config(["--config=tiny_test", "--balance=[9,0]"])
    assert load_train_config(["--config=tiny_test", "--balance=[5,4]"]).balance == (5, 4)


def test_num_stages_must_divide_the_world_torchrun_started() -> None:
    check_world(2, environ={"WORLD_SIZE": "4"})
    check_world(3, environ={})  # not under torchrun: the launcher says so later
    with pytest.raises(ConfigError, match=r"^num_stages=3 does not divide the 2 ranks torchrun "
                                          r"started .*pass --num_stages as one of \[1, 2\], or "
                                          r"launch torchrun with --nproc-per-node 3"):
        check_world(3, environ={"WORLD_SIZE": "2"})


# ---------------------------------------------------------------------------------------------
# The inference commands' flags


INFERENCE = {
    "apps.nmt.translate": ["--lang=de"],
    "apps.nmt.evaluate": [],
    "apps.amoebanet.evaluate": [],
    "apps.amoebanet.classify": ["image.png"],
}
FLAG_ROWS = [
    (module, flag, value)
    for module in INFERENCE
    for flag, values in {"--threads": ["0", "-1", "2.5", "x", ""],
                         "--device": ["bogus", "cuda", "cpu:0", "cuda:x", ""]}.items()
    for value in values
] + [("apps.nmt.evaluate", "--beam", v) for v in ("0", "-1", "1.5")] + [
    ("apps.nmt.evaluate", "--max-per-lang", v) for v in ("0", "-1", "x")] + [
    ("apps.nmt.translate", "--beam-size", "0"), ("apps.amoebanet.evaluate", "--stages", "0")]


@pytest.mark.parametrize("module, flag, value", FLAG_ROWS)
def test_an_inference_flag_with_a_bad_value_is_one_line(
        module: str, flag: str, value: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The command's ``main`` as ``python -m`` runs it (in this process: importing torch per
    row would take minutes); rank 0 of a torchrun launch says the same."""
    if flag == "--device" and value == "cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    main = importlib.import_module(module).main
    try:
        code = main([f"--ckpt={tmp_path / 'none'}", *INFERENCE[module], f"{flag}={value}"])
    except SystemExit as stopped:
        code = stopped.code
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1 and not captured.out, captured
    assert lines[0].startswith(f"error: {flag}"), lines
    assert any(word in lines[0] for word in ("must be >= 1", "give")), lines[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("option", ["--balance=[]", "--num_stages=3", "--timeout_s=0.001",
                                    "--stop_at_step=1e-3"])
def test_amoebanet_bad_options_under_torchrun_are_one_line(option: str, shards: Path,
                                                           tmp_path: Path) -> None:
    log = tmp_path / "out.txt"
    process = launch(["--config=tiny_test", f"--data_dir={shards}",
                      f"--out_dir={tmp_path / 'run'}", "--wandb_mode=disabled", option], log)
    output = finish(process, log, timeout_s=120)
    errors = [line for line in output.splitlines() if "error:" in line]
    assert process.returncode != 0 and len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"error: {option[2:].split('=')[0]}"), errors[0]
    assert "exitcode: 2" in output  # torchrun's summary: each worker's status
    assert 'File "' + str(REPO / "apps") not in output, output[-3000:]
