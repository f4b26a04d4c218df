"""Train AmoebaNet with DistributedGPipe under torchrun; report test top-1/top-5 at the end.

    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:0 -m apps.amoebanet.train [--config=...] [--key=value ...] \
        [--resume] [--max_steps=N]

With no ``--config`` the CPU default ``configs/cpu_fashion_mnist.yaml`` is used (a bare name such
as ``--config=tiny_test`` means ``configs/tiny_test.yaml``). Two run options sit beside the config
keys: ``--resume`` continues from ``out_dir``'s latest checkpoint, and ``--max_steps=N`` stops after
N optimizer steps without shortening the learning-rate schedule (for tests and smoke runs).

Reads top to bottom: config -> data -> model -> optimizer -> (resume) -> loop -> final evaluation
(through the pipeline: ``apps/amoebanet/evaluate.py``, which ``scripts/eval_top1.py`` shares).
The world is ``num_stages`` pipeline ranks times R data-parallel replicas (pipeline-major: ranks
``r*K ... r*K+K-1`` are replica r). Only a replica's first stage reads images (replica r reads
every R-th shard); it sends each batch's targets to its last stage, so the last stage decodes
nothing. An epoch ends for everyone when any replica's shards run dry.

The run's length: ``train_steps`` if given; else, with ``budget_minutes`` (the CPU default: 28),
fitted once to that time from the speed of the first steps (``apps/budget.py``: the whole run,
data preparation and the final evaluation included), and the cosine schedule spans exactly the
chosen steps, so a slower machine trains fewer steps of a complete schedule; else ``epochs``.
``max_minutes`` is a hard stop that cuts the schedule (and says so): rank 0 stops training when
the time left would not cover the final evaluation.

``out_dir`` holds ``step-NNNNNNN/`` checkpoints (model shards keyed by the original module names,
per-rank optimizer / scheduler / data-position / RNG state, ``run.json`` with the balance, and the
resolved ``config.yaml``), a ``latest`` pointer, ``log.jsonl`` (one line per step),
``eval_<split>.json`` + ``.png`` (top-1/top-5 and the confusion matrix) and ``summary.json``.
``--resume`` continues exactly: the same batches, augmentations, drop-path masks, learning rates
and optimizer moments as a run that never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import gpipe_core as gp
from apps.amoebanet.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    AmoebaNetConfig,
    build_model,
    load_amoebanet_config,
    optimizer_kwargs,
    scheduler_kwargs,
)
from apps.amoebanet.data import (
    Batch,
    CorruptShardError,
    DatasetNotFoundError,
    build_mixup,
    build_train_loader,
    build_train_loss,
    class_names,
    dataset_is_complete,
    num_images,
    shard_infos,
)
from apps.amoebanet.evaluate import TRAIN_COMMAND, evaluate_pipeline, write_report
from apps.budget import RunLength
from apps.config import ConfigError, load_config, parse_overrides, save_config
from apps.harness.checkpoints import (
    check_resumable,
    checkpoint_dir,
    load_train_state,
    refuse_existing_run,
    resume_checkpoint,
    write_checkpoint,
)
from apps.harness.entry import run_main
from apps.harness.guards import Interrupt, check_loss
from apps.harness.out_dir import check_out_dir, lock_out_dir
from apps.harness.pipeline import choose_balance
from apps.harness.rank0 import on_rank0
from apps.harness.run import setup_run
from apps.harness.run_log import RunLogger

# Models up to this size are balanced by the measured time of each layer on rank 0 (a full
# copy is materialized for it); larger ones by parameter count, so no rank holds the whole model.
PROFILE_MAX_PARAMETERS = 50_000_000
# Config keys a resumed run may change (apps.harness.checkpoints.check_resumable): they touch neither the
# model, its partitioning nor the training stream; every other key must match the checkpoint's.
RESUMABLE_CHANGES = frozenset({
    "out_dir", "data_dir", "max_minutes", "log_every", "eval_every_epochs", "eval_split",
    "eval_batch_size", "wandb_mode", "wandb_project", "skip_corrupt_shards", "timeout_s",
    "ckpt_every", "max_loss_factor", "pin_cpus", "hold_memory", "quiet_io",
    "budget_minutes", "train_steps",  # the length the checkpoint records is the one resumed
})


@dataclass
class RunOptions:
    """Options of one invocation that are not part of the model's config (not saved with it)."""

    resume: bool = False  # continue from out_dir's latest checkpoint, exactly
    max_steps: int = 0  # stop after this many optimizer steps, schedule unchanged (0 = at its end)


# ---------------------------------------------------------------------------------------------
# Config


def parse_args(argv: Sequence[str]) -> tuple[RunOptions, AmoebaNetConfig]:
    """Split ``--resume`` / ``--max_steps`` from the config keys; resolve and validate both."""
    config_path, overrides = parse_overrides(argv)
    run_keys = {f.name for f in dataclasses.fields(RunOptions)}
    options = load_config(RunOptions, [f"--{k}={v}" for k, v in overrides.items() if k in run_keys])
    path = Path(config_path) if config_path else DEFAULT_CONFIG
    if not path.is_file() and (CONFIG_DIR / f"{path.name}.yaml").is_file():
        path = CONFIG_DIR / f"{path.name}.yaml"  # --config=tiny_test
    config_argv = [f"--config={path}"]
    config_argv += [f"--{k}={v}" for k, v in overrides.items() if k not in run_keys]
    try:
        config = load_amoebanet_config(config_argv)
    except ConfigError as error:
        raise ConfigError(f"{error}; run options: --resume, --max_steps=N") from None
    if options.max_steps < 0:
        raise ConfigError(f"max_steps={options.max_steps} must be >= 0 (0 = no limit)")
    return options, config


# ---------------------------------------------------------------------------------------------
# Data


def check_dataset(config: AmoebaNetConfig) -> None:
    """Raise DatasetNotFoundError (naming the command that builds it) if a split is missing.

    Fashion-MNIST is prepared by rank 0 instead, so it is checked only once it is complete.
    """
    if config.dataset == "fashion_mnist" and not dataset_is_complete(config.data_dir):
        return
    for split in (config.train_split, config.eval_split):
        shard_infos(config, split)


def prepare_fashion_mnist(config: AmoebaNetConfig) -> None:
    """Build the Fashion-MNIST shards under ``data_dir`` unless they are complete (rank 0 only)."""
    if config.dataset != "fashion_mnist" or dataset_is_complete(config.data_dir):
        return
    from data.fashion_mnist.prepare import prepare

    print(f"preparing Fashion-MNIST in {config.data_dir} (once; about 30 s)", flush=True)
    prepare(config.data_dir)


def seed_process_rngs(*parts: object) -> None:
    """Seed Python's, NumPy's and torch's global RNGs from ``parts`` (order matters)."""
    seed = random.Random("-".join(map(str, parts))).randrange(2**31)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_batches(
    config: AmoebaNetConfig, epoch: int, *, skip: int, replica: int, num_replicas: int
) -> Iterator[Batch]:
    """The epoch's batches for one replica, after skipping the first ``skip`` (for resume).

    The loader seeds shard order, shuffling, mixup and its workers' augmentation from
    ``(seed, epoch)``. With ``num_workers=0`` timm's crops and flips draw from this process'
    global RNGs instead, so those are seeded per epoch too; either way skipping ``skip`` batches
    lands on exactly the state a run that never stopped had.
    """
    if config.num_workers == 0:
        seed_process_rngs("augment", config.seed, epoch, replica)
    loader = build_train_loader(config, epoch=epoch, dp_rank=replica, dp_size=num_replicas)
    batches = iter(loader)
    for _ in range(skip):
        if next(batches, None) is None:
            break
    return batches


# ---------------------------------------------------------------------------------------------
# Model


def amoebanet_balance(config: AmoebaNetConfig, device: torch.device) -> list[int]:
    """``config.balance``, else by measured time (see :func:`apps.harness.pipeline.choose_balance`)."""
    if config.balance is not None:
        return list(config.balance)
    micro_batch = max(1, config.batch_size // config.chunks)
    sample = torch.randn(micro_batch, config.in_chans, config.image_size, config.image_size)
    return choose_balance(lambda: build_model(config, device="meta"), sample,
                          config.num_stages, seed=config.seed, device=device,
                          max_parameters=PROFILE_MAX_PARAMETERS)


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Train; returns rank 0's summary (final top-1/top-5 included), None on other ranks."""
    started = time.monotonic()

    # --- config (errors here stop every rank before any process group exists) -------------
    options, config = parse_args(sys.argv[1:] if argv is None else argv)
    check_dataset(config)
    check_out_dir(Path(config.out_dir))  # every rank, before any process group: one line
    # one thread per rank: the stages are the parallelism on CPU; every collective fails within
    # timeout_s (naming the rank that hangs); the one long wait, for rank 0 to prepare the data,
    # is on the store instead (on_rank0)
    run = setup_run(num_stages=config.num_stages, device="auto", num_threads=1,
                    timeout_s=config.timeout_s, pin_cpus=config.pin_cpus,
                    hold_memory=config.hold_memory)
    rank, world_size, device = run.rank, run.world_size, run.device
    num_replicas, replica, master, say = run.num_replicas, run.replica, run.master, run.say
    use_cuda = device.type == "cuda"
    out_dir = Path(config.out_dir)

    # one run per out_dir at a time: rank 0 holds its lock until it exits
    on_rank0(lambda: lock_out_dir(out_dir), what="locking out_dir")

    # --- data: Fashion-MNIST prepared once by rank 0; the others wait ---------------------
    on_rank0(lambda: prepare_fashion_mnist(config), what="preparing Fashion-MNIST")
    check_dataset(config)
    classes = class_names(config)
    train_images = num_images(config, config.train_split)
    updates_per_epoch = train_images // (config.batch_size * num_replicas)
    if updates_per_epoch < 1:
        raise ConfigError(
            f"split {config.train_split!r} has {train_images} images, fewer than one step "
            f"(batch_size={config.batch_size} x {num_replicas} replica(s)); lower batch_size"
        )
    train_loss = build_train_loss(config)
    soft_targets = build_mixup(config) is not None  # mixup/cutmix: [B, classes] float targets

    # --- resume: what the checkpoint fixes (balance, counters) ------------------------------
    resume_dir: Path | None = None
    state: dict[str, Any] = {}
    if options.resume:
        # the newest checkpoint whose files all verify (an older one, with a warning, if the
        # newest is damaged)
        resume_dir = resume_checkpoint(out_dir, train_command=TRAIN_COMMAND.format(
            out_dir=out_dir), verbose=master)
        saved = load_amoebanet_config([f"--config={resume_dir / 'config.yaml'}"])
        check_resumable(saved, config, may_change=RESUMABLE_CHANGES, checkpoint=resume_dir)
        state = load_train_state(resume_dir, rank, world_size)
    else:
        refuse_existing_run(out_dir)

    # --- model: built on meta; each rank materializes only its own stage ------------------
    model = build_model(config, device="meta")
    num_params = sum(p.numel() for p in model.parameters())
    balance = list(state["balance"]) if state else amoebanet_balance(config, device)

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        # evaluation passes integer labels even when training mixes them into soft targets
        if soft_targets and not targets.is_floating_point():
            return F.cross_entropy(logits.float(), targets)
        return train_loss(logits.float(), targets)

    pipe = gp.DistributedGPipe(
        model,
        balance,
        chunks=config.chunks,
        checkpoint=config.checkpoint,
        schedule=config.schedule,
        loss_fn=loss_fn,
        group=run.pipeline_group,
        data_parallel_group=run.data_group if num_replicas > 1 else None,
        device=device,
        seed=config.seed,
        deferred_batch_norm=True,  # per-micro-batch statistics, mini-batch running statistics
        quiet_io=config.quiet_io,
    )
    del model

    # --- optimizer and learning-rate schedule from timm's factories -----------------------
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    # per-parameter optimizers (AdamW, RMSProp, SGD) on each stage's parameters equal one
    # optimizer over the whole model; weight decay skips biases and BatchNorm as timm does
    optimizer = create_optimizer_v2(pipe, **optimizer_kwargs(config))
    # the run's length (apps/budget.py): given, fitted to budget_minutes after the first steps
    # (all inside warm-up, which does not depend on it), or epochs; the schedule spans it
    length = RunLength(train_steps=config.train_steps, budget_minutes=config.budget_minutes,
                       cap=config.epochs * updates_per_epoch, cap_name=f"epochs={config.epochs}",
                       warmup_steps=config.warmup_epochs * updates_per_epoch,
                       step=state.get("step", 0), saved_steps=state.get("train_steps", 0))
    scheduler, _ = create_scheduler_v2(
        optimizer, **scheduler_kwargs(config, updates_per_epoch, length.steps))
    autocast: AbstractContextManager[Any] = (
        torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda else nullcontext()
    )
    say(
        f"AmoebaNet-{config.genotype}({config.num_normal_cells}, {config.filters}): "
        f"{num_params:,} parameters, {sum(balance)} layers; {config.num_stages} "
        f"stages, balance {balance}, {config.chunks} micro-batches, schedule {config.schedule}, "
        f"checkpoint {config.checkpoint}, {num_replicas} replica(s), {world_size} rank(s) on "
        f"{device.type}; {config.dataset}: {train_images:,} train images, {updates_per_epoch} "
        f"steps per epoch of {config.batch_size * num_replicas}"
    )

    # --- resume: weights, optimizer, scheduler, data position, RNGs -----------------------
    step, epoch, batch_in_epoch, images_seen, train_seconds = 0, 0, 0, 0, 0.0
    if resume_dir is not None:
        pipe.load_checkpoint(resume_dir)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        images_seen, train_seconds = state["images_seen"], state["train_seconds"]
        pipe.steps_done = state["pipe_steps"]  # seeds drop-path: must continue, not restart
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        say(f"resumed from {resume_dir} at step {step} (epoch {epoch}, batch {batch_in_epoch})")
    with gp.collectives("start of training"):
        dist.barrier()
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, out_dir / "config.yaml")
    logger = RunLogger(config, out_dir, resume_step=step, enabled=master)

    def save(step: int) -> Path:
        """Checkpoint: shards, per-rank state (RNGs included), config and run.json (collective)."""
        state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "images_seen": images_seen,
            "train_seconds": train_seconds,
            "pipe_steps": pipe.steps_done,
            "train_steps": length.recorded_steps,
            "balance": balance,
            "world_size": world_size,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state()},
        }
        run_json = json.dumps({
            "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "balance": balance, "num_stages": config.num_stages, "world_size": world_size,
            "classes": classes, "parameters": num_params,
        }, indent=1) + "\n"
        # the checkpoint's config records the run's length once it is known
        saved_config = dataclasses.replace(config, train_steps=state["train_steps"])
        return write_checkpoint(out_dir, step, pipe, state, saved_config, rank=rank,
                                files={"run.json": run_json})

    eval_seconds_per_image: float | None = None
    eval_images = num_images(config, config.eval_split)

    def run_eval(split: str) -> dict[str, Any]:
        nonlocal eval_seconds_per_image
        begin = time.monotonic()
        with gp.collectives(f"evaluation on {split} at step {step}"):
            metrics = evaluate_pipeline(pipe, config, run, split, autocast)
        eval_seconds_per_image = (time.monotonic() - begin) / max(metrics.images, 1)
        return metrics.report(classes, split=split)

    def final_eval_reserve(images_per_second: float) -> float:
        """Seconds to keep for the final checkpoint and evaluation."""
        per_image = eval_seconds_per_image
        if per_image is None:  # forward only: assume 3x the training throughput
            per_image = 1.0 / max(3.0 * images_per_second, 1e-3)
        return 1.25 * eval_images * per_image + 60.0  # + start-up, checkpoint, wandb, exit

    # --- training loop ----------------------------------------------------------------------
    from tqdm import tqdm

    def bar_total() -> int:
        return min(length.steps, options.max_steps) if options.max_steps else length.steps

    if master and length.decided:
        say(length.choice.explain())  # type: ignore[union-attr]
    bar = tqdm(total=bar_total(), initial=step, disable=not master, dynamic_ncols=True,
               file=sys.stderr, mininterval=2.0, unit="step")
    window_loss, window_steps, window_start = 0.0, 0, time.monotonic()
    run_images_per_second = images_seen / train_seconds if train_seconds else 0.0
    last_saved = step if options.resume else -1
    stop_reason = ""
    batch_shape = (config.batch_size, config.num_classes) if soft_targets else (config.batch_size,)
    target_like = torch.empty(batch_shape, dtype=torch.float32 if soft_targets else torch.int64)
    # from here SIGINT / SIGTERM checkpoint at a step all ranks agree on, then exit
    interrupt = Interrupt()
    while epoch < config.epochs and not stop_reason:
        epoch_first_step = step
        batches = None
        if pipe.is_first:
            batches = train_batches(config, epoch, skip=batch_in_epoch, replica=replica,
                                    num_replicas=num_replicas)
        while True:
            # stop: max_steps, or rank 0's clock (keeping time for the final evaluation)
            tick = time.monotonic()  # training time counts loading, not checkpoints or evals
            length.tick(step)
            if length.due(step):  # fix the run's length (a collective); the schedule spans it
                choice = length.decide(
                    step=step, elapsed_s=time.monotonic() - started, master=master,
                    reserve_s=lambda per_step: final_eval_reserve(
                        config.batch_size * num_replicas / per_step), device=device)
                scheduler, _ = create_scheduler_v2(
                    optimizer, **scheduler_kwargs(config, updates_per_epoch, choice.train_steps))
                if master:
                    bar.total = bar_total()
                    bar.write(choice.explain(f" ({choice.train_steps / updates_per_epoch:.2f} "
                                             "epochs)"))
                    bar.refresh()
            batch = next(batches, None) if batches is not None else None
            keep_going = True
            if master:
                if step >= length.steps:
                    stop_reason = length.stop_reason
                elif options.max_steps and step >= options.max_steps:
                    stop_reason = f"max_steps={options.max_steps}"
                elif config.max_minutes:
                    left = 60 * config.max_minutes - (time.monotonic() - started)
                    if step > 0 and left < final_eval_reserve(run_images_per_second):
                        stop_reason = f"max_minutes={config.max_minutes:g}"
                keep_going = not stop_reason
            # the epoch ends for everyone as soon as one replica's shards run dry; a signal on
            # any rank stops every rank at this step, with a checkpoint
            flags = torch.tensor([int(batch is not None or not pipe.is_first), int(keep_going),
                                  int(not interrupt.requested)], device=device)
            with gp.collectives(f"stop decision before step {step + 1}"):
                dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            if not flags[2]:
                path = save(step) if last_saved != step else checkpoint_dir(out_dir, step)
                bar.close()
                logger.close()
                raise interrupt.stop(step=step, checkpoint=path, master=master)
            if not flags[1]:
                stop_reason = stop_reason or "stopped by rank 0"
                break
            if not flags[0]:
                epoch, batch_in_epoch = epoch + 1, 0
                break

            # learning rate: timm's schedule is a function of the update count
            scheduler.step_update(num_updates=step)
            lr = optimizer.param_groups[0]["lr"]

            # forward + backward through the pipeline; the targets travel first -> last stage
            with gp.collectives(f"targets of step {step + 1}"):
                targets = run.broadcast_from_first_stage(batch[1] if batch is not None else None, target_like)
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = pipe.step(batch[0] if batch is not None else None,
                                 targets if pipe.is_last else None)
            if num_replicas > 1:
                with gp.collectives(f"loss of step {step + 1}"):
                    dist.all_reduce(loss, group=run.data_group)
                loss /= num_replicas
            optimizer.step()
            step += 1
            batch_in_epoch += 1
            images_seen += config.batch_size * num_replicas
            train_seconds += time.monotonic() - tick
            run_images_per_second = images_seen / max(train_seconds, 1e-9)

            # log: every step to log.jsonl; every log_every steps the bar and wandb
            loss_value = float(loss)
            # divergence: a non-finite loss, or one beyond max_loss_factor x ln(num_classes)
            check_loss(loss_value, step=step, num_classes=config.num_classes,
                       factor=config.max_loss_factor,
                       fix=f"lower lr={config.lr} or raise warmup_epochs={config.warmup_epochs}")
            window_loss += loss_value
            window_steps += 1
            logger.step({"step": step, "epoch": epoch, "loss": loss_value, "lr": lr})
            bar.update(1)
            if step % config.log_every == 0:
                elapsed = time.monotonic() - window_start
                images_per_second = window_steps * config.batch_size * num_replicas / elapsed
                logger.metrics({
                    "train/loss": window_loss / window_steps,
                    "train/lr": lr,
                    "train/images_per_second": images_per_second,
                    "train/epoch": step / updates_per_epoch,
                    "train/minutes": train_seconds / 60,
                }, step)
                bar.set_postfix(loss=f"{window_loss / window_steps:.3f}",
                                img_s=f"{images_per_second:.0f}", lr=f"{lr:.2e}",
                                epoch=f"{step / updates_per_epoch:.2f}", refresh=False)
                window_loss, window_steps, window_start = 0.0, 0, time.monotonic()

            # checkpoint every ckpt_every steps as well as at epoch ends
            if config.ckpt_every and step % config.ckpt_every == 0:
                save(step)
                last_saved = step

        # end of an epoch: checkpoint, and evaluate every eval_every_epochs (not after the last:
        # the final evaluation follows the loop)
        if batch_in_epoch == 0 and not stop_reason and step != epoch_first_step:
            if step != last_saved:
                save(step)
                last_saved = step
            due = config.eval_every_epochs and epoch % config.eval_every_epochs == 0
            if due and step < length.steps:
                report = run_eval(config.eval_split)
                if master:
                    bar.write(f"epoch {epoch}: {config.eval_split} top-1 "
                              f"{100 * report['top1']:.2f}% top-5 {100 * report['top5']:.2f}% "
                              f"loss {report['loss']:.4f}")
                logger.metrics({f"{config.eval_split}/top1": report["top1"],
                                f"{config.eval_split}/top5": report["top5"],
                                f"{config.eval_split}/loss": report["loss"]}, step)
            window_start = time.monotonic()  # the images/s window excludes checkpoint and eval
    bar.close()

    # --- final checkpoint and evaluation through the pipeline -----------------------------
    path = save(step) if last_saved != step else checkpoint_dir(out_dir, step)
    if stop_reason.startswith("max_minutes"):
        say(f"warning: the hard stop max_minutes={config.max_minutes:g} cut the run at step {step} "
            f"of {length.steps}: its learning-rate schedule did not end, so this is not the "
            "budgeted run's result (budget_minutes fits a run to a time instead)")
    say(
        f"trained {step} steps ({step / updates_per_epoch:.2f} epochs, {images_seen:,} images) "
        f"in {train_seconds / 60:.1f} min, {images_seen / max(train_seconds, 1e-9):.0f} "
        f"images/s; stopped by {stop_reason or f'epochs={config.epochs}'}; checkpoint {path}"
    )
    report = run_eval(config.eval_split)
    summary = None
    if master:
        write_report(report, out_dir / f"eval_{config.eval_split}")
        summary = {
            "steps": step,
            "epochs": round(step / updates_per_epoch, 3),
            "images": images_seen,
            "images_per_second": round(images_seen / max(train_seconds, 1e-9), 1),
            "train_minutes": round(train_seconds / 60, 2),
            "total_minutes": round((time.monotonic() - started) / 60, 2),
            "stopped_by": stop_reason or f"epochs={config.epochs}",
            # the run's length and how it was chosen (apps/budget.py)
            "budget": length.choice.to_json() if length.choice is not None else None,
            "balance": balance,
            "parameters": num_params,
            "checkpoint": str(path),
            "split": config.eval_split,
            "top1": report["top1"],
            "top5": report["top5"],
            "loss": report["loss"],
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        logger.metrics({f"{config.eval_split}/final_top1": report["top1"],
                        f"{config.eval_split}/final_top5": report["top5"]}, step)
        say(f"{config.eval_split} top-1: {100 * report['top1']:.2f}%  top-5: "
            f"{100 * report['top5']:.2f}%  ({report['images']:,} images; "
            f"total wall time {summary['total_minutes']} min)")
    logger.close()
    on_rank0(lambda: None, what="the end of the run")  # the others wait for rank 0's report
    interrupt.restore()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    run_main(main, command=TRAIN_COMMAND.format(out_dir="runs/amoebanet"),
             errors=(DatasetNotFoundError, CorruptShardError))
