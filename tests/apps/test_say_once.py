"""An error every rank reaches alike before any process group is said once and never lost:
rank 0 says it at once; under torchrun another rank waits for torchrun to stop it (rank 0
exited with the error), and says it itself only if the run outlives the wait; a process with
only ``RANK`` set (no torchrun agent) leaves it to rank 0 at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.validation import say_once

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("rank", "torchrun", "wait_s", "said"), [
    ("0", True, 60.0, True),  # rank 0 says it at once, under torchrun or not
    ("0", False, 60.0, True),
    ("1", False, 60.0, False),  # only RANK set (no torchrun agent): silent at once
    ("1", True, 0.3, True),  # a torchrun worker: only after the wait (the run outlived it)
])
def test_who_says_it_and_when(rank: str, torchrun: bool, wait_s: float, said: bool,
                              monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", rank)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    start = time.monotonic()
    say_once("error: --lang=xx", wait_s=wait_s)
    waited = time.monotonic() - start
    if rank != "0" and torchrun:
        assert waited >= wait_s
    else:
        assert waited < 5.0
    assert capsys.readouterr().err == ("error: --lang=xx\n" if said else "")


def test_sigterm_during_the_wait_ends_the_rank_silently_even_with_a_handler() -> None:
    # the train scripts turn SIGTERM into a flag (a checkpoint at the next step): the wait puts
    # the default action back, so torchrun's SIGTERM ends it at once and it says nothing
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)\n"
            "from apps.validation import say_once\n"
            "print('waiting', flush=True)\n"
            "say_once('error: said twice', wait_s=60.0)\n")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                               env={**os.environ, "RANK": "1", "TORCHELASTIC_RUN_ID": "test"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == "waiting\n"
    # SIGTERM until it ends: one sent before the wait began meets the handler (absorbed), any
    # sent during the wait ends it
    deadline = time.monotonic() + 30.0
    while process.poll() is None and time.monotonic() < deadline:
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
    _, err = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM
    assert "said twice" not in err
