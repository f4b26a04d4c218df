"""What both apps share (apps/harness/): pipeline options asked of the library, resume checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from apps.amoebanet import train as amoebanet_train
from apps.amoebanet.config import AmoebaNetConfig, load_amoebanet_config
from apps.config import ConfigError
from apps.harness import checkpoints, rank0
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
    checkpoints.check_resumable(saved, dataclasses.replace(saved, out_dir="elsewhere",
                                                      log_every=7),
                           may_change=may_change, checkpoint=Path("ckpt"))
    # the model, its partitioning and the data stream must match (an allow-list: a key not
    # listed must match, so a new key is safe until someone decides otherwise)
    for key, value in (("seed", 1), ("chunks", 8), ("balance", (6, 6))):
        changed = dataclasses.replace(saved, **{key: value})
        with pytest.raises(ConfigError, match=rf"--resume from ckpt: the config differs in "
                                              rf"\{{'{key}'"):
            checkpoints.check_resumable(saved, changed, may_change=may_change,
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
    assert sum(by_time) == sum(by_params) == config.num_model_layers
    assert by_time[1] < by_params[1]  # the projection's stage gets fewer layers


# ---------------------------------------------------------------------------------------------
# on_rank0: a long one-rank job whose rank 0 stops is found by its heartbeat, not after hours


def test_a_silent_rank_0_is_named_and_a_beating_one_is_waited_for() -> None:
    import threading
    import time

    import torch.distributed as dist

    import gpipe_core as gp

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False)
    key = "apps/on_rank0/preparing the corpus"
    # rank 0 beats for 1.5 s, then stops (a stuck disk, SIGSTOP): silence names it
    server.set(f"{key}/heartbeat", "0")

    def beat(times: int, then_done: bool) -> None:
        for count in range(1, times + 1):
            time.sleep(0.5)
            server.set(f"{key}/heartbeat", str(count))
        if then_done:
            server.set(key, "ok")

    threading.Thread(target=beat, args=(3, False), daemon=True).start()
    begin = time.monotonic()
    with pytest.raises(gp.PipelineFailure, match=r"^rank 1 stops: rank 0 gave no sign of life "
                       r"for 1 s while preparing the corpus \(that rank hangs or died\)$"):
        rank0.wait_for_rank0(client, key, what="preparing the corpus", rank=1, silence_s=1.0,
                              timeout_s=60)
    assert 1.5 + 1.0 <= time.monotonic() - begin < 1.5 + 1.0 + 1.0
    # a job three times longer than the silence bound, beating all along, is waited for
    key = "apps/on_rank0/evaluating"
    threading.Thread(target=beat, args=(6, True), daemon=True).start()
    assert rank0.wait_for_rank0(client, key, what="evaluating", rank=1, silence_s=1.0,
                                 timeout_s=60)
