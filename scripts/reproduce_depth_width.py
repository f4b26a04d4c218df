"""Depth against width where transfer is possible (issue 21, part 2): a deep-narrow and a
shallow-wide Transformer of equal size on a mix in which every low-resource language has a
high-resource relative, several seeds each, scored by how much more depth helps the low bucket
than the high one.

    python scripts/reproduce_depth_width.py [--phase all|train|report] [--jobs 2]
        [--seeds 0 1 2] [--corpus real|related] [--out docs/reproduction/depth_width]
        [--runs-dir runs/depth_width] [--bootstrap 1000] [--quick]

THE DESIGN, fixed before any run (changing it means a new experiment, not a re-reading):

Data: ``.cache/gettext_m2en_dw``, the full Debian package list (``packages: full``) restricted
to 16 Latin-script languages with a 2,000-piece shared SentencePiece vocabulary (see
``apps/nmt/configs/cpu_dw_deep.yaml`` for the list and each language's training pairs). High
bucket (>= 20k training pairs): fr it es pt nl de cs pl; low bucket (< 2k): each a relative of
a high language: co (Corsican: it, fr), fur (Friulian: it), an (Aragonese: es), ast
(Asturian: es), wa (Walloon: fr), li (Limburgish: nl, de), fy (Frisian: nl), hsb (Upper
Sorbian: cs, pl). Temperature sampling T=5.

Models (``cpu_dw_deep.yaml``, ``cpu_dw_wide.yaml``): deep T(12, 256, 2) and wide T(6, 512, 4)
at d=64, heads of 32 channels (the paper's ratio: half the depth, twice the feed-forward width
and heads), parameters equal within 1% (checked before training; the script refuses
otherwise). **Depth scaling of the init is off for both** (``scaled_init: false``): the same
init std everywhere, so the comparison is of depth, not of an init that depends on depth.
Pre-norm, logits clipped at 20, dropout 0.1, label smoothing 0.1, Adam 3e-3, warm-up 400 then
inverse square root, gradient clip 1.0, 1,024 padded tokens per step; one process per run, two
runs at a time.

Budget: a fixed number of steps, 9,272 (``max_steps`` in the configs: the step at which the
published runs, which then stopped at a 16M-token budget, reached 16M source + target tokens;
9,271 for seed 2), for every run; seeds 0, 1, 2 for each architecture. A seed fixes the data order and the init:
deep and wide of one seed train on identical batches in identical order. A checkpoint every
``ckpt_every`` (1,250) steps, 8 per run, the same steps for both architectures.

Scoring (after each run, on its checkpoints):
- per-language dev loss (nats per target token, no label smoothing) at every checkpoint: the
  curves at matched tokens;
- the best checkpoint: the lowest macro-mean dev loss over the languages (dev chooses; test
  scores);
- on the whole test split, from the best checkpoint: per sentence, BLEU and chrF sufficient
  statistics (sacrebleu; beam 4, alpha 0.6) and the summed cross entropy; copy-the-source
  statistics as the floor;
- epochs each language (and bucket: the mean over its languages) saw: pairs drawn / training
  pairs, by replaying the run's batch stream.

The statistic: D = (deep - wide)_low - (deep - wide)_high, a bucket's value the mean over its
languages of the per-language corpus score, averaged over seeds. In test loss (negative D:
depth helps the low bucket more) and in BLEU and chrF (positive D: the same). 95% interval:
a t interval over the seeds' own D values (issue 39: with 3 seeds a bootstrap over seeds cannot
reach beyond the seeds observed); beside it, the paired bootstrap of the first design (each of
``--bootstrap`` replicates resamples the seeds, the same for both architectures, and, within
each language, the test sentences, the same for every model). A seed whose deep and wide runs
ran on different machines is left out (``scripts.nmt_runs.comparable``). BLEU and chrF D are interpreted only if every run's high-bucket test BLEU is above
copy-the-source; otherwise they are reported and marked ``below_copy``.

Each run writes ``<out>/<arch>_s<seed>.json`` (commit, torch version, UTC time, load average,
seed, parameters, tokens, dev curves, best step, epochs, per-sentence test statistics); a run
whose JSON exists is skipped, so the sweep continues where it stopped. The report (after every
phase, from whatever runs exist) writes ``<out>/_summary.json`` (D per metric; beside it, as a
description of the curves, deep - wide per bucket and D in dev loss at every checkpoint, the two
models at matched tokens), ``<out>/_dev_loss.png`` (mean dev loss per bucket against tokens) and
``<out>/_dev_loss_languages.png`` (every language's).

THE CONTROLLED COMPLEMENT (``--corpus related``; designed after seeds 0 and 1 of the real mix
gave a D that cannot tell the models apart and a high bucket below copy-the-source, before any
run on it): the same models, budget, seeds, scoring and statistic on a corpus where transfer is
guaranteed possible, ``data.related_languages`` (its README has the design): the same English
sentences written in two synthetic families, each a parent of 30,000 training pairs (the high
bucket) and three relatives of 300, 600 and 1,200 (the low bucket) that take 80% of their words
from the parent under three regular sound changes. Copy-the-source scores about nothing there,
so BLEU and chrF are interpretable once the models learn. Results go to
``docs/reproduction/depth_width_related`` (runs: ``runs/depth_width_related``). The informative
outcomes: D below zero in loss with an interval that excludes zero (depth helps the relatives
more: the paper's direction), above zero (width does), or an interval around zero with both
buckets well above copy (no difference at this scale, from a design that could show one).

``--quick`` (the test suite): the tiny config as both architectures (deep 2 layers, wide 1 layer
twice as wide), 2 seeds, 6 steps, checkpoints every 2 (all kept, as in the real runs), greedy
decoding of a few test sentences, in this process; seconds per run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apps.nmt.checkpoint_loading import load_model
from apps.nmt.config import NMTConfig, build_model, load_nmt_config
from apps.nmt.data import (
    CorpusError,
    TrainBatches,
    language_counts,
    load_tokenizer,
    resource_buckets,
)
from apps.nmt.decoding import Sentence, load_eval_sentences, translate
from apps.nmt.model import count_parameters
from data.related_languages.build import DESIGN, Design
from data.related_languages.build import build as build_related
from scripts.harness import (
    add_draft_argument,
    pyplot,
    refuse_dirty_tree,
    save_figure,
    set_draft,
)
from scripts.nmt_runs import (
    REPO,
    comparable,
    drop_checkpoints,
    machine_records,
    parse_settings,
    provenance,
    read_results,
    run_pending,
    t_interval,
    train,
    train_in_process,
    write_result,
)

ARCHS = {"deep": "cpu_dw_deep", "wide": "cpu_dw_wide"}
CORPORA = ("real", "related")
OUT = {"real": Path("docs/reproduction/depth_width"),
       "related": Path("docs/reproduction/depth_width_related")}
RUNS = {"real": Path("runs/depth_width"), "related": Path("runs/depth_width_related")}
RELATED_DIR = Path(".cache/related_languages")
SEEDS = (0, 1, 2)
PARAMETER_TOLERANCE = 0.01  # deep and wide within 1% of each other
METRICS = ("loss", "bleu", "chrf")
QUICK: dict[str, dict[str, Any]] = {
    "deep": {"config": "tiny"},
    "wide": {"config": "tiny", "num_layers": 1, "ffn_dim": 128, "num_heads": 4},
}
QUICK_COMMON: dict[str, Any] = {
    "max_steps": 6, "ckpt_every": 2, "keep_checkpoints": 0,
    "eval_every": 0, "num_stages": 1,
    "chunks": 1, "beam_size": 1, "max_decode_len": 8, "eval_max_sentences": 2,
    "hold_memory": False, "log_every": 3,
}
QUICK_SEEDS = (0, 1)
QUICK_TEST_SENTENCES = 6  # per language
QUICK_DESIGN = Design(parent_pairs=200, relative_pairs=(20, 30, 40),
                      held_out={"dev": 6, "test": 6})
QUICK_VOCAB = 400


# ---------------------------------------------------------------------------------------------
# Per-sentence statistics, so that every score can be bootstrapped with the same resamples


def sentence_stats(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, np.ndarray]:
    """sacrebleu's sufficient statistics per sentence for BLEU and chrF ([n, k] each)."""
    from sacrebleu.metrics import BLEU, CHRF

    return {
        name: np.asarray(metric._extract_corpus_statistics(list(hypotheses), [list(references)]),
                         dtype=np.float64)
        for name, metric in (("bleu", BLEU()), ("chrf", CHRF()))
    }


_SCORERS: dict[str, Any] = {}


def corpus_score(metric: str, stats: np.ndarray) -> float:
    """sacrebleu's corpus score from summed sentence statistics ([n, k] summed over n)."""
    from sacrebleu.metrics import BLEU, CHRF

    if metric not in _SCORERS:
        _SCORERS[metric] = BLEU() if metric == "bleu" else CHRF()
    return float(_SCORERS[metric]._compute_score_from_stats(list(stats.sum(0))).score)


def signatures() -> dict[str, str]:
    """sacrebleu's signatures of the BLEU and chrF used here."""
    from sacrebleu.metrics import BLEU, CHRF

    result = {}
    for name, metric in (("bleu", BLEU()), ("chrf", CHRF())):
        metric.corpus_score(["a"], [["a"]])
        result[name] = str(metric.get_signature())
    return result


@torch.no_grad()
def sentence_losses(model: torch.nn.Module, config: NMTConfig, sentences: Sequence[Sentence],
                    tokenizer: Any, batch_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Summed cross entropy (nats, no smoothing) of each reference given its source, and its
    token count (EOS included)."""
    pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
    losses = np.zeros(len(sentences))
    counts = np.zeros(len(sentences))
    for start in range(0, len(sentences), batch_size):
        chunk = sentences[start:start + batch_size]
        targets = [tokenizer.encode_target(s.reference)[: config.max_positions - 1] for s in chunk]
        sources = [s.src_ids for s in chunk]  # loaded with max_src_len=max_positions
        width_s = max(map(len, sources))
        width_t = max(map(len, targets)) + 1
        src = torch.full((len(chunk), width_s), pad)
        tgt_in = torch.full((len(chunk), width_t), pad)
        tgt_out = torch.full((len(chunk), width_t), pad)
        for row, (s_ids, t_ids) in enumerate(zip(sources, targets, strict=True)):
            src[row, : len(s_ids)] = torch.tensor(s_ids)
            tgt_in[row, : len(t_ids) + 1] = torch.tensor([bos, *t_ids])
            tgt_out[row, : len(t_ids) + 1] = torch.tensor([*t_ids, eos])
        logits = model((src, tgt_in)).float()
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), tgt_out.flatten(), ignore_index=pad, reduction="none"
        ).view(tgt_out.shape)
        losses[start:start + len(chunk)] = per_token.sum(1).double().numpy()
        counts[start:start + len(chunk)] = tgt_out.ne(pad).sum(1).numpy()
    return losses, counts


# ---------------------------------------------------------------------------------------------
# One run: train, then score its checkpoints


def arch_settings(arch: str, seed: int, *, quick: bool, extra: Mapping[str, Any]) -> dict[str, Any]:
    base = {**QUICK[arch], **QUICK_COMMON} if quick else {"config": ARCHS[arch]}
    return {**base, **extra, "seed": seed, "wandb_mode": "disabled"}


def related_settings(design: Design, *, quick: bool) -> dict[str, Any]:
    """The settings that train on the related-languages corpus of ``design`` (built by the
    script, so the trainer reads it as it is)."""
    settings = {"data_dir": str(RELATED_DIR), "packages": "none",
                "languages": ",".join(design.train_pairs()),
                "bucket_thresholds": ",".join(map(str, design.bucket_thresholds()))}
    return {**settings, "vocab_size": QUICK_VOCAB} if quick else settings


def load_settings(settings: Mapping[str, Any]) -> NMTConfig:
    return load_nmt_config([f"--{k}={v}" for k, v in settings.items() if k != "wandb_mode"])


def check_equal_parameters(configs: Mapping[str, NMTConfig], tolerance: float) -> dict[str, int]:
    """Parameters of each architecture (on meta); an error if they differ by more than
    ``tolerance`` (relative to the larger)."""
    counts = {arch: count_parameters(build_model(c, device="meta")) for arch, c in configs.items()}
    low, high = min(counts.values()), max(counts.values())
    if high - low > tolerance * high:
        raise SystemExit(
            f"error: parameters {counts} differ by {100 * (high - low) / high:.2f}% > "
            f"{100 * tolerance:g}%; size ffn_dim / num_heads so that the models match")
    return counts


def pairs_seen(config: NMTConfig, steps: int) -> dict[str, int]:
    """Training pairs per language in the first ``steps`` batches of the run's stream (the
    stream is a function of the seed and the data settings, so this replays it exactly)."""
    batches = TrainBatches(config.data_dir, max_tokens=config.max_tokens,
                           temperature=config.sampling_temperature, seed=config.seed,
                           languages=config.languages or None, max_len=config.max_len)
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(steps):
        seen.update(next(batches).langs)
    return dict(seen)


def score_checkpoints(out_dir: Path, config: NMTConfig, *, test_per_lang: int | None,
                      beam_size: int) -> dict[str, Any]:
    """Dev loss per language at every checkpoint; test statistics of the best one."""
    from apps.nmt.decoding import train_languages

    tokenizer = load_tokenizer(config.data_dir)
    languages = train_languages(config)
    dev, _ = load_eval_sentences(config.data_dir, "dev", languages, max_per_lang=None,
                                 pad_id=tokenizer.pad_id, strict=False,
                                 max_src_len=config.max_positions)
    records = {r["step"]: r for r in map(json.loads, (out_dir / "log.jsonl").read_text()
                                         .splitlines())}
    curve = []
    for step_dir in sorted(out_dir.glob("step-*")):
        step = int(step_dir.name.split("-")[1])
        # the config the run saved (the trainer may have sized vocab_size to the tokenizer)
        config = load_nmt_config([f"--config={step_dir / 'config.yaml'}"])
        model = load_model(config, step_dir, torch.device("cpu"))
        losses, tokens = sentence_losses(model, config, dev, tokenizer)
        per_lang = {}
        for lang in languages:
            rows = [i for i, s in enumerate(dev) if s.lang == lang]
            if rows:
                per_lang[lang] = float(losses[rows].sum() / tokens[rows].sum())
        curve.append({"step": step, "tokens": records.get(step, {}).get("tokens"),
                      "dev_loss": per_lang,
                      "macro_dev_loss": float(np.mean(list(per_lang.values())))})
    if not curve:
        raise RuntimeError(f"no checkpoints in {out_dir}; the run must write step-* folders "
                           "(ckpt_every > 0)")
    best = min(curve, key=lambda c: (c["macro_dev_loss"], c["step"]))
    model = load_model(config, out_dir / f"step-{best['step']:07d}", torch.device("cpu"))
    test, _ = load_eval_sentences(config.data_dir, "test", languages, max_per_lang=test_per_lang,
                                  pad_id=tokenizer.pad_id, strict=False,
                                  max_src_len=config.max_positions)
    hypotheses = translate(model, test, tokenizer, beam_size=beam_size,
                           alpha=config.length_penalty, max_decode_len=config.max_decode_len,
                           device=torch.device("cpu"))
    assert hypotheses is not None
    losses, tokens = sentence_losses(model, config, test, tokenizer)
    per_lang_test: dict[str, Any] = {}
    for lang in languages:
        rows = [i for i, s in enumerate(test) if s.lang == lang]
        if not rows:
            continue
        refs = [test[i].reference for i in rows]
        stats = sentence_stats([hypotheses[i] for i in rows], refs)
        copy = sentence_stats([test[i].source for i in rows], refs)
        per_lang_test[lang] = {
            "bleu_stats": stats["bleu"].tolist(), "chrf_stats": stats["chrf"].tolist(),
            "copy_bleu_stats": copy["bleu"].tolist(), "copy_chrf_stats": copy["chrf"].tolist(),
            "loss": losses[rows].round(5).tolist(), "tokens": tokens[rows].tolist(),
            "example": {"source": test[rows[0]].source, "reference": refs[0],
                        "hypothesis": hypotheses[rows[0]]},
        }
    return {"dev_curve": curve, "best_step": best["step"], "test": per_lang_test}


def run_one(name: str, arch: str, settings: Mapping[str, Any], *, out: Path, runs_dir: Path,
            quick: bool, timeout_s: float, keep_runs: bool) -> dict[str, Any]:
    config = load_settings(settings)
    started = provenance(config.seed)
    run_dir = runs_dir / name
    if quick:
        run = train_in_process(name, run_dir, settings)
    else:
        run = train(name, run_dir, settings, nproc=config.num_stages, timeout_s=timeout_s,
                    resume=True)
    if run.returncode != 0 or run.summary is None:
        raise SystemExit(f"error: run {name} failed (exit {run.returncode}); see {run_dir}.out "
                         "(no result written: the next call of the script retries it)")
    scores = score_checkpoints(run_dir, config, beam_size=config.beam_size,
                               test_per_lang=QUICK_TEST_SENTENCES if quick else None)
    steps = run.summary["steps"]
    seen = pairs_seen(config, steps)
    train_counts = language_counts(config.data_dir, "train")
    result = {
        "name": name, "experiment": "depth_width", "arch": arch, **started,
        "settings": {k: v for k, v in settings.items() if k != "wandb_mode"},
        "T": [config.num_layers, config.ffn_dim, config.num_heads], "d_model": config.d_model,
        "parameters": count_parameters(build_model(config, device="meta")),
        "scaled_init": config.scaled_init,
        "steps": steps, "tokens": run.summary["tokens"], "stopped_by": run.summary["stopped_by"],
        "resumed": run.resumed,  # continued from a checkpoint after the sweep was stopped
        "train_minutes": run.summary["train_minutes"],
        "tokens_per_second": run.summary["tokens_per_second"],
        "seconds_per_step": (round(run.seconds_per_step, 4)
                             if run.seconds_per_step is not None else None),
        "pairs_seen": seen,
        "epochs": {lang: seen.get(lang, 0) / train_counts[lang] for lang in seen
                   if train_counts.get(lang)},
        **scores,
        "finished_utc": provenance(config.seed)["utc"],
    }
    write_result(out / f"{name}.json", result)
    if not keep_runs:
        drop_checkpoints(run_dir)
    return result


# ---------------------------------------------------------------------------------------------
# The statistic D with a paired bootstrap over seeds and sentences


def bucket_gap(values: Mapping[str, Mapping[str, float]], buckets: Mapping[str, str],
               bucket: str) -> float:
    """(deep - wide) of ``bucket``: the mean over its languages of ``values[arch][lang]``."""
    langs = [lang for lang, b in buckets.items() if b == bucket]
    return float(np.mean([values["deep"][x] - values["wide"][x] for x in langs]))


def bucket_d(values: Mapping[str, Mapping[str, float]], buckets: Mapping[str, str]) -> float:
    """D = (deep - wide)_low - (deep - wide)_high from per-language values
    ``values[arch][lang]``; a bucket's value is the mean over its languages."""
    return bucket_gap(values, buckets, "low") - bucket_gap(values, buckets, "high")


def matched_token_gaps(results: Sequence[Mapping[str, Any]],
                       buckets: Mapping[str, str]) -> list[dict[str, Any]]:
    """Deep - wide in dev loss per bucket, and D, at every checkpoint of every seed that both
    architectures have: the two models at the same step, hence the same tokens (a description
    of the curves beside the design's statistic, which compares best checkpoints)."""
    runs = {(r["arch"], r["seed"]): r for r in results}
    rows = []
    for seed in sorted({seed for arch, seed in runs if arch == "deep" and ("wide", seed) in runs}):
        wide = {c["step"]: c for c in runs["wide", seed]["dev_curve"]}
        for deep in runs["deep", seed]["dev_curve"]:
            if deep["step"] not in wide:
                continue
            values = {"deep": deep["dev_loss"], "wide": wide[deep["step"]]["dev_loss"]}
            gaps = {b: round(bucket_gap(values, buckets, b), 4) for b in ("high", "low")}
            rows.append({"seed": seed, "step": deep["step"], "tokens": deep["tokens"],
                         "deep_minus_wide": gaps, "D": round(gaps["low"] - gaps["high"], 4)})
    return rows


def language_score(metric: str, test: Mapping[str, Any], rows: np.ndarray | None = None,
                   copy: bool = False) -> float:
    """One run's score of one language (rows: a resample of its sentences, or all)."""
    if metric == "loss":
        loss, tokens = np.asarray(test["loss"]), np.asarray(test["tokens"])
        if rows is not None:
            loss, tokens = loss[rows], tokens[rows]
        return float(loss.sum() / tokens.sum())
    stats = np.asarray(test[f"{'copy_' if copy else ''}{metric}_stats"])
    return corpus_score(metric, stats if rows is None else stats[rows])


def d_statistic(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], buckets: Mapping[str, str],
                metric: str, *, n_boot: int, seed: int = 12345) -> dict[str, Any]:
    """Point estimate of D for ``metric`` and its 95% intervals.

    ``runs[arch][seed]`` is a run's ``test`` dict (per language); only seeds that both
    architectures have are used (the caller leaves out a seed whose two runs ran on different
    machines). ``ci95`` is the t interval over the seeds' own D values (``per_seed``): with 3
    seeds a bootstrap that resamples seeds cannot reach beyond the seeds observed, and its
    interval is 2-3x too narrow. ``ci95_bootstrap`` keeps the paired bootstrap beside it (each
    replicate draws seeds with replacement, shared by the architectures, and per language
    sentences with replacement, shared by every run); with one seed it is the only interval
    (sentences only), and ``ci95`` is that one."""
    seeds = sorted(set(runs["deep"]) & set(runs["wide"]))
    langs = [lang for lang in buckets if all(lang in runs[a][s] for a in runs for s in seeds)]
    buckets = {lang: buckets[lang] for lang in langs}
    if not seeds or not {"low", "high"} <= set(buckets.values()):
        return {"seeds": seeds, "point": None, "ci95": None,
                "note": "needs both architectures for a seed and languages in low and high"}

    def values_for(seed_list: Sequence[int], rows: Mapping[str, np.ndarray] | None) -> float:
        values = {arch: {lang: float(np.mean([
            language_score(metric, runs[arch][s][lang], None if rows is None else rows[lang])
            for s in seed_list])) for lang in langs} for arch in ("deep", "wide")}
        return bucket_d(values, buckets)

    point = values_for(seeds, None)
    per_seed = {s: values_for([s], None) for s in seeds}
    rng = np.random.default_rng(seed)
    sizes = {lang: len(runs["deep"][seeds[0]][lang]["loss"]) for lang in langs}
    samples = []
    for _ in range(n_boot):
        drawn = [seeds[i] for i in rng.integers(0, len(seeds), size=len(seeds))]
        rows = {lang: rng.integers(0, n, size=n) for lang, n in sizes.items()}
        samples.append(values_for(drawn, rows))
    low, high = np.percentile(samples, [2.5, 97.5])
    over_seeds = t_interval(list(per_seed.values()))
    one_seed = over_seeds["ci95"] is None
    return {"seeds": seeds, "languages": buckets, "point": point,
            "per_seed": {str(s): v for s, v in per_seed.items()},
            "ci95": [float(low), float(high)] if one_seed else over_seeds["ci95"],
            "ci95_method": ("bootstrap over sentences (one seed: nothing resamples seeds)"
                            if one_seed else "t over seeds' D (df = seeds - 1)"),
            "sd_over_seeds": over_seeds["sd"],
            "ci95_bootstrap": [float(low), float(high)], "n_boot": n_boot}


def same_machine_seeds(results: Sequence[Mapping[str, Any]], folder: str,
                       records: Mapping[str, Any] | None = None) -> tuple[list[int], dict[str, str]]:
    """The seeds whose deep and wide runs ran on one machine (``scripts.nmt_runs.comparable``,
    ``machines.json`` for older results), and the others with the reason they are left out."""
    records = machine_records() if records is None else records
    by = {(r["arch"], r["seed"]): r for r in results}
    kept, left_out = [], {}
    for seed in sorted({s for a, s in by if a == "deep" and ("wide", s) in by}):
        deep, wide = by["deep", seed], by["wide", seed]
        if comparable(deep, wide, keys=(f"{folder}/{deep['name']}", f"{folder}/{wide['name']}"),
                      records=records):
            kept.append(seed)
        else:
            left_out[str(seed)] = "deep and wide ran on different machines"
    return kept, left_out


def above_copy(results: Sequence[Mapping[str, Any]], buckets: Mapping[str, str]) -> bool:
    """Whether every run's high-bucket test BLEU (mean over its languages) is above
    copy-the-source."""
    high = [lang for lang, b in buckets.items() if b == "high"]
    for result in results:
        test = result["test"]
        model = np.mean([language_score("bleu", test[x]) for x in high if x in test])
        copy = np.mean([language_score("bleu", test[x], copy=True) for x in high if x in test])
        if not model > copy:
            return False
    return True


def summarise(results: Sequence[Mapping[str, Any]], n_boot: int, folder: str = "depth_width",
              records: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """D per metric over the seeds whose two runs share a machine, and the descriptions beside
    it; ``folder`` names the results' folder under docs/reproduction/ (``machines.json``'s
    keys)."""
    if not results:
        return {"runs": 0}
    config = load_nmt_config([f"--{k}={v}" for k, v in results[0]["settings"].items()])
    try:
        train_counts = language_counts(config.data_dir, "train")
    except (CorpusError, OSError):
        # the corpus is not prepared in this checkout: the training-pair counts the last
        # report read from it (the report is then a re-reading of the same runs)
        previous = REPO / "docs" / "reproduction" / folder / "_summary.json"
        if not previous.exists():
            raise
        train_counts = json.loads(previous.read_text())["train_pairs"]
    languages = sorted({lang for r in results for lang in r["test"]})
    buckets = resource_buckets({x: train_counts.get(x, 0) for x in languages},
                               config.bucket_thresholds)
    kept, left_out = same_machine_seeds(results, folder, records)
    runs: dict[str, dict[int, Any]] = {"deep": {}, "wide": {}}
    for r in results:
        if r["seed"] in kept:
            runs[r["arch"]][r["seed"]] = r["test"]
    summary: dict[str, Any] = {
        "runs": len(results),
        "buckets": buckets,
        "train_pairs": {x: train_counts.get(x, 0) for x in languages},
        "parameters": {r["arch"]: r["parameters"] for r in results},
        "tokens": sorted({r["tokens"] for r in results}),
        "epochs_per_bucket": {
            f"{r['arch']}_s{r['seed']}": {
                b: float(np.mean([r["epochs"].get(x, 0.0) for x in languages if buckets[x] == b]))
                for b in sorted(set(buckets.values()))}
            for r in results},
        "best_step": {f"{r['arch']}_s{r['seed']}": r["best_step"] for r in results},
        "above_copy": above_copy(results, buckets),
        "D": {metric: d_statistic(runs, buckets, metric, n_boot=n_boot) for metric in METRICS},
        "seeds_left_out": left_out,
        "dev_loss_matched_tokens": matched_token_gaps(results, buckets),
    }
    if not summary["above_copy"]:
        for metric in ("bleu", "chrf"):
            summary["D"][metric]["below_copy"] = True
    return summary


def plot(results: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    buckets = summary["buckets"]
    names = sorted(set(buckets.values()))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, bucket in zip(axes[0], names, strict=True):
        for r in results:
            curve = r["dev_curve"]
            xs = [c["tokens"] or c["step"] for c in curve]
            ys = [np.mean([c["dev_loss"][x] for x in c["dev_loss"] if buckets.get(x) == bucket])
                  for c in curve]
            ax.plot(xs, ys, "-o", markersize=3, color="C0" if r["arch"] == "deep" else "C1",
                    label=f"{r['arch']} s{r['seed']}", linewidth=1)
        ax.set_title(f"{bucket} bucket: mean dev loss", fontsize=10)
        ax.set_xlabel("training tokens (source + target)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("dev loss (nats/token)")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, dpi=90)


def plot_languages(results: Sequence[Mapping[str, Any]], summary: Mapping[str, Any],
                   path: Path) -> None:
    """Every language's dev loss against tokens, deep and wide, one line per run: the curves
    at matched tokens behind each bucket's mean (high bucket first, then by training pairs)."""
    plt = pyplot()
    buckets, pairs = summary["buckets"], summary["train_pairs"]
    languages = sorted(buckets, key=lambda x: (buckets[x] != "high", -pairs.get(x, 0), x))
    columns = min(6, len(languages))
    rows = -(-len(languages) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.2 * rows), squeeze=False,
                             sharex=True)
    for ax, lang in zip(axes.flat, languages, strict=False):  # spare panels hidden below
        for r in results:
            curve = [c for c in r["dev_curve"] if lang in c["dev_loss"]]
            ax.plot([c["tokens"] or c["step"] for c in curve],
                    [c["dev_loss"][lang] for c in curve], "-", linewidth=1,
                    color="C0" if r["arch"] == "deep" else "C1",
                    label=r["arch"] if r["seed"] == results[0]["seed"] else None)
        ax.set_title(f"{lang} ({buckets[lang]}, {pairs.get(lang, 0):,} pairs)", fontsize=8)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(languages):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("dev loss (nats/token)", fontsize=7)
    axes[0][0].legend(fontsize=6)
    fig.supxlabel("training tokens (source + target); one line per run", fontsize=8)
    save_figure(fig, path, dpi=80)


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", default="all", choices=["all", "train", "report"])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one process each)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--corpus", default="real", choices=CORPORA,
                        help="the real mix, or the controlled complement of related synthetic "
                             "languages (data.related_languages)")
    parser.add_argument("--english-from", type=Path, default=None,
                        help="--corpus related: a prepared corpus whose English is written (by "
                             "default the real mix's, prepared first if missing)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results (default {OUT['real']}, or {OUT['related']})")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help=f"checkpoints (default {RUNS['real']}, or {RUNS['related']})")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="apps.nmt.train settings for every run (recorded in each result)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 seeds (tests)")
    parser.add_argument("--keep-runs", action="store_true", help="keep checkpoints of runs")
    parser.add_argument("--timeout-minutes", type=float, default=180.0, help="per run")
    add_draft_argument(parser)
    args = parser.parse_args(argv)
    # a published result from a dirty tree is refused now, not after the run (issue 40)
    set_draft(args.draft)
    refuse_dirty_tree(args.out or OUT[args.corpus])
    started = time.monotonic()
    args.out = args.out or OUT[args.corpus]
    args.runs_dir = args.runs_dir or RUNS[args.corpus]
    extra: dict[str, Any] = parse_settings(args.set)
    design = QUICK_DESIGN if args.quick else DESIGN
    if args.corpus == "related":
        extra = {**related_settings(design, quick=args.quick), **extra}
    seeds = args.seeds if args.seeds is not None else list(QUICK_SEEDS if args.quick else SEEDS)
    specs = {f"{arch}_s{seed}": (arch, arch_settings(arch, seed, quick=args.quick, extra=extra))
             for seed in seeds for arch in ARCHS}
    configs = {arch: load_settings(arch_settings(arch, seeds[0], quick=args.quick, extra=extra))
               for arch in ARCHS}
    # the design's equal size is checked before anything trains (quick: recorded only)
    parameters = check_equal_parameters(configs, 1.0 if args.quick else PARAMETER_TOLERANCE)
    ran: list[str] = []
    if args.phase in ("all", "train"):
        # the corpus once, here, before runs start in parallel (each would build it otherwise)
        from apps.nmt.train import prepare_corpus

        if args.corpus == "related":
            english_from = args.english_from
            if english_from is None:
                real = load_settings(arch_settings("deep", seeds[0], quick=False, extra={}))
                prepare_corpus(real)
                english_from = real.data_dir
            build_related(configs["deep"].data_dir, english_from=english_from, design=design,
                          vocab_size=configs["deep"].vocab_size,
                          seed=configs["deep"].corpus_seed)
        prepare_corpus(configs["deep"])

        def work(name: str) -> None:
            arch, settings = specs[name]
            run_one(name, arch, settings, out=args.out, runs_dir=args.runs_dir,
                    quick=args.quick, timeout_s=60 * args.timeout_minutes,
                    keep_runs=args.keep_runs)

        ran = run_pending(list(specs), args.out, work, jobs=1 if args.quick else args.jobs)
    results = read_results(args.out)
    summary = summarise(results, args.bootstrap, folder=Path(args.out).name)
    summary.update({"design": {"archs": {a: specs[f"{a}_s{seeds[0]}"][1] for a in ARCHS},
                               "seeds": seeds, "parameters": parameters,
                               "parameter_tolerance": PARAMETER_TOLERANCE},
                    "ran_now": ran, "signatures": signatures(),
                    "wall_minutes": round((time.monotonic() - started) / 60, 2),
                    **provenance(0)})
    if results:
        write_result(args.out / "_summary.json", summary)
        plot(results, summary, args.out / "_dev_loss.png")
        plot_languages(results, summary, args.out / "_dev_loss_languages.png")
        for metric, d in summary["D"].items():
            print(f"D[{metric}] = {d['point']} 95% {d['ci95']} (seeds {d['seeds']})")
    else:
        print(f"no results in {args.out} yet: nothing to report", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
