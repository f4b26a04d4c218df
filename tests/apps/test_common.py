"""What both apps share (apps/common.py): pipeline options asked of the library, resume checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from apps import common
from apps.amoebanet import train as amoebanet_train
from apps.amoebanet.config import AmoebaNetConfig, load_amoebanet_config
from apps.config import ConfigError
from apps.nmt import train as nmt_train
from apps.nmt.config import NMTConfig, load_nmt_config

LOADERS: list[Callable[[list[str]], Any]] = [load_nmt_config, load_amoebanet_config]


@pytest.mark.parametrize("load", LOADERS, ids=["nmt", "amoebanet"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b_slack1", "1f1b_slack2"])
def test_apps_accept_every_schedule_the_library_runs(load: Callable[..., Any],
                                                     schedule: str) -> None:
    assert load([f"--schedule={schedule}"]).schedule == schedule


@pytest.mark.parametrize("load", LOADERS, ids=["nmt", "amoebanet"])
def test_a_bogus_schedule_gets_the_library_error(load: Callable[..., Any]) -> None:
    # the library's own message: the names it knows, and the 1f1b_slackN family
    with pytest.raises(ConfigError, match=r"schedule='zigzag': unknown schedule 'zigzag'; "
                                          r"choose one of .*'1f1b_slackN'"):
        load(["--schedule=zigzag"])


@pytest.mark.parametrize("load", LOADERS, ids=["nmt", "amoebanet"])
def test_checkpoint_modes_are_the_library_s(load: Callable[..., Any]) -> None:
    from gpipe_core.remat import CHECKPOINT_MODES

    for mode in CHECKPOINT_MODES:
        assert load([f"--checkpoint={mode}"]).checkpoint == mode
    with pytest.raises(ConfigError, match="checkpoint='sometimes' is not one of"):
        load(["--checkpoint=sometimes"])


@pytest.mark.parametrize("load", LOADERS, ids=["nmt", "amoebanet"])
def test_cpu_knobs_are_config_options(load: Callable[..., Any]) -> None:
    config = load(["--pin_cpus=true", "--hold_memory=true", "--quiet_io=false"])
    assert (config.pin_cpus, config.hold_memory, config.quiet_io) == (True, True, False)


@pytest.mark.parametrize(
    ("cls", "may_change"),
    [(NMTConfig, nmt_train.RESUMABLE_CHANGES),
     (AmoebaNetConfig, amoebanet_train.RESUMABLE_CHANGES)],
    ids=["nmt", "amoebanet"],
)
def test_resume_may_change_only_the_listed_keys(cls: type, may_change: frozenset[str]) -> None:
    saved = cls()
    fields = {f.name for f in dataclasses.fields(cls)}
    assert may_change <= fields
    common.check_resumable(saved, dataclasses.replace(saved, out_dir="elsewhere",
                                                      log_every=7),
                           may_change=may_change, checkpoint=Path("ckpt"))
    # the model, its partitioning and the data stream must match (an allow-list: a key not
    # listed must match, so a new key is safe until someone decides otherwise)
    for key, value in (("seed", 1), ("chunks", 8), ("balance", (6, 6))):
        changed = dataclasses.replace(saved, **{key: value})
        with pytest.raises(ConfigError, match=rf"--resume from ckpt: the config differs in "
                                              rf"\{{'{key}'"):
            common.check_resumable(saved, changed, may_change=may_change,
                                   checkpoint=Path("ckpt"))


def test_cpu_defaults_hold_memory_and_do_not_pin() -> None:
    # docs/RESULTS.md, "The apps' CPU knobs": holding freed memory halved NMT's page faults;
    # pinning showed no gain on the shared 2 cores
    from apps.amoebanet.config import DEFAULT_CONFIG

    for config in (load_nmt_config([]), load_nmt_config(["--config=cpu_default"]),
                   load_amoebanet_config([f"--config={DEFAULT_CONFIG}"])):
        assert (config.pin_cpus, config.hold_memory, config.quiet_io) == (False, True, True)


def test_the_nmt_default_is_balanced_by_time_not_parameters(tmp_path: Path) -> None:
    # By parameters the embedding (4000 x 128, little compute) weighs like several layers and the
    # output projection (a vocabulary-wide matmul per token) like few; timing puts the cut
    # elsewhere. Rank 0 of a one-process group times the real default model.
    import torch
    import torch.distributed as dist

    import gpipe_core as gp
    from apps.nmt.config import build_model

    config = load_nmt_config(["--config=cpu_default"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        by_time = nmt_train.nmt_balance(config, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    by_params = list(gp.balance_by_params(build_model(config, device="meta"), 2))
    assert sum(by_time) == sum(by_params) == 14
    assert by_time[1] < by_params[1]  # the projection's stage gets fewer layers


# ---------------------------------------------------------------------------------------------
# on_rank0: a long one-rank job whose rank 0 stops is found by its heartbeat, not after hours


def _rank0_stops_in_its_job(rank: int, world: int, report: str) -> None:
    import json
    import os
    import signal
    import time

    import torch.distributed as dist

    import gpipe_core as gp

    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:  # the job starts, then rank 0 stops (a stuck disk, SIGSTOP, a debugger)
        common.on_rank0(lambda: (time.sleep(2.5), os.kill(os.getpid(), signal.SIGSTOP)),
                        what="preparing the corpus")
        return
    begin = time.monotonic()
    try:
        common.on_rank0(lambda: None, what="preparing the corpus", silence_s=2.0)
        message = None
    except gp.PipelineFailure as failure:
        message = str(failure)
    Path(report).write_text(json.dumps({"message": message,
                                        "waited": time.monotonic() - begin}))
    os.kill(pids[0], signal.SIGKILL)


@pytest.mark.distributed
def test_a_stopped_rank_0_is_named_by_its_silence_not_after_hours(tmp_path: Path) -> None:
    import json

    from tests.distributed.launch import spawn

    report = tmp_path / "rank1.json"
    codes = spawn(_rank0_stops_in_its_job, 2, tmp_path / "run", str(report), timeout_s=60,
                  expect_failure=True, pg_timeout_s=60, tcp_store=True)
    assert codes[1][0] == 0, codes[1][1]
    result = json.loads(report.read_text())
    assert result["message"] == ("rank 1 stops: rank 0 gave no sign of life for 2 s while "
                                 "preparing the corpus (that rank hangs or died)"), result
    # 2.5 s of beats while the job ran, then 2 s of silence, polled every 0.25 s
    assert 4.5 <= result["waited"] < 2.5 + 2.0 + 2.0, result
