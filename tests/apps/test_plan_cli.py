"""The planning commands print a plan for an app config, and say by how much nothing fits."""

from __future__ import annotations

import pytest

from apps.amoebanet.plan import main as plan_amoebanet
from apps.nmt.plan import main as plan_nmt


def test_nmt_plan_prints_the_fastest_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_nmt(["--config", "tiny", "--device", "a100_80gb", "--devices", "2",
                     "--schedule", "gpipe", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "1. gpipe K=" in out and "sentence pairs/s" in out and "tokens/s" in out
    assert "GiB of 74.5" in out


def test_amoebanet_plan_says_by_how_much_nothing_fits(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert plan_amoebanet(["--config", "tiny_test", "--device", "p100", "--devices", "2",
                           "--memory-gb", "0.0001", "--schedule", "gpipe"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and "over" in out and "allow more stages" in out


@pytest.mark.parametrize(("plan", "wrong", "known"), [(plan_nmt, "t64", "t64_16384_32"),
                                                     (plan_amoebanet, "d_18", "d_18_416")])
def test_an_unknown_config_is_one_line_naming_the_known_ones(
        plan, wrong: str, known: str, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert plan(["--config", wrong, "--device", "p100", "--devices", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config file '{wrong}' does not exist") and known in err
    assert "Traceback" not in err and err.count("\n") == 1
