"""Train the many-to-English Transformer with DistributedGPipe under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m apps.nmt.train \
        [--config=apps/nmt/configs/cpu_default.yaml] [--key=value ...] [--resume]

Reads top to bottom: config -> data -> model -> optimizer -> (resume) -> loop -> final BLEU.
The world is ``num_stages`` pipeline ranks times R data-parallel replicas (pipeline-major: ranks
``r*K ... r*K+K-1`` are replica r). Every rank builds the same stream of batches from the same
seed; each optimizer step draws R batches and replica r trains on the r-th, so every rank can
count the target tokens of the whole step (the loss normaliser) without communication.

``out_dir`` holds ``step-NNNNNNN/`` checkpoints (model shards keyed by the original module
names, per-rank optimizer / data-stream / step state, the resolved ``config.yaml`` and the
tokenizer fingerprint), a ``latest`` pointer, ``log.jsonl`` (one line per step) and the final
``dev_bleu.json``. ``--resume`` continues from ``latest`` exactly: the same batches, dropout
masks, learning rates and optimizer moments as a run that never stopped.

Dev evaluation (every ``eval_every`` steps and at the end) runs through the training pipeline
itself (``run_eval``): the ranks of the first replica decode and compute the dev loss, each with
its own stage, and rank 0 scores and reports; evaluating never builds the whole model. (Without
a ``balance``, a model of up to 50M parameters is balanced by timing its layers on a plain copy
on rank 0 before training: ``nmt_balance``; pass ``balance`` where that copy would not fit.)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import gpipe_core as gp
from apps.budget import RunLength
from apps.config import ConfigError
from apps.harness.entry import run_main
from apps.harness.guards import check_loss
from apps.harness.loop import TrainingLoop, every, find_resume, restore, start_run
from apps.harness.pipeline import choose_balance
from apps.harness.rank0 import on_rank0
from apps.harness.run import Run
from apps.harness.writes import guarded_write
from apps.nmt.commands import TRAIN_COMMAND
from apps.nmt.config import NMTConfig, build_model, load_nmt_config, replace
from apps.nmt.data import (
    Batch,
    CorpusError,
    Tokenizer,
    TrainBatches,
    load_manifest,
    load_tokenizer,
)
from apps.nmt.decoding import mean_token_loss
from apps.nmt.model import activation_stats, token_cross_entropy_sum
from apps.nmt.monitor import gather_stability
from apps.nmt.pipelined_search import pipeline_search
from apps.nmt.plan import app_model as nmt_app_model
from apps.nmt.scoring import evaluate, format_report, write_report
from apps.planning import describe_budget_plan, plan_for_budget

# Config keys a resumed run may change (apps.harness.checkpoints.check_resumable): budgets,
# logging, evaluation, runtime, and the schedule and re-materialization mode (the library gives the same
# step for any of them); every other key (model, tokens, data stream, partitioning,
# optimisation, seed) must match the checkpoint's.
RESUMABLE_CHANGES = frozenset({
    "train_steps", "budget_minutes",  # the length the checkpoint records is the one resumed
    "goal_steps", "max_steps", "stop_at_step", "out_dir", "log_every", "eval_every",
    "ckpt_every", "keep_checkpoints", "wandb_project", "wandb_mode", "beam_size",
    "length_penalty", "max_decode_len", "eval_max_sentences", "eval_batch_tokens", "bucket_thresholds", "device", "precision",
    "num_threads", "resume", "timeout_s", "max_loss_factor", "pin_cpus", "hold_memory",
    "quiet_io", "schedule", "checkpoint", "memory_budget_mb", "packages", "unk_id", "bos_id", "eos_id",
    "label_smoothing", "lr", "warmup_steps", "lr_schedule", "adam_beta1", "adam_beta2",
    "clip_norm", "weight_decay",
})

# ---------------------------------------------------------------------------------------------
# Helpers (the loop below reads top to bottom; these keep it short)


def learning_rate(config: NMTConfig, step: int, train_steps: int | None = None) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then a linear decay that reaches
    ``lr / (train_steps - warmup_steps + 1)`` at the run's last step (``linear``; ``train_steps``
    defaults to ``max_steps``), ``lr * sqrt(warmup / step)`` (``inverse_sqrt``) or ``lr``
    (``constant``). ``step`` counts from 0."""
    s = step + 1
    warm = config.warmup_steps
    if config.lr_schedule == "linear":
        total = train_steps or config.max_steps
        if s <= warm:
            return config.lr * s / warm
        return config.lr * max(0, total - s + 1) / (total - warm + 1)
    if config.lr_schedule == "constant":
        return config.lr * min(1.0, s / warm) if warm else config.lr
    if warm == 0:
        return config.lr / math.sqrt(s)
    return config.lr * min(s / warm, math.sqrt(warm / s))


def make_optimizer(config: NMTConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay; plain Adam when it is 0) or torch's Adafactor."""
    if config.optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=1e-9,
        weight_decay=config.weight_decay,
    )


def prepare_corpus(config: NMTConfig) -> None:
    """Build the corpus under ``data_dir`` unless it is there with the config's settings.

    A corpus prepared there with other settings (languages, packages, vocabulary, its seed
    ``corpus_seed``) is an error rather than silently rebuilt: another run may be using it. ``packages: none`` uses the
    corpus found in ``data_dir`` as it is (e.g. one prepared from your own TSV files).
    """
    from data.gettext_m2en.corpus_format import read_manifest
    from data.gettext_m2en.errors import PrepareError
    from data.gettext_m2en.fetch import resolve_packages
    from data.gettext_m2en.prepare import prepare

    if config.packages == "none":
        load_manifest(config.data_dir)  # a CorpusError naming the prepare command if missing
        return
    languages = sorted(config.languages) if config.languages else None
    manifest = read_manifest(config.data_dir)
    if manifest is not None:
        built = manifest.get("config", {})
        wanted = {
            "packages": list(resolve_packages(config.packages)),
            "languages": languages,
            "vocab_size": config.vocab_size,
            "seed": config.corpus_seed,
        }
        differ = {k: (built.get(k), v) for k, v in wanted.items() if built.get(k) != v}
        if differ:
            raise ConfigError(
                f"the corpus in data_dir={config.data_dir} was prepared with other settings "
                f"(prepared, wanted): {differ}; pass --data_dir=<another directory> (or delete "
                f"{config.data_dir} to rebuild it)"
            )
    try:
        prepare(  # under the corpus's lock: runs started together build it once
            config.data_dir,
            packages=config.packages,
            languages=languages,
            vocab_size=config.vocab_size,
            seed=config.corpus_seed,
            num_threads=max(1, os.cpu_count() or 1),
        )
    except PrepareError as error:
        raise SystemExit(f"error: corpus preparation failed: {error}") from error


def count_tokens(batch: Batch, pad_id: int) -> tuple[int, int]:
    """Non-padding (source, target) tokens of a batch; target includes EOS."""
    return int(batch.src.ne(pad_id).sum()), int(batch.tgt_out.ne(pad_id).sum())


def loss_normalizer(target_tokens: int, num_replicas: int) -> float:
    """What each replica divides its summed loss by, so that the step's loss and gradients are
    the mean over *all* replicas' target tokens: DistributedGPipe averages data-parallel
    gradients over the R replicas, so each divides by (all target tokens) / R."""
    return target_tokens / num_replicas


def step_stats(pipe: gp.DistributedGPipe, num_stages: int, device: torch.device) -> dict[str, float]:
    """The step's largest |activation| per stage, largest |logit| (before clipping) and the
    fraction of logits beyond the clip bound, on every rank (one all-reduce over the world: the
    largest value over data-parallel replicas). Stages that recorded nothing read 0."""
    local = activation_stats(pipe)
    values = torch.zeros(num_stages + 2, dtype=torch.float64)
    acts = [v for k, v in local.items() if k.endswith("max_abs_activation")]
    values[pipe.stage_index] = max(acts, default=0.0)
    values[num_stages] = max((v for k, v in local.items() if k.endswith("max_abs_logit")), default=0.0)
    values[num_stages + 1] = max(
        (v for k, v in local.items() if k.endswith("clipped_fraction")), default=0.0
    )
    values = values.to(device)
    with gp.collectives("activation statistics"):
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    stats = {f"stage{i}_max_abs_activation": float(values[i]) for i in range(num_stages)}
    stats["max_abs_logit"] = float(values[num_stages])
    stats["clipped_fraction"] = float(values[num_stages + 1])
    return stats


# Models up to this size are balanced by the measured time of each layer on rank 0 (a plain copy
# is built once, for a second); larger ones by parameters.
PROFILE_MAX_PARAMETERS = 50_000_000
BALANCE_SAMPLE_LENGTH = 20  # tokens per sentence of the timing sample: UI strings are short


def nmt_balance(config: NMTConfig, device: torch.device) -> list[int]:
    """Layers per stage by the measured time of one micro-batch through each layer (see
    :func:`apps.harness.pipeline.choose_balance`): by parameters the embedding (many parameters, little
    compute) and the output projection (few layers' parameters, a vocabulary-wide matmul per
    token) land on the wrong sides of the cut."""
    length = min(BALANCE_SAMPLE_LENGTH, config.max_len)
    rows = max(1, config.max_tokens // config.chunks // length)
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(4, config.vocab_size, (2, rows, length), generator=generator)
    return choose_balance(lambda: build_model(config, device="meta"), (ids[0], ids[1]),
                          config.num_stages, seed=config.seed, device=device,
                          max_parameters=PROFILE_MAX_PARAMETERS)


# The final evaluation (beam-4 dev BLEU and dev loss over eval_max_sentences per language) and
# checkpoint in units of training steps: on the CPU default (14 languages, 300 sentences each)
# they took 25 s where a step took 0.64-0.84 s (3+3 layers, 2,048 tokens: 30-40 steps) and 45 s
# where it took 1.48 s (30 steps; defaults_*_small.json); both scale with the machine's speed.
# (Until 2026-12: 200 steps, measured on the 6+6 default, whose steps were shorter against its
# decoding.)
FINAL_EVAL_STEPS = 50
FINAL_EVAL_SENTENCES = 14 * 300


def final_reserve_s(config: NMTConfig, seconds_per_step: float) -> float:
    """Seconds to keep, after the last step, for the final checkpoint and dev evaluation: the
    default's measured cost in steps, scaled by the dev sentences, with a quarter to spare and
    half a minute for start-up and exit."""
    sentences = config.eval_max_sentences * max(1, len(config.languages or []) or 14)
    steps = FINAL_EVAL_STEPS * sentences / FINAL_EVAL_SENTENCES
    return 1.25 * steps * seconds_per_step + 30.0


def run_length(config: NMTConfig, state: dict[str, Any], step: int) -> RunLength:
    """The run's length (apps/budget.py): given, fitted to budget_minutes after the first steps
    (inside warm-up, which does not depend on it), or max_steps; a linear schedule spans it.
    ``stop_at_step`` ends this invocation earlier, the length unchanged."""
    return RunLength(
        train_steps=config.train_steps, budget_minutes=config.budget_minutes,
        cap=config.max_steps, cap_name="max_steps", step=step,
        warmup_steps=config.warmup_steps if config.lr_schedule == "linear" else math.inf,
        saved_steps=state.get("train_steps", 0), goal_steps=config.goal_steps,
        stop_at_step=config.stop_at_step)


# ---------------------------------------------------------------------------------------------
# Pieces of main: the pipeline, evaluation through it, a step's record, the summary


def nmt_data(config: NMTConfig, run: Run) -> tuple[NMTConfig, Tokenizer, TrainBatches]:
    """The corpus (prepared once, by rank 0), its tokenizer and the training stream; the config
    sized to the tokenizer's vocabulary (a soft limit for prepare on a small corpus)."""
    on_rank0(lambda: prepare_corpus(config), what="preparing the corpus")
    tokenizer = load_tokenizer(config.data_dir)
    manifest = load_manifest(config.data_dir)
    if tokenizer.vocab_size != config.vocab_size:
        run.say(f"tokenizer has {tokenizer.vocab_size} pieces (asked {config.vocab_size}); "
                "using it")
        config = replace(config, vocab_size=tokenizer.vocab_size)
    special = {k: manifest[k] for k in ("pad_id", "unk_id", "bos_id", "eos_id")}
    if special != {k: getattr(config, k) for k in special}:
        raise ConfigError(f"config special ids differ from the tokenizer's {special}; set them so")
    batches = TrainBatches(config.data_dir, max_tokens=config.max_tokens,
                           temperature=config.sampling_temperature, seed=config.seed,
                           languages=config.languages or None, max_len=config.max_len)
    return config, tokenizer, batches


def nmt_pipeline(config: NMTConfig, run: Run, state: dict[str, Any]
                 ) -> tuple[gp.DistributedGPipe, list[int], int]:
    """The model built on meta, each rank materialising only its own stage; its balance (the
    checkpoint's when resuming) and its parameter count. With ``memory_budget_mb``, gp.plan
    chooses the re-materialization (per-stage kept layers included) and, unless the config or
    the checkpoint fixes it, the balance."""
    model = build_model(config, device="meta")
    checkpoint: Any = config.checkpoint
    fixed = list(state["balance"]) if "balance" in state else config.balance
    best = plan_for_budget(nmt_app_model(config), config, fixed, measure_on=run.device,
                           max_parameters=PROFILE_MAX_PARAMETERS)
    if best is not None:
        balance, checkpoint = list(best.balance), best.checkpoint
        run.say(describe_budget_plan(best, config.memory_budget_mb))
    elif "balance" in state:
        balance = list(state["balance"])
    elif config.resume or config.balance is not None:  # checkpoints before balance was saved
        balance = list(config.balance or gp.balance_by_params(model, config.num_stages))
    else:
        balance = nmt_balance(config, run.device)
    pad_id, smoothing, z_loss = config.pad_id, config.label_smoothing, config.z_loss

    def loss_fn(logits: Tensor, target_ids: Tensor) -> Tensor:
        return token_cross_entropy_sum(logits, target_ids, pad_id=pad_id, label_smoothing=smoothing,
                                       z_loss=z_loss)

    pipe = gp.DistributedGPipe(
        model,
        balance,
        chunks=config.chunks,
        checkpoint=checkpoint,
        schedule=config.schedule,
        loss_fn=loss_fn,
        loss_reduction="sum",  # divided by the step's target-token count (normalizer)
        group=run.pipeline_group,
        data_parallel_group=run.data_group if run.num_replicas > 1 else None,
        device=run.device,
        seed=config.seed,
        quiet_io=config.quiet_io,
        precision=config.precision,
    )  # its timeout is the pipeline group's: config.timeout_s, given to setup_run
    return pipe, balance, sum(p.numel() for p in model.parameters())


def run_eval(pipe: gp.DistributedGPipe, config: NMTConfig, tokenizer: Any, run: Run, *,
             what: str, dev_loss: bool = False) -> dict[str, Any] | None:
    """Dev BLEU (and with ``dev_loss`` the dev loss per target token, as ``"dev_loss"``) of
    the weights just checkpointed, through the training pipeline itself; the report on
    rank 0, None on the other ranks.

    Every rank of replica 0's pipeline decodes with its own stage
    (``apps.nmt.pipelined_search``: the hypotheses are the plain model's, token for token)
    and runs its stage's forward of the dev loss (``pipe.evaluate``); rank 0 scores with
    sacrebleu and reports. No rank builds more than its own stage. With R > 1 replicas
    the other replicas wait (on the store: an evaluation takes minutes, longer than
    timeout_s); sharing the sentences among replicas would divide the time by R.
    """
    result: dict[str, Any] = {}

    def work() -> None:
        search = pipeline_search(pipe, config, beam_size=config.beam_size,
                                 alpha=config.length_penalty)
        report = evaluate(None, config, tokenizer, split="dev",
                          max_per_lang=config.eval_max_sentences, device=run.device,
                          search=search, score_here=run.master)
        if dev_loss:  # collective over the pipeline, so on every rank of it
            loss = mean_token_loss(pipe, config, split="dev",
                                   max_per_lang=config.eval_max_sentences)
            if report is not None:
                report["dev_loss"] = loss
        result["report"] = report

    with gp.collectives(what):  # every rank enters: replica 0 evaluates, the others wait
        on_rank0(work, what=what, workers=range(config.num_stages))
    return result.get("report")


def describe(config: NMTConfig, run: Run, balance: list[int], num_params: int,
             languages: Sequence[str], *, checkpoint: Any) -> str:
    """The run's first line: the model, its pipeline (the re-materialization it runs: the
    config's, or the budget's choice) and the languages."""
    return (f"T({config.num_layers}, {config.ffn_dim}, {config.num_heads}) d={config.d_model} "
            f"vocab={config.vocab_size}: {num_params / 1e6:.2f}M parameters; {config.num_stages} "
            f"stages, balance {balance}, {config.chunks} micro-batches, schedule "
            f"{config.schedule}, checkpoint {checkpoint}, {run.num_replicas} replica(s), "
            f"{run.world_size} rank(s) on {run.device.type}; languages {' '.join(languages)}")


def tokenizer_file(config: NMTConfig, tokenizer: Tokenizer) -> str:
    """``tokenizer.json`` of every checkpoint (rank 0's file): the fingerprint evaluation and
    translation check the corpus's tokenizer against."""
    return json.dumps({"fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
                       "data_dir": str(config.data_dir)}) + "\n"


def train_step(pipe: gp.DistributedGPipe, run: Run, optimizer: torch.optim.Optimizer,
               batches: TrainBatches, config: NMTConfig, *, step: int) -> tuple[Tensor, Tensor | None, int]:
    """One optimizer step: R batches from the shared stream, replica r training on the r-th;
    forward + backward through the pipeline, the loss the mean over the step's target tokens
    of every replica. Returns the loss, the gradient norm (None without clipping) and the
    step's tokens (source + target, no padding, every replica's)."""
    step_batches = [next(batches) for _ in range(run.num_replicas)]
    batch = step_batches[run.replica]
    counts = [count_tokens(b, config.pad_id) for b in step_batches]
    optimizer.zero_grad(set_to_none=True)
    loss = pipe.step((batch.src, batch.tgt_in) if pipe.is_first else None,
                     batch.tgt_out if pipe.is_last else None,
                     normalizer=loss_normalizer(sum(t for _, t in counts), run.num_replicas))
    if run.num_replicas > 1:
        with gp.collectives(f"loss of step {step + 1}"):
            dist.all_reduce(loss, group=run.data_group)
    grad_norm = pipe.clip_grad_norm_(config.clip_norm) if config.clip_norm > 0 else None
    optimizer.step()
    return loss, grad_norm, sum(s + t for s, t in counts)


def step_record(pipe: gp.DistributedGPipe, config: NMTConfig, device: torch.device, *,
                step: int, loss: float, lr: float, tokens: int,
                grad_norm: Tensor | None) -> tuple[dict[str, Any], dict[str, float]]:
    """The step's line of log.jsonl (loss, gradient norm, activations, logits, clipping,
    attention logits per layer, log Z, z-loss share) and its activation statistics; both
    collectives, on every rank, every step."""
    stats = step_stats(pipe, config.num_stages, device)
    record: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "tokens": tokens}
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    record.update(stats)
    record["clip_engaged"] = bool(config.clip_logits and stats["clipped_fraction"] > 0)
    record.update(gather_stability(pipe, num_layers=config.num_layers, device=device,
                                   z_loss=config.z_loss, record_attention=config.record_attention))
    return record, stats


def log_progress(loop: TrainingLoop, *, step: int, lr: float, tokens_seen: int,
                 train_seconds: float, grad_norm: Tensor | None,
                 stats: dict[str, float]) -> None:
    """Every ``log_every`` steps: the window's loss and speed to wandb and rank 0's bar."""
    metrics = {
        "train/loss": loop.window.mean_loss, "train/lr": lr,
        "train/tokens_per_second": loop.window.per_second(), "train/tokens": tokens_seen,
        "train/minutes": train_seconds / 60,
        **({"train/grad_norm": float(grad_norm)} if grad_norm is not None else {}),
        **{f"activations/{k}": v for k, v in stats.items()},
    }
    loop.log_window(step, metrics, loss=f"{metrics['train/loss']:.3f}",
                    tok_s=f"{metrics['train/tokens_per_second']:.0f}", lr=f"{lr:.2e}",
                    logit=f"{stats.get('max_abs_logit', float('nan')):.1f}",
                    min=f"{train_seconds / 60:.1f}")


def periodic_eval(loop: TrainingLoop, pipe: gp.DistributedGPipe, config: NMTConfig,
                  tokenizer: Tokenizer, run: Run, step: int) -> None:
    """Dev BLEU every ``eval_every`` steps: per bucket above rank 0's bar, and to wandb."""
    report = run_eval(pipe, config, tokenizer, run, what=f"dev evaluation at step {step}")
    if report is not None:
        lines = format_report(report, examples=0).splitlines()
        loop.bar.write(f"step {step} dev BLEU:\n" + "\n".join(lines[1:5]))
        loop.logger.metrics(
            {f"dev/bleu_{b}": v["bleu"] for b, v in report["buckets"].items()}, step)


def report_training(config: NMTConfig, run: Run, *, step: int, tokens_seen: int,
                    train_seconds: float, stopped_by: str | None, length: RunLength,
                    path: Path) -> None:
    """Rank 0's lines after the loop: what was trained, and a note if ``stop_at_step`` ended
    this invocation before the run's end."""
    if note := length.early_stop_note(step, stopped_by):
        run.say(note)
    run.say(f"trained {step} steps, {tokens_seen / 1e6:.2f}M tokens in {train_seconds / 60:.1f} "
            f"min ({tokens_seen / max(train_seconds, 1e-9):.0f} tokens/s, source + target, no "
            f"padding); checkpoint {path}")


def summarize(report: dict[str, Any], *, step: int, tokens_seen: int, train_seconds: float,
              started: float, stopped_by: str | None, length: RunLength,
              path: Path) -> dict[str, Any]:
    """Rank 0's summary.json, from the final dev report (its ``dev_loss`` taken out)."""
    dev_loss = report.pop("dev_loss")
    return {
        "steps": step,
        "tokens": tokens_seen,
        # what ended the run: its length (train_steps=N, or max_steps), or stop_at_step=N
        # (this invocation stopped before the run's end; --resume continues)
        "stopped_by": stopped_by,
        # the run's length and how it was chosen (apps/budget.py)
        "budget": length.choice.to_json() if length.choice is not None else None,
        "train_minutes": round(train_seconds / 60, 2),
        "tokens_per_second": round(tokens_seen / max(train_seconds, 1e-9), 1),
        "total_minutes": round((time.monotonic() - started) / 60, 2),
        "checkpoint": str(path),
        "dev_loss": round(dev_loss, 5),  # nats per target token, no label smoothing
        "dev": {b: {"bleu": v["bleu"], "copy_bleu": v["copy_bleu"]}
                for b, v in report["buckets"].items()},
    }


def final_evaluation(loop: TrainingLoop, pipe: gp.DistributedGPipe, config: NMTConfig,
                     tokenizer: Tokenizer, run: Run, **counters: Any) -> dict[str, Any] | None:
    """Dev BLEU per resource bucket and the dev loss of the final checkpoint, through the
    pipeline; on rank 0 ``dev_bleu.json``, the report printed and to wandb, and the summary
    (from :func:`summarize` of ``counters``), None on the other ranks."""
    report = run_eval(pipe, config, tokenizer, run, what="the final dev evaluation",
                      dev_loss=True)
    if not run.master:
        return None
    assert report is not None
    summary = summarize(report, **counters)
    with guarded_write(config.out_dir, Path(config.out_dir) / "dev_bleu.json"):
        write_report(report, Path(config.out_dir) / "dev_bleu.json")
    run.say(format_report(report))
    run.say(f"total wall time {summary['total_minutes']} min")
    loop.logger.metrics({f"dev/final_bleu_{b}": v["bleu"]
                         for b, v in report["buckets"].items()}, counters["step"])
    return summary


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Train; returns rank 0's summary (final dev BLEU report included), None on other ranks."""
    started = time.monotonic()

    # --- config and run: out_dir checked and locked, process groups ------------------------
    config = load_nmt_config(sys.argv[1:] if argv is None else argv)
    plan_for_budget(nmt_app_model(config), config, config.balance)  # a budget nothing fits: refused
    run = start_run(config, device=config.device, num_threads=config.num_threads)

    # --- data: corpus (built once, by rank 0), tokenizer, training stream -----------------
    config, tokenizer, batches = nmt_data(config, run)

    # --- resume (its balance fixes the partitioning), model, optimizer -----------------------
    resume_dir, state = find_resume(
        config, run, load_config=load_nmt_config, may_change=RESUMABLE_CHANGES,
        train_command=f"{TRAIN_COMMAND} --out_dir={Path(config.out_dir)}")
    pipe, balance, num_params = nmt_pipeline(config, run, state)
    optimizer = make_optimizer(config, list(pipe.parameters()))
    run.say(describe(config, run, balance, num_params, batches.languages,
                     checkpoint=pipe.checkpoint))
    step, tokens_seen, train_seconds = 0, 0, 0.0
    if resume_dir is not None:  # weights, optimizer, data stream, step counters
        restore(pipe, optimizer, resume_dir, state)
        batches.load_state_dict(state["data"])
        step, tokens_seen, train_seconds = state["step"], state["tokens"], state["train_seconds"]
        run.say(f"resumed from {resume_dir} at step {step}")
    length = run_length(config, state, step)

    def checkpoint_state(step: int) -> tuple[dict[str, Any], dict[str, str]]:
        """This rank's data stream and counters, and the tokenizer's fingerprint (rank 0's)."""
        state = {"data": batches.state_dict(), "tokens": tokens_seen,
                 "train_seconds": train_seconds}
        return state, {"tokenizer.json": tokenizer_file(config, tokenizer)}

    loop = TrainingLoop(config, run, pipe, optimizer=optimizer, balance=balance, length=length,
                        step=step, started=started, checkpoint_state=checkpoint_state)
    # --- training loop: the bar counts the steps of this invocation ---------------------------
    bar = loop.progress_bar(total=length.bar_total, initial=step, unit="step")
    loop_start = time.monotonic() - train_seconds
    stopped_by = None
    while True:
        # stop: at the run's length or stop_at_step, as rank 0 decides; or at a signal on any
        # rank (all ranks stop at the same step)
        choice = loop.budget(step, reserve_s=lambda per_step: final_reserve_s(config, per_step))
        if choice is not None:  # the run's length is fixed; the lr schedule spans it
            loop.announce(choice.explain(), total=length.bar_total)
        if run.master:
            stopped_by = length.stop(step) or None
        if loop.vote(step, stop=stopped_by is not None):
            break

        # learning rate: a pure function of the step, so resuming needs no scheduler state
        lr = learning_rate(config, step, length.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # forward + backward through the pipeline on this replica's batch of the step's R
        loss, grad_norm, step_tokens = train_step(pipe, run, optimizer, batches, config,
                                                  step=step)
        tokens_seen += step_tokens
        step += 1
        train_seconds = time.monotonic() - loop_start

        # log: every step to log.jsonl; every log_every steps the bar and wandb
        loss_value = float(loss)
        record, stats = step_record(pipe, config, run.device, step=step, loss=loss_value, lr=lr,
                                    tokens=tokens_seen, grad_norm=grad_norm)
        loop.logger.step(record)
        # divergence: a non-finite loss, or one beyond max_loss_factor x ln(vocab_size)
        check_loss(loss_value, step=step, num_classes=config.vocab_size,
                   factor=config.max_loss_factor,
                   fix=f"lower lr={config.lr} or raise warmup_steps")
        loop.window.add(loss_value, step_tokens)
        bar.update(1)
        if every(step, config.log_every):
            log_progress(loop, step=step, lr=lr, tokens_seen=tokens_seen,
                         train_seconds=train_seconds, grad_norm=grad_norm, stats=stats)

        # checkpoint and evaluate (periodic; the final ones follow the loop)
        if loop.step_end(step, checkpoint_due=every(step, config.ckpt_every),
                         eval_due=every(step, config.eval_every)):
            periodic_eval(loop, pipe, config, tokenizer, run, step)

    # --- final checkpoint and dev BLEU per resource bucket ----------------------------------
    path = loop.finish(step)
    counters = dict(step=step, tokens_seen=tokens_seen, train_seconds=train_seconds,
                    stopped_by=stopped_by, length=length, path=path)
    report_training(config, run, **counters)
    return loop.close(final_evaluation(loop, pipe, config, tokenizer, run, started=started,
                                       **counters))


if __name__ == "__main__":
    run_main(main, command=f"{TRAIN_COMMAND} [--key=value ...]", errors=(CorpusError,))
