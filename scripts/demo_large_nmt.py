"""Train, checkpoint and BLEU-evaluate an NMT model that no process holds whole, under a budget.

    python scripts/demo_large_nmt.py [--budget-mb 512] [--set key=value ...]   # make demo-large-nmt
    python scripts/demo_large_nmt.py --tiny --data-dir DIR --out /tmp/demo     # seconds, for tests

The model is the NMT app's Transformer at d_model 512, FFN 2048, 8 heads, 6 + 6 layers and a
4k vocabulary (48M parameters): its whole training state (weights, gradients and Adam's two
moments, 16 bytes per parameter: 736 MB) does not fit the budget of Table 1
(``scripts/reproduce_memory.py``: 512 MB per process above its baseline). The script

1. prepares a two-language corpus (fr, de from the quick Debian packages) in this process;
2. runs the real ``apps.nmt.train`` under torchrun on 2 pipeline ranks, the layers split by
   parameters (``gp.balance_by_params`` on the ``meta`` model, so no rank times a whole copy),
   for 10 steps with re-materialization, then the final checkpoint and the dev evaluation,
   which runs through the training pipeline (beam search and the dev loss; BLEU by sacrebleu),
   in its worst case for memory: a strong length penalty makes every sentence decode
   ``max_decode_len`` tokens (see ``DEMO``);
3. measures, in fresh one-process runs of the same model, what holding it whole costs: loading
   the checkpoint into the plain model (what evaluation on one rank did before), and one
   training step of the plain model with Adam;
4. writes ``docs/reproduction/large_nmt_demo.json``.

Memory is counted as ``scripts/reproduce_memory.py`` counts it: a process's peak resident size
(``VmHWM``) above its resident size just before the run (``VmRSS`` after the imports and a
warm-up training step of a tiny model, with ``malloc_trim`` and the high-water mark reset), so
Python, torch and the runtime's one-time allocations are not counted. Under torchrun the
baseline is taken before ``apps.nmt.train`` starts, so gloo, the tokenizer and the training
stream count against the budget too. Each rank also records its peak up to the first call of
``evaluate`` (training and checkpoints) and, after resetting the high-water mark there, the
evaluation's own peak. Every measured process runs with glibc's ``MALLOC_MMAP_THRESHOLD_``
fixed at 128 KB (``--mmap-threshold``; see ``run``), so that freed blocks leave the resident
size. After a few steps the model translates badly: BLEU is near zero; the point is memory.

``--set key=value`` overrides the run's config (``apps/nmt/config.py``) after the demo's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MB = 2**20
BYTES_PER_TRAINED_PARAMETER = 16  # float32 weight, gradient, Adam's two moments

# apps.nmt.train's CPU default with these overrides: the model, a corpus of two languages, a
# few steps with re-materialization, a short dev evaluation.
DEMO = {
    "d_model": 512, "ffn_dim": 2048, "num_heads": 8, "head_dim": 64, "num_layers": 6,
    "vocab_size": 4000, "languages": "fr,de", "data_dir": ".cache/gettext_m2en_demo",
    "packages": "quick", "max_tokens": 512, "chunks": 4, "checkpoint": "always",
    "max_steps": 10, "eval_every": 0, "ckpt_every": 0,
    "eval_max_sentences": 100, "beam_size": 4, "max_decode_len": 32, "log_every": 1,
    # the evaluation's worst case: a length penalty this strong keeps beam search from ending
    # the untrained model's hypotheses early, so every sentence decodes max_decode_len tokens
    # and the key/value caches reach their largest; beam-search batches of 64 source tokens
    # bound them: the pipeline decodes 2 x stages = 4 batches at a time, 256 tokens (with
    # 4 x 128, stage 1 went over the budget; the default 2048 is far over it)
    "length_penalty": 2.0, "eval_batch_tokens": 64,
    "hold_memory": "false",  # freed blocks go back to the system, as the budget counts them
    "max_positions": 512,  # dev sentences are not length-filtered (positions cost nothing)
    "wandb_mode": "disabled",
}
# the same steps at test size (the corpus is the test's: --data-dir, packages none)
TINY = {
    "config": "tiny", "vocab_size": 400, "packages": "none", "max_steps": 2, "log_every": 1,
    "eval_every": 0, "ckpt_every": 0, "eval_max_sentences": 3, "beam_size": 2,
    "max_decode_len": 8, "hold_memory": "false", "wandb_mode": "disabled",
}


# ---------------------------------------------------------------------------------------------
# Measuring one process


def rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, in MB."""
    from scripts.harness import rss_mb as read

    value = read(field)
    assert value is not None, "needs Linux /proc"
    return value


def start_baseline() -> float:
    """A tiny NMT training step (the runtime's one-time allocations), then the baseline: cached
    memory returned to the system, the high-water mark restarted, ``VmRSS`` now."""
    import sacrebleu.metrics  # noqa: F401 - every import of the run, before the baseline
    import sentencepiece  # noqa: F401
    import torch
    import tqdm  # noqa: F401

    import apps.nmt.train  # noqa: F401
    import data.gettext_m2en.prepare  # noqa: F401
    import gpipe_core as gp
    from apps.nmt.config import build_model, load_nmt_config
    from apps.nmt.model import token_cross_entropy_sum
    from scripts.harness import reset_peak_rss

    config = load_nmt_config(["--config=tiny"])
    model = gp.materialize(build_model(config, device="meta"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(4, config.vocab_size, (2, 2, 6))
    token_cross_entropy_sum(model((ids[0], ids[1])), ids[1], pad_id=0).backward()
    optimizer.step()
    del model, optimizer
    reset_peak_rss()
    return rss_mb("VmRSS")


def restart_peak() -> None:
    """Restart the high-water mark ``VmHWM`` at the resident size now (nothing is freed)."""
    Path("/proc/self/clear_refs").write_text("5")


def measured_training(train_argv: list[str], out: Path) -> None:
    """Under torchrun: ``apps.nmt.train`` with this rank's memory measured around it.

    The peak up to the first ``evaluate`` call (training and checkpoints) and the evaluation's
    own peak are told apart by wrapping the train module's ``evaluate`` (which it calls on the
    pipeline): the wrapper reads the high-water mark and restarts it, then evaluates.
    """
    import apps.nmt.train as nmt_train

    rank = int(os.environ["RANK"])
    baseline = start_baseline()
    marks: dict[str, float] = {}
    evaluate = nmt_train.evaluate

    def measured_evaluate(*args: Any, **kwargs: Any) -> Any:
        if "training_peak_mb" not in marks:
            marks["training_peak_mb"] = rss_mb("VmHWM")
            marks["at_evaluation_mb"] = rss_mb("VmRSS")
            restart_peak()
        return evaluate(*args, **kwargs)

    nmt_train.evaluate = measured_evaluate
    nmt_train.main(train_argv)
    evaluation_peak = rss_mb("VmHWM")  # from the first evaluate call to the end of the run
    assert marks, "the run never evaluated"
    result = {
        "rank": rank,
        "baseline_mb": round(baseline, 1),
        "training_above_baseline_mb": round(marks["training_peak_mb"] - baseline, 1),
        "at_evaluation_above_baseline_mb": round(marks["at_evaluation_mb"] - baseline, 1),
        "evaluation_above_baseline_mb": round(evaluation_peak - baseline, 1),
    }
    result["peak_above_baseline_mb"] = max(result["training_above_baseline_mb"],
                                           result["evaluation_above_baseline_mb"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"memory-rank{rank}.json").write_text(json.dumps(result) + "\n")


def measured_whole_model(what: str, checkpoint: Path, out: Path) -> None:
    """One process holding the whole model: ``load`` the checkpoint into the plain model (as
    ``apps.nmt.checkpoint_loading.load_model`` does for one-process evaluation), or a ``train-step``: the
    plain model, Adam and one step on the run's first training batch."""
    import torch

    from apps.nmt.config import load_nmt_config

    config = load_nmt_config([f"--config={checkpoint / 'config.yaml'}"])
    baseline = start_baseline()
    if what == "load":
        from apps.nmt.checkpoint_loading import load_model

        model = load_model(config, checkpoint, torch.device("cpu"))
    else:
        import gpipe_core as gp
        from apps.nmt.config import build_model
        from apps.nmt.data import TrainBatches
        from apps.nmt.model import token_cross_entropy_sum
        from apps.nmt.train import make_optimizer

        batch = next(TrainBatches(config.data_dir, max_tokens=config.max_tokens,
                                  temperature=config.sampling_temperature, seed=config.seed,
                                  languages=config.languages or None, max_len=config.max_len))
        model = gp.materialize(build_model(config, device="meta"), seed=config.seed)
        optimizer = make_optimizer(config, list(model.parameters()))
        tokens = int(batch.tgt_out.ne(config.pad_id).sum())
        loss = token_cross_entropy_sum(model((batch.src, batch.tgt_in)), batch.tgt_out,
                                       pad_id=config.pad_id) / tokens
        loss.backward()
        optimizer.step()
    result = {"what": what, "parameters": sum(p.numel() for p in model.parameters()),
              "baseline_mb": round(baseline, 1),
              "above_baseline_mb": round(rss_mb("VmHWM") - baseline, 1)}
    (out / f"whole-{what}.json").write_text(json.dumps(result) + "\n")


# ---------------------------------------------------------------------------------------------
# The demonstration


def python_command(*args: str, torchrun: bool = False) -> list[str]:
    """This script as a module (under torchrun on 2 ranks on 127.0.0.1 with ``torchrun``)."""
    if not torchrun:
        return [sys.executable, "-m", "scripts.demo_large_nmt", *args]
    from gpipe_core.launch import torchrun_command

    return torchrun_command("scripts.demo_large_nmt", args, nproc=2)


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (for the results file)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def run(command: list[str], log: Path, *, timeout_s: float, mmap_threshold: int) -> None:
    """Run ``command`` from the repository, its output appended to ``log``; raise on failure.

    ``mmap_threshold`` (bytes; 0 leaves glibc's default): glibc's ``MALLOC_MMAP_THRESHOLD_``.
    By default glibc raises the threshold up to 32 MB as large blocks are freed, after which
    such blocks come from the heap and freed ones stay resident; fixing it returns every freed
    block above it to the system, so the peak counts memory in use rather than the allocator's
    leftovers (which varied by tens of MB between runs here).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    start = time.monotonic()
    with log.open("a") as file:
        file.write(f"$ {' '.join(command)}\n")
        file.flush()
        result = subprocess.run(command, cwd=REPO, env=env, stdout=file, stderr=subprocess.STDOUT,
                                timeout=timeout_s, check=False)
        file.write(f"(exit {result.returncode} in {time.monotonic() - start:.0f} s)\n")
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"error: `{' '.join(command)}` failed ({result.returncode}):\n{tail}")


def demonstrate(settings: dict[str, Any], *, budget_mb: float, run_dir: Path,
                out: Path | None, timeout_s: float, mmap_threshold: int,
                command: str) -> dict[str, Any]:
    """Prepare, train + evaluate under torchrun, measure the whole model; the results."""
    import gpipe_core as gp
    from apps.nmt.config import build_model, load_nmt_config
    from apps.nmt.data import load_tokenizer
    from apps.nmt.train import prepare_corpus

    started = time.monotonic()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "demo.log"
    settings = {**settings, "out_dir": str(run_dir / "run"), "num_stages": 2}
    args = [f"--{key}={value}" for key, value in settings.items()]
    config = load_nmt_config(args)
    prepare_corpus(config)  # here, so that no measured process prepares it
    vocab_size = load_tokenizer(config.data_dir).vocab_size
    if vocab_size != config.vocab_size:  # as apps.nmt.train sizes the model: to the corpus's
        settings["vocab_size"] = vocab_size
        args = [f"--{key}={value}" for key, value in settings.items()]
        config = load_nmt_config(args)
    model = build_model(config, device="meta")
    balance = list(gp.balance_by_params(model, 2))
    args.append(f"--balance={','.join(map(str, balance))}")
    parameters = sum(p.numel() for p in model.parameters())
    stage_parameters = [sum(p.numel() for p in model[:balance[0]].parameters())]
    stage_parameters.append(parameters - stage_parameters[0])
    prepared = time.monotonic()

    run(python_command("--measure-training", str(run_dir / "memory"), *args, torchrun=True),
        log, timeout_s=timeout_s, mmap_threshold=mmap_threshold)
    trained = time.monotonic()
    from apps.harness.checkpoints import resolve_checkpoint  # the one reader of `latest`

    checkpoint = resolve_checkpoint(settings["out_dir"], train_command="this demo's training")
    for what in ("load", "train-step"):
        run(python_command("--measure-whole", what, str(checkpoint), str(run_dir / "memory")),
            log, timeout_s=timeout_s, mmap_threshold=mmap_threshold)

    ranks = [json.loads((run_dir / "memory" / f"memory-rank{r}.json").read_text())
             for r in range(2)]
    for rank in ranks:
        rank["fits"] = rank["peak_above_baseline_mb"] <= budget_mb
    whole = {what: json.loads((run_dir / "memory" / f"whole-{what}.json").read_text())
             for what in ("load", "train-step")}
    summary = json.loads((checkpoint.parent / "summary.json").read_text())
    dev = json.loads((checkpoint.parent / "dev_bleu.json").read_text())
    weights_mb = parameters * 4 / MB
    result = {
        "command": command,
        "budget_mb": budget_mb,
        "malloc_mmap_threshold": mmap_threshold or "glibc default (dynamic)",
        "settings": {**settings, "out_dir": shown(checkpoint.parent), "balance": balance},
        "model": f"T({config.num_layers}, {config.ffn_dim}, {config.num_heads}) "
                 f"d_model={config.d_model} vocab={config.vocab_size}",
        "parameters": parameters,
        "stage_parameters": stage_parameters,
        "whole_model": {
            "weights_mb": round(weights_mb, 1),
            # what one process training the whole model holds before any activation
            "training_state_mb": round(parameters * BYTES_PER_TRAINED_PARAMETER / MB, 1),
            "measured_load_above_baseline_mb": whole["load"]["above_baseline_mb"],
            "measured_train_step_above_baseline_mb": whole["train-step"]["above_baseline_mb"],
        },
        "stage_training_state_mb": [round(n * BYTES_PER_TRAINED_PARAMETER / MB, 1)
                                    for n in stage_parameters],
        "ranks": ranks,
        "every_rank_fits": all(rank["fits"] for rank in ranks),
        # evaluating as before on rank 0: its stage's training state, then the whole model
        "rank0_evaluating_whole_model_estimate_mb": round(
            ranks[0]["at_evaluation_above_baseline_mb"]
            + whole["load"]["above_baseline_mb"], 1),
        "train": {key: summary[key] for key in ("steps", "tokens", "train_minutes",
                                                "tokens_per_second", "dev_loss")},
        "dev_bleu": {bucket: {"bleu": round(row["bleu"], 2), "copy_bleu": round(row["copy_bleu"], 2),
                              "sentences": row["sentences"]}
                     for bucket, row in dev["buckets"].items()},
        "dev_example": next(iter(dev["languages"].values()))["example"],
        "seconds": {"prepare": round(prepared - started, 1),
                    "train_and_evaluate": round(trained - prepared, 1),
                    "whole_model_measurements": round(time.monotonic() - trained, 1),
                    "total": round(time.monotonic() - started, 1)},
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return result


def report(result: dict[str, Any]) -> str:
    """A few lines: the model against the budget, each rank's peaks, BLEU."""
    whole, budget = result["whole_model"], result["budget_mb"]
    lines = [
        f"{result['model']}: {result['parameters'] / 1e6:.1f}M parameters, stages "
        f"{result['settings']['balance']} layers ({result['stage_parameters'][0] / 1e6:.1f}M + "
        f"{result['stage_parameters'][1] / 1e6:.1f}M); budget {budget:g} MB per process",
        f"whole model: weights {whole['weights_mb']:.0f} MB, training state (x16 B) "
        f"{whole['training_state_mb']:.0f} MB; measured in one process: load "
        f"{whole['measured_load_above_baseline_mb']:.0f} MB, one training step "
        f"{whole['measured_train_step_above_baseline_mb']:.0f} MB above baseline",
    ]
    for rank in result["ranks"]:
        lines.append(
            f"rank {rank['rank']}: training {rank['training_above_baseline_mb']:.0f} MB, "
            f"evaluation {rank['evaluation_above_baseline_mb']:.0f} MB above baseline "
            f"({rank['baseline_mb']:.0f} MB): {'fits' if rank['fits'] else 'OVER BUDGET'}")
    lines.append(f"rank 0 evaluating the whole model as before: about "
                 f"{result['rank0_evaluating_whole_model_estimate_mb']:.0f} MB")
    train = result["train"]
    lines.append(f"trained {train['steps']} steps ({train['tokens']} tokens) in "
                 f"{train['train_minutes']} min; dev loss {train['dev_loss']}; dev BLEU "
                 + ", ".join(f"{b} {v['bleu']:.2f} (copy {v['copy_bleu']:.2f})"
                             for b, v in result["dev_bleu"].items()))
    lines.append(f"{result['seconds']['total']:.0f} s in all")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the measured processes (launched by the demonstration below)
    if argv[:1] == ["--measure-training"]:
        measured_training(argv[2:], Path(argv[1]))
        return 0
    if argv[:1] == ["--measure-whole"]:
        measured_whole_model(argv[1], Path(argv[2]), Path(argv[3]))
        return 0

    from scripts.nmt_runs import parse_settings

    parser = argparse.ArgumentParser(prog="python scripts/demo_large_nmt.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mb", type=float, default=512.0,
                        help="per-process budget above baseline (Table 1's: 512)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the run (apps/nmt/config.py), repeatable")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny config on the corpus in --data-dir (for the tests)")
    parser.add_argument("--data-dir", default=None, help="corpus directory (prepared if missing)")
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "demo_large_nmt"),
                        help="checkpoints, logs and measurements (replaced)")
    parser.add_argument("--out", default=str(REPO / "docs" / "reproduction" / "large_nmt_demo.json"))
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per command")
    parser.add_argument("--mmap-threshold", type=int, default=128 << 10,
                        help="glibc MALLOC_MMAP_THRESHOLD_ of the measured processes, bytes "
                        "(0: glibc's dynamic default)")
    args = parser.parse_args(argv)
    settings: dict[str, Any] = dict(TINY if args.tiny else DEMO)
    if args.data_dir:
        settings["data_dir"] = args.data_dir
    settings.update(parse_settings(args.set))
    result = demonstrate(settings, budget_mb=args.budget_mb, run_dir=Path(args.run_dir),
                         out=Path(args.out), timeout_s=args.timeout_s,
                         mmap_threshold=args.mmap_threshold,
                         command=" ".join(["python scripts/demo_large_nmt.py", *argv]))
    print(report(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
