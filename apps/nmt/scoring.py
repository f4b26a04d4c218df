"""Scores of NMT translations: corpus BLEU and chrF (sacrebleu) per language beside copying the
source, their means over the high/medium/low-resource buckets (:func:`score`); a split
translated and scored (:func:`evaluate`); and the report as a table, JSON and a plot.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gpipe_core as gp
from apps.nmt.config import NMTConfig
from apps.nmt.data import RESOURCE_BUCKETS, Tokenizer, language_counts, resource_buckets
from apps.nmt.decoding import Sentence, load_eval_sentences, train_languages, translate

__all__ = ["Report", "evaluate", "format_report", "plot_report", "score", "write_report"]

Report = dict[str, Any]


def score(
    sentences: Sequence[Sentence],
    hypotheses: Sequence[str],
    buckets: Mapping[str, str],
    train_counts: Mapping[str, int],
) -> Report:
    """Corpus BLEU and chrF (sacrebleu) per language, beside copying the source, and their
    means over the resource buckets (``resource_buckets`` of the trained languages)."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    by_lang: dict[str, list[int]] = {}
    for index, sentence in enumerate(sentences):
        by_lang.setdefault(sentence.lang, []).append(index)
    languages: dict[str, dict[str, Any]] = {}
    for lang, rows in sorted(by_lang.items(), key=lambda kv: (-train_counts.get(kv[0], 0), kv[0])):
        refs = [[sentences[i].reference for i in rows]]
        hyps = [hypotheses[i] for i in rows]
        copies = [sentences[i].source for i in rows]
        languages[lang] = {
            "bucket": buckets.get(lang, "untrained"),
            "train_pairs": int(train_counts.get(lang, 0)),
            "sentences": len(rows),
            "bleu": bleu.corpus_score(hyps, refs).score,
            "chrf": chrf.corpus_score(hyps, refs).score,
            "copy_bleu": bleu.corpus_score(copies, refs).score,
            "copy_chrf": chrf.corpus_score(copies, refs).score,
            "example": {
                "source": copies[0],
                "reference": refs[0][0],
                "hypothesis": hyps[0],
            },
        }
    bucket_report: dict[str, dict[str, Any]] = {}
    for bucket in (*RESOURCE_BUCKETS, "untrained"):
        rows_ = [v for v in languages.values() if v["bucket"] == bucket]
        if not rows_:
            continue
        bucket_report[bucket] = {
            "languages": len(rows_),
            "sentences": sum(v["sentences"] for v in rows_),
            **{
                key: sum(v[key] for v in rows_) / len(rows_)
                for key in ("bleu", "copy_bleu", "chrf", "copy_chrf")
            },
        }
    return {
        "signature": {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())},
        "languages": languages,
        "buckets": bucket_report,
        "sentences": len(sentences),
    }


def evaluate(
    model: nn.Sequential | None,
    config: NMTConfig,
    tokenizer: Tokenizer,
    *,
    split: str = "dev",
    languages: Sequence[str] | None = None,
    max_per_lang: int | None = None,
    beam_size: int | None = None,
    alpha: float | None = None,
    device: torch.device | None = None,
    search: Callable[[Tensor, int], list[list[int]]] | None = None,
    score_here: bool = True,
) -> Report | None:
    """Translate ``split`` and score it (in one process; with ``search`` instead of ``model``,
    through a pipeline: see ``translate``; the training run evaluates so on its pipeline).

    ``languages`` None evaluates the trained languages that have ``split`` data (others are
    listed under ``skipped``); given explicitly, a language without data is an error.
    Buckets by training-set size: ``config.bucket_thresholds``, or terciles when it is None.
    ``score_here=False``: this rank only takes its part in a pipeline's decoding (every rank
    gets the same hypotheses) and returns None; the rank that reports scores them.
    """
    started = time.monotonic()
    trained = train_languages(config)
    train_counts = language_counts(config.data_dir, "train")
    buckets = resource_buckets(
        {lang: train_counts.get(lang, 0) for lang in trained}, config.bucket_thresholds
    )
    sentences, skipped = load_eval_sentences(
        config.data_dir,
        split,
        list(languages) if languages else trained,
        max_per_lang=max_per_lang,
        pad_id=tokenizer.pad_id,
        strict=bool(languages),
        max_src_len=config.max_positions,
    )
    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    hypotheses = translate(
        model,
        sentences,
        tokenizer,
        beam_size=beam_size or config.beam_size,
        alpha=config.length_penalty if alpha is None else alpha,
        max_decode_len=config.max_decode_len,
        device=device,
        max_src_tokens=config.eval_batch_tokens,
        search=search,
    )
    if not score_here:
        return None
    report = score(sentences, hypotheses, buckets, train_counts)
    report.update(
        split=split,
        skipped=skipped,
        beam_size=beam_size or config.beam_size,
        alpha=config.length_penalty if alpha is None else alpha,
        max_per_lang=max_per_lang,
        tokenizer=tokenizer.fingerprint,
        seconds=round(time.monotonic() - started, 1),
    )
    return report


def format_report(report: Report, *, examples: int = 3) -> str:
    """A table: BLEU and chrF per resource bucket beside copying the source, then per language."""
    lines = [
        f"{report['split']} BLEU over {report['sentences']} sentences "
        f"(beam {report['beam_size']}, alpha {report['alpha']}, {report['seconds']} s)",
        f"{'bucket':<10}{'langs':>6}{'sents':>7}{'BLEU':>8}{'copy BLEU':>11}"
        f"{'chrF':>8}{'copy chrF':>11}",
    ]
    for bucket, row in report["buckets"].items():
        lines.append(
            f"{bucket:<10}{row['languages']:>6}{row['sentences']:>7}{row['bleu']:>8.2f}"
            f"{row['copy_bleu']:>11.2f}{row['chrf']:>8.2f}{row['copy_chrf']:>11.2f}"
        )
    lines.append("per language (largest training set first):")
    for lang, row in report["languages"].items():
        lines.append(
            f"  {lang:<8}{row['bucket']:<8}{row['train_pairs']:>8}{row['sentences']:>7}"
            f"{row['bleu']:>8.2f}{row['copy_bleu']:>11.2f}{row['chrf']:>8.2f}"
            f"{row['copy_chrf']:>11.2f}"
        )
    if report.get("skipped"):
        lines.append(f"skipped (no {report['split']} data): {' '.join(report['skipped'])}")
    for lang, row in list(report["languages"].items())[:examples]:
        ex = row["example"]
        lines.append(f"  [{lang}] {ex['source']!r}\n     ref {ex['reference']!r}\n"
                     f"     hyp {ex['hypothesis']!r}")
    lines.append(f"sacrebleu {report['signature']['bleu']} | {report['signature']['chrf']}")
    return "\n".join(lines)


def write_report(report: Report, path: str | Path) -> None:
    """The report as JSON (non-ASCII text kept readable)."""
    gp.write_atomic(path, json.dumps(report, indent=1, ensure_ascii=False) + "\n")


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
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    gp.write_atomic(path, png.getvalue())  # whole or not at all

