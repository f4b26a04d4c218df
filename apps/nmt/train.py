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
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import gpipe_core as gp
from apps.budget import RunLength
from apps.config import ConfigError, save_config
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
from apps.nmt.config import NMTConfig, build_model, load_nmt_config, replace
from apps.nmt.data import Batch, CorpusError, TrainBatches, load_manifest, load_tokenizer
from apps.nmt.evaluate import (
    TRAIN_COMMAND,
    evaluate,
    format_report,
    mean_token_loss,
    write_report,
)
from apps.nmt.model import activation_stats, token_cross_entropy_sum
from apps.nmt.monitor import gather_stability
from apps.nmt.pipelined_search import pipeline_search

# Config keys a resumed run may change (apps.harness.checkpoints.check_resumable): budgets, logging,
# evaluation, runtime, and the schedule and re-materialization mode (the library gives the same
# step for any of them); every other key (model, tokens, data stream, partitioning,
# optimisation, seed) must match the checkpoint's.
RESUMABLE_CHANGES = frozenset({
    "train_steps", "budget_minutes",  # the length the checkpoint records is the one resumed
    "max_steps", "max_train_tokens", "max_minutes", "out_dir", "log_every", "eval_every",
    "ckpt_every", "wandb_project", "wandb_mode", "beam_size", "length_penalty", "max_decode_len",
    "eval_max_sentences", "eval_batch_tokens", "bucket_thresholds", "device", "bf16",
    "num_threads", "resume", "timeout_s", "max_loss_factor", "pin_cpus", "hold_memory",
    "quiet_io", "schedule", "checkpoint", "packages", "unk_id", "bos_id", "eos_id",
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

    A corpus prepared there with other settings (languages, packages, vocabulary) is an error
    rather than silently rebuilt: another run may be using it. ``packages: none`` uses the
    corpus found in ``data_dir`` as it is (e.g. one prepared from your own TSV files).
    """
    from data.gettext_m2en.prepare import PrepareError, prepare, resolve_packages

    if config.packages == "none":
        load_manifest(config.data_dir)  # a CorpusError naming the prepare command if missing
        return
    languages = sorted(config.languages) if config.languages else None
    manifest_path = Path(config.data_dir) / "manifest.json"
    if manifest_path.exists():
        built = json.loads(manifest_path.read_text()).get("config", {})
        wanted = {
            "packages": list(resolve_packages(config.packages)),
            "languages": languages,
            "vocab_size": config.vocab_size,
        }
        differ = {k: (built.get(k), v) for k, v in wanted.items() if built.get(k) != v}
        if differ:
            raise ConfigError(
                f"the corpus in data_dir={config.data_dir} was prepared with other settings "
                f"(prepared, wanted): {differ}; pass --data_dir=<another directory> (or delete "
                f"{config.data_dir} to rebuild it)"
            )
    try:
        prepare(
            config.data_dir,
            packages=config.packages,
            languages=languages,
            vocab_size=config.vocab_size,
            seed=config.seed,
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
# they took ~60 s where a step took 0.305 s, ~200 steps; both scale with the machine's speed.
FINAL_EVAL_STEPS = 200
FINAL_EVAL_SENTENCES = 14 * 300


def final_reserve_s(config: NMTConfig, seconds_per_step: float) -> float:
    """Seconds to keep, after the last step, for the final checkpoint and dev evaluation: the
    default's measured cost in steps, scaled by the dev sentences, with a quarter to spare and
    half a minute for start-up and exit."""
    sentences = config.eval_max_sentences * max(1, len(config.languages or []) or 14)
    steps = FINAL_EVAL_STEPS * sentences / FINAL_EVAL_SENTENCES
    return 1.25 * steps * seconds_per_step + 30.0


def budget_reached(config: NMTConfig, step: int, tokens_seen: int,
                   length: RunLength) -> str | None:
    """Which training budget ends the run now: its length in steps (``length``: given, fitted
    to the time, or ``max_steps``) or ``max_train_tokens`` (the hard stop ``max_minutes`` is
    checked by the loop)."""
    if step >= length.steps:
        return length.stop_reason
    if config.max_train_tokens and tokens_seen >= config.max_train_tokens:
        return "max_train_tokens"
    return None


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Train; returns rank 0's summary (final dev BLEU report included), None on other ranks."""
    started = time.monotonic()

    # --- config ---------------------------------------------------------------------------
    config = load_nmt_config(sys.argv[1:] if argv is None else argv)
    check_out_dir(Path(config.out_dir))  # every rank, before any process group: one line
    # every collective fails within timeout_s (naming the rank that hangs); the long waits, for
    # rank 0 to prepare the corpus or for replica 0 to evaluate, are on the store (on_rank0)
    run = setup_run(num_stages=config.num_stages, device=config.device,
                    num_threads=config.num_threads, timeout_s=config.timeout_s,
                    pin_cpus=config.pin_cpus, hold_memory=config.hold_memory)
    rank, world_size, device = run.rank, run.world_size, run.device
    num_replicas, replica, master, say = run.num_replicas, run.replica, run.master, run.say
    use_cuda = device.type == "cuda"
    out_dir = Path(config.out_dir)

    # one run per out_dir at a time: rank 0 holds its lock until it exits
    on_rank0(lambda: lock_out_dir(out_dir), what="locking out_dir")

    # --- data: corpus (built once, by rank 0), tokenizer, training stream -----------------
    on_rank0(lambda: prepare_corpus(config), what="preparing the corpus")
    tokenizer = load_tokenizer(config.data_dir)
    manifest = load_manifest(config.data_dir)
    if tokenizer.vocab_size != config.vocab_size:
        # vocab_size is a soft limit for prepare on a small corpus: size the model to the real one
        say(f"tokenizer has {tokenizer.vocab_size} pieces (asked {config.vocab_size}); using it")
        config = replace(config, vocab_size=tokenizer.vocab_size)
    special = {k: manifest[k] for k in ("pad_id", "unk_id", "bos_id", "eos_id")}
    if special != {k: getattr(config, k) for k in special}:
        raise ConfigError(f"config special ids differ from the tokenizer's {special}; set them so")
    batches = TrainBatches(
        config.data_dir,
        max_tokens=config.max_tokens,
        temperature=config.sampling_temperature,
        seed=config.seed,
        languages=config.languages or None,
        max_len=config.max_len,
    )

    # --- resume: which checkpoint (its balance fixes the partitioning) ---------------------
    resume_dir, state = None, {}
    if config.resume:
        # the newest checkpoint whose files all verify (an older one, with a warning, if the
        # newest is damaged)
        resume_dir = resume_checkpoint(out_dir, train_command=f"{TRAIN_COMMAND} --out_dir={out_dir}",
                                       verbose=master)
        saved_config = load_nmt_config([f"--config={resume_dir / 'config.yaml'}"])
        check_resumable(saved_config, config, may_change=RESUMABLE_CHANGES, checkpoint=resume_dir)
        state = load_train_state(resume_dir, rank, world_size)

    # --- model: built on meta, each rank materialises only its own stage ------------------
    model = build_model(config, device="meta")
    if "balance" in state:
        balance = list(state["balance"])
    elif config.resume or config.balance is not None:  # checkpoints before balance was saved
        balance = list(config.balance or gp.balance_by_params(model, config.num_stages))
    else:
        balance = nmt_balance(config, device)
    pad_id, smoothing, z_loss = config.pad_id, config.label_smoothing, config.z_loss

    def loss_fn(logits: Tensor, target_ids: Tensor) -> Tensor:
        return token_cross_entropy_sum(logits, target_ids, pad_id=pad_id, label_smoothing=smoothing,
                                       z_loss=z_loss)

    pipe = gp.DistributedGPipe(
        model,
        balance,
        chunks=config.chunks,
        checkpoint=config.checkpoint,
        schedule=config.schedule,
        loss_fn=loss_fn,
        loss_reduction="sum",  # divided by the step's target-token count (normalizer)
        group=run.pipeline_group,
        data_parallel_group=run.data_group if num_replicas > 1 else None,
        device=device,
        seed=config.seed,
        quiet_io=config.quiet_io,
    )  # its timeout is the pipeline group's: config.timeout_s, given to setup_run
    optimizer = make_optimizer(config, list(pipe.parameters()))
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda and config.bf16 else nullcontext()
    )
    num_params = sum(p.numel() for p in model.parameters())
    say(
        f"T({config.num_layers}, {config.ffn_dim}, {config.num_heads}) d={config.d_model} "
        f"vocab={config.vocab_size}: {num_params / 1e6:.2f}M parameters; {config.num_stages} "
        f"stages, balance {balance}, {config.chunks} micro-batches, schedule {config.schedule}, "
        f"checkpoint {config.checkpoint}, {num_replicas} replica(s), {world_size} rank(s) on "
        f"{device.type}; languages {' '.join(batches.languages)}"
    )

    # --- resume: weights, optimizer, data stream, step counters ---------------------------
    step, tokens_seen, train_seconds = 0, 0, 0.0
    if resume_dir is not None:
        pipe.load_checkpoint(resume_dir)
        optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["data"])
        step, tokens_seen, train_seconds = state["step"], state["tokens"], state["train_seconds"]
        pipe.steps_done = state["pipe_steps"]  # seeds dropout: must continue, not restart
        say(f"resumed from {resume_dir} at step {step}")
    else:
        refuse_existing_run(out_dir)
    # the run's length (apps/budget.py): given, fitted to budget_minutes after the first steps
    # (inside warm-up, which does not depend on it), or max_steps; a linear schedule spans it
    length = RunLength(
        train_steps=config.train_steps, budget_minutes=config.budget_minutes,
        cap=config.max_steps, cap_name="max_steps", step=step,
        warmup_steps=config.warmup_steps if config.lr_schedule == "linear" else math.inf,
        saved_steps=state.get("train_steps", 0))
    with gp.collectives("start of training"):
        dist.barrier()
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, out_dir / "config.yaml")
    logger = RunLogger(config, out_dir, resume_step=step, enabled=master)

    def save(step: int) -> Path:
        """Checkpoint: shards, per-rank state, config and tokenizer (collective)."""
        state = {
            "optimizer": optimizer.state_dict(),
            "data": batches.state_dict(),
            "step": step,
            "tokens": tokens_seen,
            "train_seconds": train_seconds,
            "pipe_steps": pipe.steps_done,
            "train_steps": length.recorded_steps,
            "world_size": world_size,
            "balance": balance,
        }
        tokenizer_json = json.dumps({
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "data_dir": str(config.data_dir),
        }) + "\n"
        # the checkpoint's config records the run's length once it is known
        saved_config = replace(config, train_steps=state["train_steps"])
        return write_checkpoint(out_dir, step, pipe, state, saved_config, rank=rank,
                                files={"tokenizer.json": tokenizer_json})

    def run_eval(*, what: str, dev_loss: bool = False) -> dict[str, Any] | None:
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
                              max_per_lang=config.eval_max_sentences, device=device,
                              search=search, score_here=master)
            if dev_loss:  # collective over the pipeline, so on every rank of it
                loss = mean_token_loss(pipe, config, split="dev",
                                       max_per_lang=config.eval_max_sentences)
                if report is not None:
                    report["dev_loss"] = loss
            result["report"] = report

        with gp.collectives(what):  # every rank enters: replica 0 evaluates, the others wait
            on_rank0(work, what=what, workers=range(config.num_stages))
        return result.get("report")

    # --- training loop --------------------------------------------------------------------
    from tqdm import tqdm

    # the bar counts towards the budget that ends the run: tokens when a token budget is set
    by_tokens = bool(config.max_train_tokens)
    if master and length.decided:
        say(length.choice.explain())  # type: ignore[union-attr]
    bar = tqdm(total=config.max_train_tokens if by_tokens else length.steps,
               initial=tokens_seen if by_tokens else step, unit="tok" if by_tokens else "step",
               unit_scale=by_tokens, disable=not master, dynamic_ncols=True, file=sys.stderr,
               mininterval=2.0)
    window_loss, window_steps, window_tokens, window_start = 0.0, 0, 0, time.monotonic()
    loop_start = time.monotonic() - train_seconds
    last_saved = step if config.resume else -1
    # from here SIGINT / SIGTERM checkpoint at a step all ranks agree on, then exit
    interrupt = Interrupt()
    stop = torch.zeros(2, dtype=torch.int64, device=device)  # NCCL reduces device tensors
    stopped_by = None
    while True:
        # stop: at the step or token budget, or (a safety) at max_minutes, as rank 0 decides;
        # or at a signal on any rank (all ranks stop at the same step)
        length.tick(step)
        if length.due(step):  # fix the run's length (a collective); the lr schedule spans it
            choice = length.decide(step=step, elapsed_s=time.monotonic() - started,
                                   reserve_s=lambda per_step: final_reserve_s(config, per_step),
                                   master=master, device=device)
            if master:
                if not by_tokens:
                    bar.total = choice.train_steps
                bar.write(choice.explain())
                bar.refresh()
        if master:
            stopped_by = budget_reached(config, step, tokens_seen, length)
            if stopped_by is None and config.max_minutes and (
                time.monotonic() - loop_start > 60 * config.max_minutes
            ):
                stopped_by = "max_minutes"
            stop[0] = int(stopped_by is not None)
        stop[1] = int(interrupt.requested)
        with gp.collectives(f"stop decision before step {step + 1}"):
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop[1]:
            path = save(step) if last_saved != step else checkpoint_dir(out_dir, step)
            logger.close()
            raise interrupt.stop(step=step, checkpoint=path, master=master)
        if stop[0]:
            break

        # learning rate: a pure function of the step, so resuming needs no scheduler state
        lr = learning_rate(config, step, length.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # batch: R batches per step from the shared stream; replica r trains on the r-th
        step_batches = [next(batches) for _ in range(num_replicas)]
        batch = step_batches[replica]
        counts = [count_tokens(b, pad_id) for b in step_batches]
        target_tokens = sum(t for _, t in counts)
        tokens_seen += sum(s + t for s, t in counts)

        # forward + backward through the pipeline; loss = mean over the step's target tokens
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = pipe.step(
                (batch.src, batch.tgt_in) if pipe.is_first else None,
                batch.tgt_out if pipe.is_last else None,
                normalizer=loss_normalizer(target_tokens, num_replicas),
            )
        if num_replicas > 1:
            with gp.collectives(f"loss of step {step + 1}"):
                dist.all_reduce(loss, group=run.data_group)
        grad_norm = pipe.clip_grad_norm_(config.clip_norm) if config.clip_norm > 0 else None
        optimizer.step()
        step += 1
        train_seconds = time.monotonic() - loop_start

        # log: every step to log.jsonl (loss, gradient norm, activations, logits, clipping);
        # every log_every steps the bar and wandb
        loss_value = float(loss)
        stats = step_stats(pipe, config.num_stages, device)  # collective, every rank, every step
        record: dict[str, Any] = {"step": step, "loss": loss_value, "lr": lr,
                                  "tokens": tokens_seen}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        record.update(stats)
        record["clip_engaged"] = bool(config.clip_logits and stats["clipped_fraction"] > 0)
        # attention logits per layer, log Z, z-loss share (apps.nmt.monitor; collective)
        record.update(gather_stability(pipe, num_layers=config.num_layers, device=device,
                                       z_loss=config.z_loss, record_attention=config.record_attention))
        logger.step(record)
        # divergence: a non-finite loss, or one beyond max_loss_factor x ln(vocab_size)
        check_loss(loss_value, step=step, num_classes=config.vocab_size,
                   factor=config.max_loss_factor,
                   fix=f"lower lr={config.lr} or raise warmup_steps")
        window_loss += loss_value
        window_steps += 1
        window_tokens += sum(s + t for s, t in counts)
        bar.update(sum(s + t for s, t in counts) if by_tokens else 1)
        if step % config.log_every == 0:
            elapsed = time.monotonic() - window_start
            metrics = {
                "train/loss": window_loss / window_steps,
                "train/lr": lr,
                "train/tokens_per_second": window_tokens / max(elapsed, 1e-9),
                "train/tokens": tokens_seen,
                "train/minutes": train_seconds / 60,
                **({"train/grad_norm": float(grad_norm)} if grad_norm is not None else {}),
                **{f"activations/{k}": v for k, v in stats.items()},
            }
            logger.metrics(metrics, step)
            bar.set_postfix(
                loss=f"{metrics['train/loss']:.3f}",
                tok_s=f"{metrics['train/tokens_per_second']:.0f}",
                lr=f"{lr:.2e}",
                logit=f"{stats.get('max_abs_logit', float('nan')):.1f}",
                min=f"{train_seconds / 60:.1f}",
                refresh=False,
            )
            window_loss, window_steps, window_tokens, window_start = 0.0, 0, 0, time.monotonic()

        # checkpoint and evaluate (periodic; the final ones follow the loop)
        due_eval = bool(config.eval_every) and step % config.eval_every == 0
        if due_eval or (config.ckpt_every and step % config.ckpt_every == 0):
            path = save(step)
            last_saved = step
        if due_eval and step < length.steps:  # the final evaluation follows the loop
            report = run_eval(what=f"dev evaluation at step {step}")
            if report is not None:
                lines = format_report(report, examples=0).splitlines()
                bar.write(f"step {step} dev BLEU:\n" + "\n".join(lines[1:5]))
                logger.metrics(
                    {f"dev/bleu_{b}": v["bleu"] for b, v in report["buckets"].items()}, step
                )
    bar.close()

    # --- final checkpoint and dev BLEU per resource bucket ----------------------------------
    path = save(step) if last_saved != step else checkpoint_dir(out_dir, step)
    train_minutes = train_seconds / 60
    if stopped_by == "max_minutes":
        say(f"warning: the hard stop max_minutes={config.max_minutes:g} cut the run at step "
            f"{step}, before its budget ({length.steps} steps, max_train_tokens="
            f"{config.max_train_tokens}): its learning-rate schedule did not end, so its results "
            "are not those of the budgeted run (budget_minutes fits a run to a time instead)")
    say(
        f"trained {step} steps, {tokens_seen / 1e6:.2f}M tokens in {train_minutes:.1f} min "
        f"({tokens_seen / max(train_seconds, 1e-9):.0f} tokens/s, source + target, no padding); "
        f"checkpoint {path}"
    )
    report = run_eval(what="the final dev evaluation", dev_loss=True)
    summary = None
    if master:
        assert report is not None
        dev_loss = report.pop("dev_loss")
        write_report(report, out_dir / "dev_bleu.json")
        say(format_report(report))
        summary = {
            "steps": step,
            "tokens": tokens_seen,
            # what ended the run: a budget (max_steps, max_train_tokens) or the wall-clock
            # safety cap (max_minutes: the run was cut short of its budget)
            "stopped_by": stopped_by,
            # the run's length and how it was chosen (apps/budget.py)
            "budget": length.choice.to_json() if length.choice is not None else None,
            "train_minutes": round(train_minutes, 2),
            "tokens_per_second": round(tokens_seen / max(train_seconds, 1e-9), 1),
            "total_minutes": round((time.monotonic() - started) / 60, 2),
            "checkpoint": str(path),
            "dev_loss": round(dev_loss, 5),  # nats per target token, no label smoothing
            "dev": {b: {"bleu": v["bleu"], "copy_bleu": v["copy_bleu"]}
                    for b, v in report["buckets"].items()},
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        say(f"total wall time {summary['total_minutes']} min")
        logger.metrics({f"dev/final_bleu_{b}": v["bleu"] for b, v in report["buckets"].items()},
                       step)
    logger.close()
    on_rank0(lambda: None, what="the end of the run")  # the others wait for rank 0's report
    interrupt.restore()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    run_main(main, command=f"{TRAIN_COMMAND} [--key=value ...]", errors=(CorpusError,))
