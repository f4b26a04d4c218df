"""BLEU evaluation of the NMT model: beam search, sacrebleu per language and resource bucket.

Used by training (through its pipeline), by ``apps.nmt.translate``, and as the command that
scores a checkpoint (``make eval-nmt``)::

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
Rank 0 prints and writes the report.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import gpipe_core as gp
from apps.config import ConfigError
from apps.harness import checkpoints
from apps.harness.checkpoints import CheckpointError
from apps.nmt.config import NMTConfig, build_model, load_nmt_config
from apps.nmt.data import (
    RESOURCE_BUCKETS,
    CorpusError,
    Tokenizer,
    eval_batches,
    language_counts,
    load_manifest,
    load_tokenizer,
    resource_buckets,
)
from apps.nmt.search import beam_search
from apps.validation import CommandParser, at_least, device_name, threads

__all__ = [
    "Sentence",
    "CheckpointError",
    "TokenizerMismatch",
    "evaluate",
    "evaluate_checkpoint",
    "format_report",
    "load_checkpoint",
    "load_eval_sentences",
    "load_model",
    "main",
    "plot_report",
    "resolve_checkpoint",
    "score",
    "translate",
    "train_languages",
]

Report = dict[str, Any]


@dataclass
class Sentence:
    """One evaluation pair: its language, source ids (tag first), raw source and reference."""

    lang: str
    src_ids: list[int]
    source: str
    reference: str


# ---------------------------------------------------------------------------------------------
# Checkpoints


TRAIN_COMMAND = (
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m apps.nmt.train"
)


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory behind ``path``: a run's out_dir (its ``latest``) or a step dir."""
    return checkpoints.resolve_checkpoint(path, train_command=f"{TRAIN_COMMAND} --out_dir={path}")


def load_model(config: NMTConfig, checkpoint_dir: str | Path, device: torch.device) -> nn.Sequential:
    """The plain ``nn.Sequential`` of ``config`` with the weights of a (sharded) checkpoint."""
    model = build_model(config, device="meta")
    state = gp.load_shards(checkpoint_dir)
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


class TokenizerMismatch(ValueError):
    """The corpus's tokenizer is not the one the checkpoint was trained with."""


def prepare_command(config: NMTConfig) -> str:
    """The command that builds the corpus (and its tokenizer) ``config`` was trained on."""
    languages = f" --languages {','.join(config.languages)}" if config.languages else ""
    return (
        f"python -m data.gettext_m2en.prepare --out {config.data_dir} --packages "
        f"{config.packages} --vocab-size {config.vocab_size}{languages}"
    )


@dataclass
class LoadedCheckpoint:
    """What translating with a checkpoint needs: its folder, config, tokenizer and model."""

    path: Path
    config: NMTConfig
    tokenizer: Tokenizer
    model: nn.Sequential | None


def load_checkpoint(ckpt: str | Path, *, data_dir: str | None = None,
                    device: torch.device | None = None, model: bool = True) -> LoadedCheckpoint:
    """The NMT checkpoint under ``ckpt`` (a run's out_dir or a step folder), in one process.

    Checks, each with an error that says the fix: a checkpoint exists (CheckpointError naming
    the train command) and is intact (gp.CheckpointCorruptError), it is an NMT one (not
    AmoebaNet's), its config loads, the corpus (``data_dir``, default the config's) is prepared
    (CorpusError naming the prepare command), and the corpus's tokenizer has the fingerprint
    the checkpoint was trained with (TokenizerMismatch). ``model=False`` skips the weights.

    The folder stays pinned (``checkpoints.resolve_checkpoint``) until its weights are loaded:
    with ``model=False``, call ``checkpoints.unpin(loaded.path)`` after loading them.
    """
    path = resolve_checkpoint(ckpt)
    checkpoints.require_app(path, "nmt")
    config_path = path / "config.yaml"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.yaml; was it written by apps.nmt.train?")
    overrides = [f"--config={config_path}"]
    if data_dir is not None:
        overrides.append(f"--data_dir={data_dir}")
    try:
        config = load_nmt_config(overrides)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from error
    try:
        load_manifest(config.data_dir)
    except CorpusError as error:
        raise CorpusError(
            f"no prepared corpus at {config.data_dir} for checkpoint {path}; build it with "
            f"`{prepare_command(config)}` (or pass --data-dir)"
        ) from error
    tokenizer = load_tokenizer(config.data_dir)
    trained_with = json.loads((path / "tokenizer.json").read_text())
    if trained_with["fingerprint"] != tokenizer.fingerprint:
        raise TokenizerMismatch(
            f"checkpoint {path} was trained with tokenizer {trained_with['fingerprint']} "
            f"({trained_with.get('data_dir')}), but {config.data_dir} holds tokenizer "
            f"{tokenizer.fingerprint}; use the corpus it was trained on "
            f"(--data-dir), or rebuild that corpus with `{prepare_command(config)}`"
        )
    weights = None
    if model:
        weights = load_model(config, path, device or torch.device("cpu"))
        checkpoints.unpin(path)  # in memory now: a running trainer may rotate it away
    return LoadedCheckpoint(path, config, tokenizer, weights)


# ---------------------------------------------------------------------------------------------
# Data


def train_languages(config: NMTConfig) -> list[str]:
    """The languages a run of ``config`` trains on: its ``languages``, or all with train data."""
    counts = language_counts(config.data_dir, "train")
    if config.languages:
        return list(config.languages)
    return sorted(lang for lang, n in counts.items() if n > 0)


def load_eval_sentences(
    data_dir: str | Path,
    split: str,
    languages: Sequence[str],
    *,
    max_per_lang: int | None,
    pad_id: int,
    strict: bool = True,
    max_src_len: int | None = None,
) -> tuple[list[Sentence], list[str]]:
    """The first ``max_per_lang`` pairs of each language of ``split``; returns (pairs, skipped).

    ``strict``: a language without ``split`` data is an error (naming the languages that have
    data); otherwise it is skipped and returned in ``skipped``. ``max_src_len`` (the model's
    ``max_positions``): a longer source is cut to its first ``max_src_len`` tokens, which is all
    the model can read, with one warning saying how many were (held-out pairs are not filtered
    by length as training pairs are, and a catalog may hold a paragraph).
    """
    counts = language_counts(data_dir, split)
    skipped = [lang for lang in languages if counts.get(lang, 0) == 0]
    if skipped and strict:
        have = " ".join(sorted(lang for lang, n in counts.items() if n > 0))
        raise CorpusError(
            f"no {split} data for language(s) {skipped} in {data_dir}; "
            f"languages with {split} data: {have}"
        )
    chosen = [lang for lang in languages if lang not in skipped]
    if not chosen:
        raise CorpusError(f"none of the languages {list(languages)} has {split} data in {data_dir}")
    sentences: list[Sentence] = []
    # one batch per pair would be slow; big batches, then unpadded rows
    for batch in eval_batches(
        data_dir, split, max_tokens=1 << 16, languages=chosen, max_per_lang=max_per_lang
    ):
        assert batch.sources is not None and batch.references is not None
        for row in range(len(batch)):
            ids = batch.src[row]
            sentences.append(
                Sentence(
                    batch.langs[row],
                    ids[ids.ne(pad_id)].tolist(),
                    batch.sources[row],
                    batch.references[row],
                )
            )
    long = [s for s in sentences if max_src_len is not None and len(s.src_ids) > max_src_len]
    if long:
        print(f"warning: {len(long)} of {len(sentences)} {split} sources have more than "
              f"max_positions={max_src_len} tokens (the longest {max(len(s.src_ids) for s in long)}"
              f"); they are cut to their first {max_src_len}", file=sys.stderr, flush=True)
        for sentence in long:
            del sentence.src_ids[max_src_len:]
    return sentences, skipped


# ---------------------------------------------------------------------------------------------
# Translation


def _batches_by_length(
    sentences: Sequence[Sentence], *, max_src_tokens: int, max_sentences: int
) -> list[list[int]]:
    """Indices of ``sentences`` grouped into batches of similar source length (little padding)."""
    order = sorted(range(len(sentences)), key=lambda i: (len(sentences[i].src_ids), i))
    groups: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = len(sentences[index].src_ids)
        if current and (
            len(current) >= max_sentences or (len(current) + 1) * width > max_src_tokens
        ):
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


def _pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> Tensor:
    width = max(len(row) for row in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def translate(
    model: nn.Sequential | None,
    sentences: Sequence[Sentence],
    tokenizer: Tokenizer,
    *,
    beam_size: int,
    alpha: float,
    max_decode_len: int,
    device: torch.device,
    max_src_tokens: int = 2048,
    max_sentences: int = 64,
    search: Callable[[Tensor, int], list[list[int]]] | None = None,
) -> list[str]:
    """Detokenized beam-search translations of ``sentences`` (in their order), in batches of
    similar length. Output length is bounded by ``max_decode_len`` and by twice the source
    length plus 8. ``search(src_ids, max_len)``, when given, decodes a padded batch instead of
    ``beam_search`` on ``model`` (e.g. through a pipeline: ``apps.nmt.pipelined_search``); a
    search with a ``batches([(src_ids, max_len), ...])`` method gets every batch at once (the
    pipeline decodes several at a time, each as its own batch, so the result is the same).
    """
    groups = _batches_by_length(
        sentences, max_src_tokens=max_src_tokens, max_sentences=max_sentences
    )
    translations: dict[int, str] = {}
    batches = getattr(search, "batches", None)
    if batches is not None:
        padded = [_pad([sentences[i].src_ids for i in group], tokenizer.pad_id, device)
                  for group in groups]
        decoded = batches([(src, min(max_decode_len, 2 * src.shape[1] + 8)) for src in padded])
        for group, ids in zip(groups, decoded, strict=True):
            for index, hypothesis in zip(group, ids, strict=True):
                translations[index] = tokenizer.decode(hypothesis)
        return [translations[i] for i in range(len(sentences))]
    for group in groups:
        src = _pad([sentences[i].src_ids for i in group], tokenizer.pad_id, device)
        max_len = min(max_decode_len, 2 * src.shape[1] + 8)
        if search is not None:
            ids = search(src, max_len)
        else:
            assert model is not None, "translate needs a model or a search"
            ids = beam_search(
                model,
                src,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
                beam_size=beam_size,
                alpha=alpha,
                max_len=max_len,
            )
        for index, hypothesis in zip(group, ids, strict=True):
            translations[index] = tokenizer.decode(hypothesis)
    return [translations[i] for i in range(len(sentences))]


@torch.no_grad()
def mean_token_loss(
    model: nn.Sequential | gp.DistributedGPipe,
    config: NMTConfig,
    *,
    split: str = "dev",
    max_per_lang: int | None = None,
    device: torch.device | None = None,
) -> float:
    """Cross entropy per target token (nats, no label smoothing, the model in eval mode) over
    the first ``max_per_lang`` pairs of each trained language of ``split``.

    ``model`` is the plain model, or a ``DistributedGPipe`` of it: then every rank of its
    pipeline calls this alike (collective over the pipeline group), the batches go through
    ``pipe.evaluate`` (forward only), the last stage sums the loss of the logits and every rank
    gets the mean. The pipeline's batches hold ``config.max_tokens`` tokens (the training
    mini-batch the pipeline is sized for) instead of 4096: the mean is the same, up to float
    rounding.
    """
    from apps.nmt.model import token_cross_entropy_sum

    pipe = model if isinstance(model, gp.DistributedGPipe) else None
    device = pipe.device if pipe is not None else device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in eval_batches(config.data_dir, split,
                              max_tokens=config.max_tokens if pipe is not None else 4096,
                              languages=train_languages(config), max_per_lang=max_per_lang):
        target = batch.tgt_out.to(device)
        tokens += int(target.ne(config.pad_id).sum())
        if pipe is None:
            logits = model((batch.src.to(device), batch.tgt_in.to(device)))
        else:  # logits on the last stage only; its loss is the one used (no label smoothing)
            _, logits = pipe.evaluate((batch.src, batch.tgt_in) if pipe.is_first else None,
                                      target if pipe.is_last else None, return_outputs=True)
            if not pipe.is_last:
                continue
        total += float(token_cross_entropy_sum(logits, target, pad_id=config.pad_id))
    model.train(was_training)
    if pipe is not None:
        summed = torch.tensor([total], dtype=torch.float64, device=device)
        dist.broadcast(summed, src=pipe.stage_ranks[-1], group=pipe.group)
        total = float(summed[0])
    return total / max(tokens, 1)


# ---------------------------------------------------------------------------------------------
# Scores


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


# ---------------------------------------------------------------------------------------------
# A checkpoint's report: the command


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

    Returns the report (see :func:`score`); with ``out`` also writes
    ``<out>.json`` and ``<out>.png``.
    """
    pipelined = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun
    loaded = load_checkpoint(ckpt, data_dir=data_dir, device=torch.device(device),
                             model=not pipelined)
    path, config, tokenizer, model = loaded.path, loaded.config, loaded.tokenizer, loaded.model
    search, master = None, True
    if pipelined:
        from apps.nmt.pipelined_search import load_pipeline, pipeline_search

        pipe, run = load_pipeline(loaded, device=device)  # agrees on one checkpoint
        path = loaded.path
        checkpoints.unpin(path)
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
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    gp.write_atomic(path, png.getvalue())  # whole or not at all


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
