"""Train AmoebaNet with DistributedGPipe under torchrun; report test top-1/top-5 at the end.

    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:0 -m apps.amoebanet.train [--config=...] [--key=value ...] \
        [--resume] [--stop_at_step=N]

With no ``--config`` the CPU default ``configs/cpu_fashion_mnist.yaml`` is used (a bare name such
as ``--config=tiny_test`` means ``configs/tiny_test.yaml``). Two of the config's keys are options
of one run: ``--resume`` continues from ``out_dir``'s latest checkpoint, and ``--stop_at_step=N``
stops after N optimizer steps without shortening the learning-rate schedule (for tests and smoke
runs; ``--resume`` continues).

Reads top to bottom: config -> data -> model -> optimizer -> (resume) -> loop -> final evaluation
(through the pipeline: ``apps/amoebanet/evaluate.py``, which also scores checkpoints).
The world is ``num_stages`` pipeline ranks times R data-parallel replicas (pipeline-major: ranks
``r*K ... r*K+K-1`` are replica r). Only a replica's first stage reads images (replica r reads
every R-th shard); it sends each batch's targets to its last stage, so the last stage decodes
nothing. An epoch ends for everyone when any replica's shards run dry.

The run's length: ``train_steps`` if given; else, with ``budget_minutes`` (the CPU default: 28),
fitted once to that time from the speed of the first steps (``apps/budget.py``: the whole run,
data preparation and the final evaluation included), and the cosine schedule spans exactly the
chosen steps, so a slower machine trains fewer steps of a complete schedule; else ``epochs``.

``out_dir`` holds ``step-NNNNNNN/`` checkpoints (model shards keyed by the original module names,
per-rank optimizer / scheduler / data-position / RNG state, ``run.json`` with the balance, and the
resolved ``config.yaml``), a ``latest`` pointer, ``log.jsonl`` (one line per step),
``eval_<split>.json`` + ``.png`` (top-1/top-5 and the confusion matrix) and ``summary.json``.
``--resume`` continues exactly: the same batches, augmentations, drop-path masks, learning rates
and optimizer moments as a run that never stopped.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import gpipe_core as gp
from apps.amoebanet.commands import TRAIN_COMMAND
from apps.amoebanet.config import (
    AmoebaNetConfig,
    build_model,
    load_amoebanet_config,
    load_train_config,
    optimizer_kwargs,
    scheduler_kwargs,
    soft_targets,
)
from apps.amoebanet.data import (
    Batch,
    CorruptShardError,
    DatasetNotFoundError,
    build_train_loader,
    class_names,
    num_images,
    shard_infos,
)
from apps.amoebanet.loss import build_train_loss
from apps.amoebanet.plan import app_model as amoebanet_app_model
from apps.amoebanet.scoring import evaluate_pipeline, write_report
from apps.budget import RunLength
from apps.config import ConfigError
from apps.harness.entry import run_main
from apps.harness.guards import check_loss
from apps.harness.loop import (
    DATA_ENDED,
    STOP,
    TrainingLoop,
    every,
    find_resume,
    restore,
    start_run,
)
from apps.harness.pipeline import choose_balance
from apps.harness.rank0 import on_rank0
from apps.harness.run import Run
from apps.harness.writes import guarded_write
from apps.planning import describe_budget_plan, plan_for_budget
from data.image_shards import dataset_is_complete

# Models up to this size are balanced by the measured time of each layer on rank 0 (a full
# copy is materialized for it); larger ones by parameter count, so no rank holds the whole model.
PROFILE_MAX_PARAMETERS = 50_000_000
# Config keys a resumed run may change (apps.harness.checkpoints.check_resumable): they touch neither the
# model, its partitioning nor the training stream; every other key must match the checkpoint's.
RESUMABLE_CHANGES = frozenset({
    "out_dir", "data_dir", "log_every", "eval_every_epochs", "eval_split",
    "eval_batch_size", "wandb_mode", "wandb_project", "skip_corrupt_shards", "timeout_s",
    "ckpt_every", "keep_checkpoints", "max_loss_factor", "pin_cpus", "hold_memory", "quiet_io",
    "budget_minutes", "train_steps",  # the length the checkpoint records is the one resumed
    "memory_budget_mb",  # re-materialization only: every choice gives the same step
    "goal_steps", "resume", "stop_at_step",  # run options
    "precision",  # the weights stay float32 whatever the compute dtype
})


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


def rng_states() -> dict[str, Any]:
    """Python's, NumPy's and torch's global RNG states (saved in every checkpoint)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` saved."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def targets_like(config: AmoebaNetConfig) -> Tensor:
    """A batch's targets' shape and dtype, for the stages that do not read them: class ids, or
    with mixup/cutmix ``[B, classes]`` float targets."""
    soft = soft_targets(config)
    shape = (config.batch_size, config.num_classes) if soft else (config.batch_size,)
    return torch.empty(shape, dtype=torch.float32 if soft else torch.int64)


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
    """``config.balance``, else by measured time
    (see :func:`apps.harness.pipeline.choose_balance`)."""
    if config.balance is not None:
        return list(config.balance)
    micro_batch = max(1, config.batch_size // config.chunks)
    sample = torch.randn(micro_batch, config.in_chans, config.image_size, config.image_size)
    return choose_balance(lambda: build_model(config, device="meta"), sample,
                          config.num_stages, seed=config.seed, device=device,
                          max_parameters=PROFILE_MAX_PARAMETERS)


def amoebanet_pipeline(config: AmoebaNetConfig, run: Run, balance: list[int],
                       checkpoint: Any = None) -> tuple[gp.DistributedGPipe, int]:
    """The model built on meta, each rank materializing only its own stage; its parameter
    count. Micro-batch BatchNorm keeps mini-batch running statistics. ``checkpoint``: the
    re-materialization planned for a memory budget (default: the config's)."""
    model = build_model(config, device="meta")
    num_params = sum(p.numel() for p in model.parameters())
    train_loss = build_train_loss(config)
    soft = soft_targets(config)  # mixup/cutmix: [B, classes] float targets

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        # evaluation passes integer labels even when training mixes them into soft targets
        if soft and not targets.is_floating_point():
            return F.cross_entropy(logits.float(), targets)
        return train_loss(logits.float(), targets)

    pipe = gp.DistributedGPipe(
        model,
        balance,
        chunks=config.chunks,
        checkpoint=config.checkpoint if checkpoint is None else checkpoint,
        schedule=config.schedule,
        loss_fn=loss_fn,
        group=run.pipeline_group,
        data_parallel_group=run.data_group if run.num_replicas > 1 else None,
        device=run.device,
        seed=config.seed,
        deferred_batch_norm=True,  # per-micro-batch statistics, mini-batch running statistics
        quiet_io=config.quiet_io,
        precision=config.precision,
    )
    return pipe, num_params


def steps_per_epoch(config: AmoebaNetConfig, train_images: int, num_replicas: int) -> int:
    """Optimizer steps per pass over the training split (a ConfigError if not even one)."""
    steps = train_images // (config.batch_size * num_replicas)
    if steps < 1:
        raise ConfigError(
            f"split {config.train_split!r} has {train_images} images, fewer than one step "
            f"(batch_size={config.batch_size} x {num_replicas} replica(s)); lower batch_size"
        )
    return steps


def optimization(config: AmoebaNetConfig, pipe: gp.DistributedGPipe, state: dict[str, Any],
                 updates_per_epoch: int) -> tuple[torch.optim.Optimizer, RunLength]:
    """timm's optimizer over this stage's parameters, and the run's length (apps/budget.py):
    given, fitted to budget_minutes after the first steps (all inside warm-up, which does not
    depend on it), or epochs; the learning-rate schedule spans it (:func:`make_scheduler`).

    Per-parameter optimizers (AdamW, RMSProp, SGD) on each stage's parameters equal one
    optimizer over the whole model; weight decay skips biases and BatchNorm as timm does."""
    from timm.optim import create_optimizer_v2

    optimizer = create_optimizer_v2(pipe, **optimizer_kwargs(config))
    length = RunLength(train_steps=config.train_steps, budget_minutes=config.budget_minutes,
                       cap=config.epochs * updates_per_epoch, cap_name=f"epochs={config.epochs}",
                       warmup_steps=config.warmup_epochs * updates_per_epoch,
                       step=state.get("step", 0), saved_steps=state.get("train_steps", 0),
                       goal_steps=config.goal_steps, stop_at_step=config.stop_at_step)
    return optimizer, length


def make_scheduler(config: AmoebaNetConfig, optimizer: torch.optim.Optimizer,
                   updates_per_epoch: int, train_steps: int) -> Any:
    """timm's learning-rate schedule over ``train_steps`` updates."""
    from timm.scheduler import create_scheduler_v2

    scheduler, _ = create_scheduler_v2(
        optimizer, **scheduler_kwargs(config, updates_per_epoch, train_steps))
    return scheduler


def train_step(pipe: gp.DistributedGPipe, run: Run, optimizer: torch.optim.Optimizer,
               batch: Batch | None, target_like: Tensor, *, step: int) -> float:
    """One optimizer step on the first stage's ``batch`` (None elsewhere): its targets sent to
    the last stage, forward + backward through the pipeline, the loss averaged over replicas."""
    with gp.collectives(f"targets of step {step + 1}"):
        targets = run.broadcast_from_first_stage(batch[1] if batch is not None else None,
                                                 target_like)
    optimizer.zero_grad(set_to_none=True)
    loss = pipe.step(batch[0] if batch is not None else None,
                     targets if pipe.is_last else None)
    if run.num_replicas > 1:
        with gp.collectives(f"loss of step {step + 1}"):
            dist.all_reduce(loss, group=run.data_group)
        loss /= run.num_replicas
    optimizer.step()
    return float(loss)


class Evaluation:
    """Top-1 / top-5 on a split through the training pipeline (``evaluate_pipeline``), timed so
    that the clock can keep time for the final one (:meth:`reserve_s`)."""

    def __init__(self, pipe: gp.DistributedGPipe, config: AmoebaNetConfig, run: Run,
                 classes: list[str]) -> None:
        self.pipe, self.config, self.run = pipe, config, run
        self.classes = classes
        self.images = num_images(config, config.eval_split)
        self.seconds_per_image: float | None = None

    def __call__(self, split: str, step: int) -> dict[str, Any]:
        begin = time.monotonic()
        with gp.collectives(f"evaluation on {split} at step {step}"):
            metrics = evaluate_pipeline(self.pipe, self.config, self.run, split)
        self.seconds_per_image = (time.monotonic() - begin) / max(metrics.images, 1)
        return metrics.report(self.classes, split=split)

    def reserve_s(self, images_per_second: float) -> float:
        """Seconds to keep for the final checkpoint and evaluation."""
        per_image = self.seconds_per_image
        if per_image is None:  # forward only: assume 3x the training throughput
            per_image = 1.0 / max(3.0 * images_per_second, 1e-3)
        return 1.25 * self.images * per_image + 60.0  # + start-up, checkpoint, wandb, exit


def describe(config: AmoebaNetConfig, run: Run, balance: list[int], num_params: int, *,
             train_images: int, updates_per_epoch: int, checkpoint: Any) -> str:
    """The run's first line: the model, its pipeline (the re-materialization it runs: the
    config's, or the budget's choice) and the data."""
    return (f"AmoebaNet-{config.genotype}({config.num_normal_cells}, {config.filters}): "
            f"{num_params:,} parameters, {sum(balance)} layers; {config.num_stages} "
            f"stages, balance {balance}, {config.chunks} micro-batches, schedule "
            f"{config.schedule}, checkpoint {checkpoint}, {run.num_replicas} replica(s), "
            f"{run.world_size} rank(s) on {run.device.type}; {config.dataset}: "
            f"{train_images:,} train images, {updates_per_epoch} steps per epoch of "
            f"{config.batch_size * run.num_replicas}")


def log_progress(loop: TrainingLoop, *, step: int, lr: float, updates_per_epoch: int,
                 train_seconds: float) -> None:
    """Every ``log_every`` steps: the window's loss and speed to wandb and rank 0's bar."""
    images_per_second = loop.window.per_second()
    loop.log_window(step, {
        "train/loss": loop.window.mean_loss, "train/lr": lr,
        "train/images_per_second": images_per_second,
        "train/epoch": step / updates_per_epoch, "train/minutes": train_seconds / 60,
    }, loss=f"{loop.window.mean_loss:.3f}", img_s=f"{images_per_second:.0f}", lr=f"{lr:.2e}",
        epoch=f"{step / updates_per_epoch:.2f}")


def epoch_evaluation(loop: TrainingLoop, evaluation: Evaluation, config: AmoebaNetConfig, *,
                     step: int, epoch: int) -> None:
    """At an epoch's end (checkpointed): top-1 / top-5 every ``eval_every_epochs``, above rank
    0's bar and to wandb; not after the run's last step (the final evaluation follows the
    loop)."""
    if loop.step_end(step, checkpoint_due=True, eval_due=every(epoch, config.eval_every_epochs)):
        report = evaluation(config.eval_split, step)
        if loop.run.master:
            loop.bar.write(f"epoch {epoch}: {config.eval_split} top-1 "
                           f"{100 * report['top1']:.2f}% top-5 {100 * report['top5']:.2f}% "
                           f"loss {report['loss']:.4f}")
        loop.logger.metrics({f"{config.eval_split}/{key}": report[key]
                             for key in ("top1", "top5", "loss")}, step)
    loop.window.restart_clock()  # the images/s window excludes checkpoint and eval


def report_training(config: AmoebaNetConfig, run: Run, *, step: int, updates_per_epoch: int,
                    images_seen: int, train_seconds: float, stop_reason: str,
                    length: RunLength, path: Path) -> None:
    """Rank 0's lines after the loop: what was trained, and a note if ``stop_at_step`` ended
    this invocation before the run's end."""
    if note := length.early_stop_note(step, stop_reason):
        run.say(note)
    run.say(f"trained {step} steps ({step / updates_per_epoch:.2f} epochs, {images_seen:,} "
            f"images) in {train_seconds / 60:.1f} min, "
            f"{images_seen / max(train_seconds, 1e-9):.0f} images/s; stopped by "
            f"{stop_reason or f'epochs={config.epochs}'}; checkpoint {path}")


def summarize(config: AmoebaNetConfig, report: dict[str, Any], *, step: int,
              updates_per_epoch: int, images_seen: int, train_seconds: float, started: float,
              stop_reason: str, length: RunLength, balance: list[int], num_params: int,
              path: Path) -> dict[str, Any]:
    """Rank 0's summary.json."""
    return {
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


def final_evaluation(loop: TrainingLoop, evaluation: Evaluation, config: AmoebaNetConfig,
                     **counters: Any) -> dict[str, Any] | None:
    """Top-1 / top-5 of the final checkpoint through the pipeline; on rank 0
    ``eval_<split>.json`` + ``.png``, the result printed and to wandb, and the summary (from
    :func:`summarize` of ``counters``), None on the other ranks."""
    step = counters["step"]
    report = evaluation(config.eval_split, step)
    if not loop.run.master:
        return None
    with guarded_write(config.out_dir, Path(config.out_dir) / f"eval_{config.eval_split}.json"):
        write_report(report, Path(config.out_dir) / f"eval_{config.eval_split}")
    summary = summarize(config, report, **counters)
    loop.logger.metrics({f"{config.eval_split}/final_top1": report["top1"],
                         f"{config.eval_split}/final_top5": report["top5"]}, step)
    loop.run.say(f"{config.eval_split} top-1: {100 * report['top1']:.2f}%  top-5: "
                 f"{100 * report['top5']:.2f}%  ({report['images']:,} images; "
                 f"total wall time {summary['total_minutes']} min)")
    return summary


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Train; returns rank 0's summary (final top-1/top-5 included), None on other ranks."""
    started = time.monotonic()

    # --- config and run (config errors stop every rank before any process group exists) ---
    config = load_train_config(sys.argv[1:] if argv is None else argv)
    check_dataset(config)
    # with memory_budget_mb, a budget nothing fits is refused here, before any process group
    plan_for_budget(amoebanet_app_model(config), config, config.balance)
    # one thread per rank: the stages are the parallelism on CPU
    run = start_run(config, device="auto", num_threads=1)
    images_per_step = config.batch_size * run.num_replicas

    # --- data: Fashion-MNIST prepared once by rank 0; the others wait ---------------------
    on_rank0(lambda: prepare_fashion_mnist(config), what="preparing Fashion-MNIST")
    check_dataset(config)
    classes = class_names(config)
    train_images = num_images(config, config.train_split)
    updates_per_epoch = steps_per_epoch(config, train_images, run.num_replicas)

    # --- resume (the balance and counters), model, optimizer and schedule (timm) ------------
    resume_dir, state = find_resume(config, run, load_config=load_amoebanet_config,
                                    train_command=TRAIN_COMMAND.format(out_dir=config.out_dir),
                                    may_change=RESUMABLE_CHANGES)
    # with memory_budget_mb, gp.plan chooses the re-materialization (per-stage kept layers
    # included) and, unless the config or the checkpoint fixes it, the balance
    fixed = list(state["balance"]) if state else config.balance
    best = plan_for_budget(amoebanet_app_model(config), config, fixed, measure_on=run.device,
                           max_parameters=PROFILE_MAX_PARAMETERS)
    if best is not None:
        run.say(describe_budget_plan(best, config.memory_budget_mb))
        balance = list(best.balance)
    else:
        balance = list(state["balance"]) if state else amoebanet_balance(config, run.device)
    pipe, num_params = amoebanet_pipeline(config, run, balance,
                                          best.checkpoint if best is not None else None)
    optimizer, length = optimization(config, pipe, state, updates_per_epoch)
    scheduler = make_scheduler(config, optimizer, updates_per_epoch, length.steps)
    run.say(describe(config, run, balance, num_params, train_images=train_images,
                     updates_per_epoch=updates_per_epoch, checkpoint=pipe.checkpoint))
    step, epoch, batch_in_epoch, images_seen, train_seconds = 0, 0, 0, 0, 0.0
    if resume_dir is not None:  # weights, optimizer, scheduler, data position, RNGs
        restore(pipe, optimizer, resume_dir, state)
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        images_seen, train_seconds = state["images_seen"], state["train_seconds"]
        set_rng_states(state["rng"])
        run.say(f"resumed from {resume_dir} at step {step} (epoch {epoch}, batch "
                f"{batch_in_epoch})")

    def checkpoint_state(step: int) -> tuple[dict[str, Any], dict[str, str]]:
        """This rank's scheduler, data position, counters and RNGs, and run.json (rank 0's)."""
        state = {"scheduler": scheduler.state_dict(), "epoch": epoch,
                 "batch_in_epoch": batch_in_epoch, "images_seen": images_seen,
                 "train_seconds": train_seconds, "rng": rng_states()}
        run_json = json.dumps({
            "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "balance": balance, "num_stages": config.num_stages, "world_size": run.world_size,
            "classes": classes, "parameters": num_params,
        }, indent=1) + "\n"
        return state, {"run.json": run_json}

    evaluation = Evaluation(pipe, config, run, classes)
    loop = TrainingLoop(config, run, pipe, optimizer=optimizer, balance=balance, length=length,
                        step=step, started=started, checkpoint_state=checkpoint_state)

    # --- training loop ----------------------------------------------------------------------
    bar = loop.progress_bar(total=length.bar_total, initial=step)
    stop_reason = ""
    target_like = targets_like(config)
    while epoch < config.epochs and not stop_reason:
        epoch_first_step = step
        batches = None
        if pipe.is_first:
            batches = train_batches(config, epoch, skip=batch_in_epoch, replica=run.replica,
                                    num_replicas=run.num_replicas)
        while True:
            # stop: the run's length or stop_at_step, as rank 0 decides
            tick = time.monotonic()  # training time counts loading, not checkpoints or evals
            choice = loop.budget(step, reserve_s=lambda per_step: evaluation.reserve_s(
                images_per_step / per_step))
            if choice is not None:  # the run's length is fixed; the schedule spans it
                scheduler = make_scheduler(config, optimizer, updates_per_epoch,
                                           choice.train_steps)
                loop.announce(choice.explain(f" ({choice.train_steps / updates_per_epoch:.2f} "
                                             "epochs)"), total=length.bar_total)
            batch = next(batches, None) if batches is not None else None
            if run.master:
                stop_reason = length.stop(step)
            # the epoch ends for everyone as soon as one replica's shards run dry; a signal on
            # any rank stops every rank at this step, with a checkpoint
            vote = loop.vote(step, stop=bool(stop_reason),
                             data_ended=pipe.is_first and batch is None)
            if vote == STOP:
                stop_reason = stop_reason or "stopped by rank 0"
                break
            if vote == DATA_ENDED:
                epoch, batch_in_epoch = epoch + 1, 0
                break

            # learning rate: timm's schedule is a function of the update count
            scheduler.step_update(num_updates=step)
            lr = optimizer.param_groups[0]["lr"]

            # forward + backward through the pipeline; the targets travel first -> last stage
            loss_value = train_step(pipe, run, optimizer, batch, target_like, step=step)
            step += 1
            batch_in_epoch += 1
            images_seen += images_per_step
            train_seconds += time.monotonic() - tick

            # log: every step to log.jsonl; every log_every steps the bar and wandb
            # divergence: a non-finite loss, or one beyond max_loss_factor x ln(num_classes)
            check_loss(loss_value, step=step, num_classes=config.num_classes,
                       factor=config.max_loss_factor,
                       fix=f"lower lr={config.lr} or raise warmup_epochs={config.warmup_epochs}")
            loop.window.add(loss_value, images_per_step)
            loop.logger.step({"step": step, "epoch": epoch, "loss": loss_value, "lr": lr})
            bar.update(1)
            if every(step, config.log_every):
                log_progress(loop, step=step, lr=lr, updates_per_epoch=updates_per_epoch,
                             train_seconds=train_seconds)

            # checkpoint every ckpt_every steps as well as at epoch ends
            loop.step_end(step, checkpoint_due=every(step, config.ckpt_every), eval_due=False)

        # end of an epoch: checkpoint, and evaluate every eval_every_epochs
        if batch_in_epoch == 0 and not stop_reason and step != epoch_first_step:
            epoch_evaluation(loop, evaluation, config, step=step, epoch=epoch)

    # --- final checkpoint and evaluation through the pipeline -----------------------------
    path = loop.finish(step)
    counters = dict(step=step, updates_per_epoch=updates_per_epoch, images_seen=images_seen,
                    train_seconds=train_seconds, stop_reason=stop_reason, length=length,
                    path=path)
    report_training(config, run, **counters)
    return loop.close(final_evaluation(loop, evaluation, config, started=started,
                                       balance=balance, num_params=num_params, **counters))


if __name__ == "__main__":
    run_main(main, command=TRAIN_COMMAND.format(out_dir="runs/amoebanet"),
             errors=(DatasetNotFoundError, CorruptShardError))
