"""The command that scores an NMT checkpoint (``make eval-nmt``): BLEU and chrF per language and
resource bucket::

    python -m apps.nmt.evaluate --ckpt runs/nmt --split test [--beam 4 --alpha 0.6]
        [--max-per-lang N] [--languages de,fr] [--out runs/nmt/test_bleu] [--threads 2]

It loads the resolved config, the model shards and the corpus's tokenizer (an error if its
fingerprint differs from the one the checkpoint was trained with), translates with batched beam
search on the plain ``nn.Sequential``, detokenizes, and scores every language with sacrebleu
(corpus BLEU and chrF; the signatures are printed) beside the copy-the-source baseline. Averages
over high/medium/low-resource buckets (terciles of the trained languages' training-set sizes).
Writes ``<out>.json`` and ``<out>.png`` (BLEU per language sorted by resource size, as in the
paper's figure, with the copy baseline beside it).

Under torchrun (``torchrun --nproc-per-node 2 -m apps.nmt.evaluate --ckpt runs/nmt``) it
decodes through the pipeline instead, each rank holding only its stage
(``apps.nmt.pipelined_search``); the hypotheses, and so the scores, are the one-process ones.
Rank 0 prints and writes the report. A rank whose pipeline peer fails or stops answering
prints one ``error:`` line naming itself and the peer (rank and stage) and exits with status 1;
a report that cannot be written is one ``error:`` line naming the file and the free space
(``apps.report_writes``), status 1; a checkpoint, corpus or option the user can fix, status 2.

The work is in the modules below: ``apps.nmt.checkpoint_loading`` (the checkpoint, its
tokenizer; as a pipeline under torchrun), ``apps.nmt.decoding`` (the sentences and their
translations), ``apps.nmt.pipelined_search`` (decoding through the pipeline) and
``apps.nmt.scoring`` (sacrebleu, the report and its plot).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import gpipe_core as gp
from apps.config import ConfigError
from apps.harness import checkpoints
from apps.nmt.checkpoint_loading import LOAD_ERRORS, load_checkpoint, load_pipeline
from apps.nmt.pipelined_search import pipeline_search
from apps.nmt.scoring import evaluate, format_report, plot_report, write_report
from apps.report_writes import ReportWriteError, report_write
from apps.validation import CommandParser, at_least, device_name, say_once, threads

__all__ = ["evaluate_checkpoint", "main"]


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

    Returns the report (see ``apps.nmt.scoring.score``); with ``out`` also writes
    ``<out>.json`` and ``<out>.png`` (a write that fails: ReportWriteError). Under torchrun
    (``WORLD_SIZE`` > 1) it decodes through the pipeline, every rank taking part.
    """
    pipelined = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun
    loaded = load_checkpoint(ckpt, data_dir=data_dir, device=torch.device(device),
                             model=not pipelined)
    config, search, master = loaded.config, None, True
    if pipelined:
        pipe, run = load_pipeline(loaded, device=device)  # agrees on one checkpoint
        checkpoints.unpin(loaded.path)
        search = pipeline_search(pipe, config, beam_size=beam_size or config.beam_size,
                                 alpha=config.length_penalty if alpha is None else alpha)
        device, master = str(run.device), run.master
    report = evaluate(loaded.model, config, loaded.tokenizer, split=split, languages=languages,
                      max_per_lang=max_per_lang, beam_size=beam_size, alpha=alpha,
                      device=torch.device(device), search=search)
    assert report is not None  # every rank scores (score_here)
    report["checkpoint"] = str(loaded.path)
    try:
        if out is not None and master:
            out = Path(out)
            for path, write in ((out.with_suffix(".json"), write_report),
                                (out.with_suffix(".png"), plot_report)):
                with report_write(path):
                    write(report, path)
    finally:
        if pipelined:  # not after a failure in decoding: a peer that stopped would not come
            from apps.harness.run import end_run

            end_run()  # after rank 0's files (or its failure to write them)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m apps.nmt.evaluate",
        description="BLEU/chrF per language and resource bucket of an apps.nmt checkpoint.",
    )
    parser.add_argument("--ckpt", default="runs/nmt", help="run out_dir or a step-* directory")
    parser.add_argument("--split", default="test", choices=["dev", "test"])
    parser.add_argument("--beam", type=at_least("--beam", 1, "beam width, 1 = greedy"),
                        default=None, help="beam size (config: beam_size)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="GNMT length penalty (config: length_penalty)")
    parser.add_argument("--max-per-lang", type=at_least("--max-per-lang", 1, "sentences per "
                                                        "language"), default=None,
                        help="first N sentences of each language (default: all)")
    parser.add_argument("--languages", default=None, help="comma-separated (default: trained)")
    parser.add_argument("--data-dir", default=None, help="corpus directory (default: config's)")
    parser.add_argument("--out", default=None,
                        help="write <out>.json and <out>.png (default: <ckpt>/<split>_bleu)")
    parser.add_argument(
        "--threads", type=threads(), default=1,
        help="torch CPU threads (1: beam search on small batches gains nothing from more, and "
        "on busy cores 2 threads measured 11x slower than 1)",
    )
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu or cuda")
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
    except LOAD_ERRORS as error:
        say_once(f"error: {error}")  # every rank reaches the same error
        return 2
    except ReportWriteError as error:  # rank 0's only: it writes the report
        print(f"error: {error}", file=sys.stderr)
        return 1
    except gp.PipelineFailure as error:  # under torchrun: each survivor says where it stopped
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(format_report(report))
    print(f"wrote {Path(out).with_suffix('.json')} and {Path(out).with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
