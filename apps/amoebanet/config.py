"""The AmoebaNet app's config: one dataclass of commented defaults, YAML and --key=value on top."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from apps.amoebanet.model import build_amoebanet, cell_layout, check_image_size
from apps.budget import RETIRED_LENGTH_KEYS
from apps.config import ConfigError, load_config, parse_overrides
from apps.harness.checkpoints import KEEP_CHECKPOINTS
from apps.harness.pipeline import check_pipeline_options
from apps.validation import check_balance, check_text, check_timeout

CONFIG_DIR = Path(__file__).parent / "configs"
# `make train-amoebanet` with no arguments uses this one (CPU, Fashion-MNIST, 2 stages).
DEFAULT_CONFIG = CONFIG_DIR / "cpu_fashion_mnist.yaml"


@dataclass
class AmoebaNetConfig:
    """Everything one AmoebaNet run needs; defaults are a small CPU model on Fashion-MNIST."""

    # refused with what replaces them (apps.config); the run's length is train_steps, or
    # budget_minutes, or epochs (apps/budget.py)
    RETIRED: ClassVar[dict[str, str]] = {
        **RETIRED_LENGTH_KEYS,
        "max_steps": ("to stop this invocation after N steps with the schedule unchanged (then "
                      "--resume), give --stop_at_step=N; to make the run itself N steps long, "
                      "its schedule with it, give --train_steps=N"),
    }

    # --- model -------------------------------------------------------------------------------
    genotype: str = "D"  # "D" (AmoebaNet-D, as in Table 1) or "B" (the 84.4% ImageNet model)
    num_normal_cells: int = 6  # L: normal cells; reduction cells come after L/3 and 2L/3
    filters: int = 32  # D: first normal cells' filters (stem cells D/4, D/2; x2 per reduction)
    num_classes: int = 10  # classifier outputs; must match the dataset's classes
    in_chans: int = 1  # image channels: 1 for Fashion-MNIST (grayscale), 3 for ImageNet
    image_size: int = 28  # side of the square input after the transforms (224 in the paper)
    stem_stride: int = 1  # 2 as in the paper; 1 keeps resolution for tiny images like 28x28
    drop_path: float = 0.0  # drop-path probability at the last cell (grows linearly with depth)
    dropout: float = 0.0  # dropout before the classifier's linear layer

    # --- data --------------------------------------------------------------------------------
    dataset: str = "fashion_mnist"  # "fashion_mnist" | "imagenet" | "shards" (all read shards)
    data_dir: str = ".cache/fashion_mnist"  # folder with <split>-NNNNNN.tar and dataset.json
    train_split: str = "train"  # split trained on
    eval_split: str = "test"  # split evaluated on ("val" holds out 5,000 train images)
    batch_size: int = 128  # mini-batch (split into `chunks` micro-batches by the pipeline)
    eval_batch_size: int = 256  # batch for evaluation (no gradients, so larger is fine)
    num_workers: int = 1  # DataLoader worker processes decoding images (0 = in the main process)
    shuffle_buffer: int = 5000  # samples held for shuffling (shards are shuffled too)
    skip_corrupt_shards: bool = False  # true: warn and skip a corrupt shard; false: stop naming it
    # augmentation (timm's create_transform); defaults suit 28x28: light crops and flips only
    crop_scale_min: float = 0.85  # RandomResizedCrop lower area bound (timm default 0.08)
    hflip: float = 0.5  # horizontal flip probability
    color_jitter: float = 0.0  # brightness/contrast jitter (0 = off)
    auto_augment: str | None = None  # timm auto-augment policy, e.g. "rand-m9-mstd0.5"; None = off
    crop_pct: float = 1.0  # eval: resize to image_size / crop_pct, center-crop image_size
    mean: tuple[float, ...] = (0.2860,)  # per-channel normalisation (Fashion-MNIST train stats)
    std: tuple[float, ...] = (0.3530,)
    mixup: float = 0.0  # mixup alpha (0 = off); needs an even batch_size
    cutmix: float = 0.0  # cutmix alpha (0 = off)
    label_smoothing: float = 0.1  # as in AmoebaNet's reference training

    # --- pipeline ----------------------------------------------------------------------------
    num_stages: int = 2  # K: pipeline stages (torchrun ranks of the pipeline group)
    chunks: int = 4  # M: micro-batches per mini-batch
    schedule: str = "gpipe"  # any name gpipe_core runs: "gpipe" (fill-drain), "1f1b", "1f1b_slackN"
    checkpoint: str = "except_last"  # re-materialization: "always" | "except_last" | "never"
    # "fp32"; "bf16": autocast to bfloat16 on every stage (CPU or GPU; step times measured in
    # docs/RESULTS.md#mixed-precision); "fp16": autocast to float16 with dynamic loss scaling
    precision: str = "fp32"
    balance: tuple[int, ...] | None = None  # layers per stage; None = by measured time (by parameters above 50M)
    # per-rank memory budget in MiB (parameters, gradients, optimizer state, kept activations, as
    # gp.plan counts them); with one, gp.plan chooses checkpoint (per-stage kept layers
    # included) and the balance (unless given) to fit; 0 = none
    memory_budget_mb: float = 0.0
    timeout_s: float = 300.0  # a rank that does not answer for this long (in a step or any collective) fails the run, named

    # --- CPU knobs (gpipe_core.cpu; measured in docs/RESULTS.md) -----------------------------
    pin_cpus: bool = False  # pin each local rank to its own share of the cores (gp.bind_cpus)
    hold_memory: bool = True  # keep freed blocks mapped, fewer page faults (gp.hold_freed_memory)
    quiet_io: bool = True  # keep gloo's I/O thread from preempting our sends/receives (library default)

    # --- optimisation --------------------------------------------------------------------------
    optimizer: str = "adamw"  # timm create_optimizer_v2 name: "rmsproptf" (AmoebaNet), "sgd", ...
    lr: float = 2e-3  # peak learning rate
    weight_decay: float = 0.05  # 4e-5 with rmsproptf in the paper
    momentum: float = 0.9  # rmsproptf / sgd momentum
    opt_eps: float = 1e-8  # optimizer epsilon (1.0 for rmsproptf as in AmoebaNet)
    rmsprop_decay: float = 0.9  # rmsproptf decay (alpha)
    scheduler: str = "cosine"  # timm create_scheduler_v2 name: "cosine", "step", "plateau", ...
    warmup_epochs: float = 0.2  # linear warmup from warmup_lr
    warmup_lr: float = 1e-5  # learning rate at the start of warmup
    min_lr: float = 1e-5  # floor of the schedule
    decay_epochs: float = 2.4  # "step" scheduler: epochs between decays (exponential decay)
    decay_rate: float = 0.97  # "step" scheduler: factor per decay
    epochs: int = 6  # the most passes over the training split (the lr schedule's length unless a budget or train_steps makes it shorter)
    # the run's length in optimizer steps, and so the lr schedule's: 0 = fitted to budget_minutes
    # from the speed of the first steps (apps/budget.py), or epochs x steps per epoch without one
    train_steps: int = 0
    # the steps at which this config's quality goal (README) was measured to hold; a machine
    # that affords fewer is told so when the budget is fixed (apps/budget.py); 0 = no goal stated
    goal_steps: int = 0
    budget_minutes: float = 0.0  # the whole run's time (data, training, final evaluation) that train_steps is fitted to; 0 = none
    max_loss_factor: float = 1000.0  # stop as diverged when the loss exceeds this many times ln(num_classes), a uniform guess's loss (0 = never)
    seed: int = 0  # seeds data order, augmentation and initialisation

    # --- logging and checkpoints -------------------------------------------------------------
    out_dir: str = "runs/amoebanet"  # checkpoints, resolved config, logs
    log_every: int = 20  # steps between log lines / wandb points
    eval_every_epochs: int = 1  # evaluate on eval_split every this many epochs
    ckpt_every: int = 0  # steps between checkpoints besides those at epoch ends (0 = epoch ends only)
    keep_checkpoints: int = KEEP_CHECKPOINTS  # step folders kept in out_dir, the newest; 0 = all
    wandb_mode: str = "offline"  # "offline" | "online" (needs WANDB_API_KEY) | "disabled"
    wandb_project: str = "gpipe-amoebanet"  # wandb project name

    # --- run options (of one invocation; a resumed run may change them) ----------------------
    resume: bool = False  # continue from out_dir's latest checkpoint, exactly
    # stop this invocation after this step (checkpoint and final evaluation), the length and
    # the schedule unchanged; --resume continues (0 = at the run's end)
    stop_at_step: int = 0


GENOTYPE_CHOICES = ("D", "B")
DATASET_CHOICES = ("fashion_mnist", "imagenet", "shards")
WANDB_MODES = ("offline", "online", "disabled")


def validate(config: AmoebaNetConfig) -> AmoebaNetConfig:
    """Check values that the dataclass types cannot; raise ConfigError naming the fix."""
    choices = {
        "genotype": (config.genotype.upper(), GENOTYPE_CHOICES),
        "dataset": (config.dataset, DATASET_CHOICES),
        "wandb_mode": (config.wandb_mode, WANDB_MODES),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    check_optimizer(config.optimizer)
    positive = ("num_normal_cells", "filters", "num_classes", "in_chans", "image_size",
                "stem_stride", "batch_size", "eval_batch_size", "num_stages", "chunks", "epochs",
                "log_every", "timeout_s")
    for key in positive:
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key}={getattr(config, key)} must be positive")
    for key in ("num_workers", "eval_every_epochs", "ckpt_every", "keep_checkpoints",
                "max_loss_factor", "color_jitter", "mixup", "cutmix", "weight_decay",
                "warmup_epochs", "warmup_lr", "min_lr", "train_steps", "budget_minutes",
                "goal_steps", "stop_at_step", "memory_budget_mb"):
        if getattr(config, key) < 0:
            raise ConfigError(f"{key}={getattr(config, key)} must be >= 0")
    if len(config.mean) != config.in_chans or len(config.std) != config.in_chans:
        raise ConfigError(
            f"mean={config.mean} and std={config.std} need one value per channel "
            f"(in_chans={config.in_chans}); give {config.in_chans} value(s) to each, e.g. "
            f"--mean={','.join(['0.5'] * config.in_chans)}"
        )
    for key in ("seed", "shuffle_buffer"):
        if getattr(config, key) < 0:
            raise ConfigError(f"{key}={getattr(config, key)} must be >= 0")
    check_timeout(config.timeout_s)
    check_text(config)
    for key in ("lr", "opt_eps", "decay_epochs", "decay_rate"):
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key}={getattr(config, key)} must be positive")
    for key in ("drop_path", "dropout", "label_smoothing", "momentum", "rmsprop_decay"):
        if not 0.0 <= getattr(config, key) < 1.0:
            raise ConfigError(f"{key}={getattr(config, key)} must be in [0, 1)")
    for key in ("hflip", "crop_scale_min", "crop_pct"):
        value = getattr(config, key)
        if not (0.0 <= value <= 1.0 if key == "hflip" else 0.0 < value <= 1.0):
            raise ConfigError(f"{key}={value} must be in {'[0, 1]' if key == 'hflip' else '(0, 1]'}")
    if min(config.std) <= 0:
        raise ConfigError(f"std={config.std} must be positive (images are divided by it)")
    if (config.mixup > 0 or config.cutmix > 0) and config.batch_size % 2:
        raise ConfigError(f"mixup/cutmix need an even batch_size, got {config.batch_size}")
    if config.batch_size % config.chunks and config.num_stages > 1:
        raise ConfigError(
            f"batch_size={config.batch_size} is not divisible by chunks={config.chunks}; "
            f"micro-batches would be uneven"
        )
    check_pipeline_options(schedule=config.schedule, checkpoint=config.checkpoint,
                           num_stages=config.num_stages, chunks=config.chunks,
                           precision=config.precision)
    layers = num_model_layers(config)
    if config.num_stages > layers:
        raise ConfigError(
            f"num_stages={config.num_stages} exceeds the model's {layers} layers (stem, "
            f"{layers - 2} cells, classifier); use fewer stages or more num_normal_cells"
        )
    check_balance(config.balance, num_stages=config.num_stages, num_layers=layers,
                  layers=f"stem + {layers - 2} cells + classifier")
    try:
        check_image_size(config.image_size, config.image_size, config.stem_stride)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return config


def check_optimizer(name: str) -> None:
    """ConfigError unless timm's ``create_optimizer_v2`` knows ``name`` (a ``lookahead_``
    prefix allowed): before any process group, not at the optimizer's creation on each rank."""
    from timm.optim import list_optimizers

    known = list_optimizers()
    if name.lower().split("_")[-1] not in known:
        raise ConfigError(
            f"optimizer={name!r} is not one of timm's optimizers; use one of "
            f"{' '.join(known)} (timm.optim.list_optimizers())"
        )


def num_model_layers(config: AmoebaNetConfig) -> int:
    """Length of the model's nn.Sequential: the stem, the cells and the classifier."""
    return 2 + len(cell_layout(config.num_normal_cells))


def load_amoebanet_config(argv: Sequence[str] = ()) -> AmoebaNetConfig:
    """Resolve defaults < ``--config=file.yaml`` < ``--key=value``; validated."""
    return validate(load_config(AmoebaNetConfig, argv))


def load_train_config(argv: Sequence[str]) -> AmoebaNetConfig:
    """The train script's config: ``--config`` defaults to ``DEFAULT_CONFIG``, and a bare name
    (``--config=tiny_test``) means ``configs/tiny_test.yaml``; validated."""
    config_path, overrides = parse_overrides(argv)
    path = Path(config_path) if config_path else DEFAULT_CONFIG
    if not path.is_file() and (CONFIG_DIR / f"{path.name}.yaml").is_file():
        path = CONFIG_DIR / f"{path.name}.yaml"  # --config=tiny_test
    try:
        return load_amoebanet_config([f"--config={path}"]
                                     + [f"--{k}={v}" for k, v in overrides.items()])
    except ConfigError as error:
        raise ConfigError(f"{error}; run options: --resume, --stop_at_step=N") from None


def soft_targets(config: AmoebaNetConfig) -> bool:
    """Whether training targets are ``[B, num_classes]`` floats: mixup or cutmix mixes them."""
    return config.mixup > 0 or config.cutmix > 0


def optimizer_kwargs(config: AmoebaNetConfig) -> dict[str, Any]:
    """Keyword arguments for ``timm.optim.create_optimizer_v2(model, **optimizer_kwargs(c))``."""
    kwargs: dict[str, Any] = {
        "opt": config.optimizer,
        "lr": config.lr,
        "weight_decay": config.weight_decay,
        "eps": config.opt_eps,
    }
    name = config.optimizer.lower()
    if "sgd" in name or "momentum" in name or "rmsprop" in name:
        kwargs["momentum"] = config.momentum
    if "rmsprop" in name:
        kwargs["alpha"] = config.rmsprop_decay  # RMSProp's decay of the squared-gradient average
    return kwargs


def scheduler_kwargs(config: AmoebaNetConfig, updates_per_epoch: int,
                     train_steps: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``timm.scheduler.create_scheduler_v2(optimizer, **...)``.

    The schedule steps per update (``step_update(num_updates)``), so a short CPU run still
    sees a smooth warmup and decay; it spans ``train_steps`` updates (default: ``epochs``).
    """
    return {
        "sched": config.scheduler,
        "num_epochs": (config.epochs if train_steps is None
                       else train_steps / updates_per_epoch),
        "decay_epochs": config.decay_epochs,
        "decay_rate": config.decay_rate,
        "min_lr": config.min_lr,
        "warmup_lr": config.warmup_lr,
        "warmup_epochs": config.warmup_epochs,
        "step_on_epochs": False,
        "updates_per_epoch": updates_per_epoch,
    }


def build_model(config: AmoebaNetConfig, device: torch.device | str | None = None) -> nn.Sequential:
    """The config's AmoebaNet as ``nn.Sequential`` of named cells, built on ``device``.

    ``device="meta"`` allocates nothing (for counting parameters or building per-stage).
    """
    return build_amoebanet(
        device,
        genotype=config.genotype,
        num_normal_cells=config.num_normal_cells,
        filters=config.filters,
        num_classes=config.num_classes,
        in_chans=config.in_chans,
        stem_stride=config.stem_stride,
        drop_path=config.drop_path,
        dropout=config.dropout,
    )
