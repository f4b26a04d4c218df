"""Evaluate an NMT checkpoint: beam search, sacrebleu BLEU/chrF per language and resource bucket.

    python scripts/eval_bleu.py --ckpt runs/nmt --split test [--beam 4 --alpha 0.6]
        [--max-per-lang N] [--languages de,fr] [--out runs/nmt/test_bleu] [--threads 2]

Loads the resolved config, the model shards and the corpus's tokenizer (an error if its
fingerprint differs from the one the checkpoint was trained with), translates with batched beam
search on the plain ``nn.Sequential``, detokenizes, and scores every language with sacrebleu
(corpus BLEU and chrF; the signatures are printed) beside the copy-the-source baseline. Averages
over high/medium/low-resource buckets (terciles of the trained languages' training-set sizes).
Writes ``<out>.json`` and ``<out>.png`` (BLEU per language sorted by resource size, as in the
paper's figure, with the copy baseline beside it).

Under torchrun (``torchrun --nproc-per-node 2 scripts/eval_bleu.py --ckpt runs/nmt``) it
decodes through the pipeline instead, each rank holding only its stage
(``apps.nmt.pipelined_search``); the hypotheses, and so the scores, are the one-process ones.
Rank 0 prints and writes the report.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpipe_core as gp  # noqa: E402
from apps.config import ConfigError  # noqa: E402
from apps.nmt.data import CorpusError  # noqa: E402
from apps.nmt.evaluate import (  # noqa: E402
    CheckpointError,
    TokenizerMismatch,
    evaluate,
    format_report,
    load_checkpoint,
    write_report,
)

__all__ = ["TokenizerMismatch", "evaluate_checkpoint", "main", "plot_report"]


def evaluate_checkpoint(
    ckpt: str | Path,
    *,
    split: str = "test",
    beam_size: int | None = None,
    alpha: float | None = None,
    max_per_lang: int | None = None,
    languages: Sequence[str] | None = None,
    data_dir: str | None = None,
    out: str | Path | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Score the checkpoint under ``ckpt`` (a run's out_dir or a step directory) on ``split``.

    Returns the report (see ``apps.nmt.evaluate.score``); with ``out`` also writes
    ``<out>.json`` and ``<out>.png``.
    """
    pipelined = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun
    loaded = load_checkpoint(ckpt, data_dir=data_dir, device=torch.device(device),
                             model=not pipelined)
    path, config, tokenizer, model = loaded.path, loaded.config, loaded.tokenizer, loaded.model
    search, master = None, True
    if pipelined:
        from apps.nmt.pipelined_search import load_pipeline, pipeline_search

        pipe, run = load_pipeline(loaded, device=device)
        search = pipeline_search(pipe, config, beam_size=beam_size or config.beam_size,
                                 alpha=config.length_penalty if alpha is None else alpha)
        device, master = str(run.device), run.master
    report = evaluate(
        model,
        config,
        tokenizer,
        split=split,
        languages=languages,
        max_per_lang=max_per_lang,
        beam_size=beam_size,
        alpha=alpha,
        device=torch.device(device),
        search=search,
    )
    assert report is not None  # every rank scores (score_here)
    report["checkpoint"] = str(path)
    if out is not None and master:
        out = Path(out)
        write_report(report, out.with_suffix(".json"))
        plot_report(report, out.with_suffix(".png"))
    if pipelined:
        from apps.harness.run import end_run

        end_run()  # after rank 0's files
    return report


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """BLEU per language, largest training set on the left, beside copying the source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    languages = list(report["languages"])  # already sorted by training-set size, largest first
    rows = [report["languages"][lang] for lang in languages]
    x = range(len(languages))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(languages) + 2), 4))
    ax.bar([i - width / 2 for i in x], [r["bleu"] for r in rows], width, label="model")
    ax.bar([i + width / 2 for i in x], [r["copy_bleu"] for r in rows], width,
           label="copy the source", color="0.7")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{lang}\n{r['bucket'][0]}" for lang, r in zip(languages, rows,
                                                                        strict=True)],
                       fontsize=8)
    ax.set_ylabel(f"{report['split']} BLEU")
    ax.set_xlabel("language (sorted by training pairs, largest first; h/m/l = resource bucket)")
    means = ", ".join(f"{b} {v['bleu']:.1f} vs {v['copy_bleu']:.1f}"
                      for b, v in report["buckets"].items())
    ax.set_title(f"BLEU per language (bucket means, model vs copy: {means})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/eval_bleu.py",
        description="BLEU/chrF per language and resource bucket of an apps.nmt checkpoint.",
    )
    parser.add_argument("--ckpt", default="runs/nmt", help="run out_dir or a step-* directory")
    parser.add_argument("--split", default="test", choices=["dev", "test"])
    parser.add_argument("--beam", type=int, default=None, help="beam size (config: beam_size)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="GNMT length penalty (config: length_penalty)")
    parser.add_argument("--max-per-lang", type=int, default=None,
                        help="first N sentences of each language (default: all)")
    parser.add_argument("--languages", default=None, help="comma-separated (default: trained)")
    parser.add_argument("--data-dir", default=None, help="corpus directory (default: config's)")
    parser.add_argument("--out", default=None,
                        help="write <out>.json and <out>.png (default: <ckpt>/<split>_bleu)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (1: beam search on small batches gains nothing from more, and "
        "on busy cores 2 threads measured 11x slower than 1)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or str(Path(args.ckpt) / f"{args.split}_bleu")
    try:
        if args.alpha is not None and not (math.isfinite(args.alpha) and args.alpha >= 0):
            raise ConfigError(f"--alpha={args.alpha} must be a finite number >= 0 (0 = no "
                              "length penalty)")
        report = evaluate_checkpoint(
            args.ckpt,
            split=args.split,
            beam_size=args.beam,
            alpha=args.alpha,
            max_per_lang=args.max_per_lang,
            languages=args.languages.split(",") if args.languages else None,
            data_dir=args.data_dir,
            out=out,
            device=args.device,
        )
    except (CheckpointError, gp.CheckpointCorruptError, CorpusError, ConfigError,
            TokenizerMismatch) as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(format_report(report))
    print(f"wrote {Path(out).with_suffix('.json')} and {Path(out).with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
