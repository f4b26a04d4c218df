"""Configuration of the NMT app: one dataclass, YAML overrides, --key=value overrides."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from apps.budget import HOW_LONG, RETIRED_LENGTH_KEYS
from apps.config import ConfigError, load_config, parse_overrides
from apps.harness.checkpoints import KEEP_CHECKPOINTS
from apps.harness.pipeline import check_pipeline_options
from apps.nmt.model import NORMS, transformer
from apps.validation import check_balance, check_text, check_timeout

CONFIG_DIR = Path(__file__).parent / "configs"

OPTIMIZERS = ("adam", "adafactor")
LR_SCHEDULES = ("linear", "inverse_sqrt", "constant")
WANDB_MODES = ("offline", "online", "disabled")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class NMTConfig:
    """Everything a run of ``apps/nmt`` needs; the defaults are the CPU training default."""

    # refused with what replaces them (apps.config): the run's length is train_steps or
    # budget_minutes (apps/budget.py)
    RETIRED: ClassVar[dict[str, str]] = {
        **RETIRED_LENGTH_KEYS,
        "max_train_tokens": (f"{HOW_LONG}; for a token budget give --train_steps=tokens/T, T "
                             "the tokens per step a run's summary.json reports (tokens / steps)"),
    }

    # --- model: T(L, H, A) ---
    num_layers: int = 3  # L: encoder layers, and as many decoder layers (128 layers = L=64)
    ffn_dim: int = 512  # H: feed-forward width
    num_heads: int = 2  # A: attention heads; attention width is num_heads * head_dim
    head_dim: int = 64  # channels per head (64 in the paper, so more heads = wider attention)
    d_model: int = 128  # D: model width (1024 in the paper)
    vocab_size: int = 4000  # shared SentencePiece vocabulary size (64k in the paper)
    dropout: float = 0.1  # residual and embedding dropout
    attention_dropout: float = 0.0  # dropout on attention probabilities
    label_smoothing: float = 0.1  # cross-entropy label smoothing
    scaled_init: bool = True  # paper fix (i): feed-forward init std times (2L)^-1/2
    clip_logits: bool = True  # paper fix (ii): clamp logits to [-logits_abs_max, logits_abs_max]
    logits_abs_max: float = 20.0  # the clamp bound (the paper gives none; Lingvo notes use 20)
    # residual blocks: "pre" (x + f(LayerNorm(x))) or "post" (LayerNorm(x + f(x)), the
    # original Transformer's; no final encoder/decoder LayerNorm)
    norm: str = "pre"
    qk_norm: bool = False  # LayerNorm over each head's queries and keys (a stability comparator)
    z_loss: float = 0.0  # weight w of the z-loss, w * (log Z)^2 per target token; 0 = off
    # log each attention's largest logit q.k/sqrt(head_dim) per step: one extra q.k product
    # per attention in training, so off unless an experiment needs it (cpu_stability.yaml);
    # log Z and the largest |logit| are logged either way
    record_attention: bool = False
    share_embeddings: bool = True  # one embedding table for source and target tokens
    tie_output: bool = False  # output projection reuses the target table (needs num_stages=1)
    max_positions: int = 128  # longest source or target sequence the model accepts

    # --- tokenizer ids (must match the SentencePiece model the data step trains) ---
    pad_id: int = 0  # padding (masked out of attention and loss)
    unk_id: int = 1  # unknown piece
    bos_id: int = 2  # begins every decoder input
    eos_id: int = 3  # ends every target; decoding stops on it

    # --- data ---
    # prepared corpus, tokenizer and shards (git-ignored); one directory per corpus setting
    data_dir: str = ".cache/gettext_m2en_mix"
    # Debian l10n package list: "quick" (3 packages) or "full" (12); "none" trains on the corpus
    # already in data_dir as it is (e.g. prepared from your own TSV files)
    packages: str = "quick"
    # source languages to use (catalog locale names); empty = all. The CPU default trains 14
    # Latin-script languages from 12k pairs (high) to a few hundred (low); cpu_default.yaml
    languages: list[str] = field(default_factory=lambda: [
        "af", "co", "de", "es", "fr", "ga", "hsb", "li", "nap", "nso", "pt", "sq", "sw", "zu"])
    sampling_temperature: float = 5.0  # draw language l with p ~ n_l^(1/T); 1 = proportional
    # the corpus's own seed (the tokenizer's training sample), apart from `seed`: runs of
    # different seeds then share one corpus (same tokenizer, same splits)
    corpus_seed: int = 0
    # resource buckets of the BLEU report: high from the first count of training pairs up, low
    # below the second, medium between; null = terciles of the trained languages (tiny corpora)
    bucket_thresholds: list[int] | None = field(default_factory=lambda: [10_000, 1_000])
    max_tokens: int = 2048  # padded tokens (source + target) per mini-batch
    max_len: int = 48  # drop training pairs with a side longer than this (tokens)

    # --- pipeline ---
    num_stages: int = 2  # K: pipeline stages (ranks under torchrun)
    chunks: int = 4  # M: micro-batches per mini-batch
    schedule: str = "gpipe"  # any name gpipe_core runs: "gpipe" (fill-drain), "1f1b", "1f1b_slackN"
    # re-materialisation: "always", "except_last", "never" (the CPU default has memory to spare
    # and no compute to spare, so it keeps activations; GPU configs use "except_last")
    checkpoint: str = "never"
    balance: list[int] | None = None  # layers per stage; None = by measured time (rank 0)
    # per-rank memory budget in MiB (parameters, gradients, optimizer state, kept activations, as
    # gp.plan counts them); with one, gp.plan chooses checkpoint (per-stage kept layers
    # included) and the balance (unless given) to fit; 0 = none
    memory_budget_mb: float = 0.0

    # --- optimisation ---
    optimizer: str = "adam"  # "adam" or "adafactor"
    lr: float = 3e-3  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 200  # linear warmup steps
    # after warmup: "linear" decay to ~0 at the run's last step (the schedule ends with the run),
    # "inverse_sqrt" decay (no end: a run's length does not change it) or "constant"
    lr_schedule: str = "linear"
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.98  # Adam second-moment decay (0.98 as for Transformers)
    clip_norm: float = 1.0  # global gradient-norm clip; 0 disables
    weight_decay: float = 0.0  # decoupled weight decay
    # the run's length (apps/budget.py): train_steps if given; else, with budget_minutes, fitted
    # to that time from the speed of the first steps; else max_steps
    max_steps: int = 8000  # the most optimizer steps (the length without train_steps or a budget)
    train_steps: int = 0  # the run's length in steps, and the lr schedule's; 0 = as above
    budget_minutes: float = 28.0  # the whole run's time (corpus, training, final BLEU) train_steps is fitted to; 0 = none
    # the steps at which this config's quality goal (README) was measured to hold; a machine
    # that affords fewer is told so when the budget is fixed (apps/budget.py); 0 = no goal stated
    goal_steps: int = 2134  # the default beat copy-the-source in every bucket at 2,134 steps
    # a run option: stop this invocation after this step (checkpoint and final evaluation), the
    # length and schedule unchanged; --resume continues (0 = at the run's end)
    stop_at_step: int = 0
    seed: int = 0  # seeds data order, init and dropout

    # --- runtime ---
    device: str = "cpu"  # "cpu", "cuda", or "auto" (cuda if available, as the GPU configs use)
    # "fp32"; "bf16": autocast to bfloat16 on every stage (CPU or GPU; step times measured in
    # docs/RESULTS.md#mixed-precision); "fp16": autocast to float16 with dynamic loss scaling
    precision: str = "fp32"
    num_threads: int = 1  # torch CPU threads per rank (2 stages x 1 thread = 2 cores)
    # CPU knobs (gpipe_core.cpu; measured in docs/RESULTS.md)
    pin_cpus: bool = False  # pin each local rank to its own share of the cores (gp.bind_cpus)
    hold_memory: bool = True  # keep freed blocks mapped, half the page faults (gp.hold_freed_memory)
    quiet_io: bool = True  # keep gloo's I/O thread from preempting our sends/receives (library default)
    resume: bool = False  # continue from the last checkpoint in out_dir
    timeout_s: float = 300.0  # a rank that does not answer for this long (in a step or any collective) fails the run, named
    max_loss_factor: float = 1000.0  # stop as diverged when the loss exceeds this many times ln(vocab_size), a uniform guess's loss (0 = never)

    # --- logging and checkpoints ---
    out_dir: str = "runs/nmt"  # checkpoints, resolved config, logs
    log_every: int = 20  # steps between log lines / wandb points
    eval_every: int = 0  # steps between dev evaluations; 0 = only at the end
    ckpt_every: int = 500  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = KEEP_CHECKPOINTS  # step folders kept in out_dir, the newest; 0 = all
    wandb_project: str = "gpipe-nmt"  # wandb project name
    wandb_mode: str = "offline"  # "offline" unless you set a key and choose "online"

    # --- evaluation ---
    beam_size: int = 4  # beam width (1 = greedy)
    length_penalty: float = 0.6  # GNMT alpha in ((5 + len) / 6)^alpha; 0 = none
    max_decode_len: int = 64  # most tokens generated per sentence (excluding BOS)
    eval_max_sentences: int = 300  # dev sentences per language in evaluations (also the final)
    # source tokens (padding included) per beam-search batch: decoding keeps the memory's keys
    # and values per beam, eval_batch_tokens x beam_size x num_heads x head_dim x 8 bytes per
    # decoder layer (a pipeline stage, its own layers', for each of the 2 x stages batches it
    # decodes at a time); the scores do not depend on it
    eval_batch_tokens: int = 2048

    @property
    def num_model_layers(self) -> int:
        """Length of the model's nn.Sequential: embed + L encoders + L decoders + project."""
        return 2 * self.num_layers + 2

    def validate(self) -> NMTConfig:
        """Raise ConfigError naming the bad value and the fix; return self when all is well."""
        positive = (
            "num_layers ffn_dim num_heads head_dim d_model vocab_size max_positions max_tokens "
            "max_len num_stages chunks max_steps log_every beam_size max_decode_len num_threads "
            "eval_max_sentences eval_batch_tokens timeout_s"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{name}={value} must be positive")
        non_negative = (
            "warmup_steps clip_norm weight_decay eval_every ckpt_every keep_checkpoints "
            "max_loss_factor length_penalty train_steps budget_minutes goal_steps stop_at_step "
            "memory_budget_mb"
        )
        for name in (*non_negative.split(), "seed", "corpus_seed"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"{name}={value} must be >= 0")
        check_timeout(self.timeout_s)
        check_text(self)
        for name in ("dropout", "attention_dropout", "label_smoothing", "adam_beta1",
                     "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}={value} must be in [0, 1)")
        if self.bucket_thresholds is not None and not (
            len(self.bucket_thresholds) == 2 and self.bucket_thresholds[0] > self.bucket_thresholds[1] > 0
        ):
            raise ConfigError(
                f"bucket_thresholds={self.bucket_thresholds} must be [high, low] training-pair "
                "counts with high > low > 0 (e.g. [10000, 1000]), or null for terciles"
            )
        if self.logits_abs_max <= 0:
            raise ConfigError(
                f"logits_abs_max={self.logits_abs_max} must be > 0; "
                "to turn clipping off set clip_logits=false"
            )
        if self.norm not in NORMS:
            raise ConfigError(f"norm={self.norm!r} is not one of {list(NORMS)}")
        if self.z_loss < 0:
            raise ConfigError(f"z_loss={self.z_loss} must be >= 0 (0 turns the z-loss off)")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be positive")
        if self.sampling_temperature <= 0:
            raise ConfigError(
                f"sampling_temperature={self.sampling_temperature} must be > 0 "
                "(1 samples languages by size, larger flattens towards uniform)"
            )
        check_pipeline_options(schedule=self.schedule, checkpoint=self.checkpoint,
                               num_stages=self.num_stages, chunks=self.chunks,
                               precision=self.precision)
        choices = {
            "optimizer": OPTIMIZERS,
            "lr_schedule": LR_SCHEDULES,
            "wandb_mode": WANDB_MODES,
            "device": DEVICES,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")
        special = {
            "pad_id": self.pad_id,
            "unk_id": self.unk_id,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }
        if len(set(special.values())) != len(special):
            raise ConfigError(f"special token ids must differ, got {special}")
        for name, value in special.items():
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value} must be in [0, vocab_size={self.vocab_size})")
        if self.max_len + 1 > self.max_positions:
            raise ConfigError(
                f"max_len={self.max_len} + 1 (BOS or EOS) exceeds max_positions="
                f"{self.max_positions}; raise max_positions or lower max_len"
            )
        if self.max_decode_len + 1 > self.max_positions:
            raise ConfigError(
                f"max_decode_len={self.max_decode_len} + 1 (BOS) exceeds max_positions="
                f"{self.max_positions}; raise max_positions or lower max_decode_len"
            )
        if self.num_stages > self.num_model_layers:
            raise ConfigError(
                f"num_stages={self.num_stages} exceeds the model's {self.num_model_layers} layers "
                f"(2 * num_layers + 2); use fewer stages or more layers"
            )
        check_balance(self.balance, num_stages=self.num_stages,
                      num_layers=self.num_model_layers, layers="2 * num_layers + 2")
        if self.tie_output and self.num_stages > 1:
            raise ConfigError(
                f"tie_output=true shares one table between the first and last layer, which "
                f"num_stages={self.num_stages} would put on different stages; set tie_output=false "
                f"(share_embeddings=true keeps the paper's parameter count) or num_stages=1"
            )
        return self


def load_nmt_config(argv: Sequence[str] = ()) -> NMTConfig:
    """Defaults < ``--config=path.yaml`` < ``--key=value``; a bare name like ``--config=tiny``
    means ``apps/nmt/configs/tiny.yaml``. The result is validated."""
    path, overrides = parse_overrides(argv)
    if path is not None and not Path(path).exists() and (CONFIG_DIR / f"{path}.yaml").is_file():
        path = str(CONFIG_DIR / f"{path}.yaml")
    args = [f"--{key}={value}" for key, value in overrides.items()]
    return load_config(NMTConfig, args, yaml_path=path).validate()


def model_kwargs(config: NMTConfig) -> dict[str, object]:
    """The config fields ``apps.nmt.model.transformer`` takes, by its keyword names."""
    return dict(
        num_layers=config.num_layers,
        d_model=config.d_model,
        ffn_dim=config.ffn_dim,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        share_embeddings=config.share_embeddings,
        tie_output=config.tie_output,
        scaled_init=config.scaled_init,
        logits_abs_max=config.logits_abs_max if config.clip_logits else None,
        max_positions=config.max_positions,
        pad_id=config.pad_id,
        norm=config.norm,
        qk_norm=config.qk_norm,
        record_attention=config.record_attention,
    )


def build_model(config: NMTConfig, device: torch.device | str | None = None) -> nn.Sequential:
    """The T(L, H, A) model of ``config`` as one ``nn.Sequential``, built directly on ``device``.

    ``device="meta"`` allocates no parameter memory (for counting parameters, or for
    ``DistributedGPipe``, which materialises one partition per rank and then calls each layer's
    ``reset_parameters()``).
    """
    config.validate()
    with torch.device(device if device is not None else "cpu"):
        return transformer(**model_kwargs(config))  # type: ignore[arg-type]


def replace(config: NMTConfig, **changes: object) -> NMTConfig:
    """A validated copy of ``config`` with ``changes`` (for tests and scripts)."""
    return dataclasses.replace(config, **changes).validate()  # type: ignore[arg-type]
