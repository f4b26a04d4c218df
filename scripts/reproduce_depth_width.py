"""The paper's depth-against-width finding at CPU scale, with the capacity step before it.

    python scripts/reproduce_depth_width.py        # or: make reproduce-depth-width
        [--deep cpu_deep] [--wide cpu_wide] [--small cpu_t6] [--steps N] [--set key=value ...]
        [--runs-dir runs/depth_width] [--out docs/reproduction] [--bootstrap 1000]

Trains three models (configs of ``apps/nmt/configs/``: ``deep``, a deep-narrow T(24, H, A),
``wide``, a shallow-wide T(12, 2H, 2A) with equal parameters, and ``small``, T(6, H, A)) with
``apps.nmt.train`` under
torchrun on 2 pipeline stages, for the same number of steps over the same batch stream (same
seed, same ``max_tokens``: the same tokens, in the same order) with the same optimiser. Then,
for every model, beam-search translations of the whole test split and of dev + test pooled
("held-out": dev is never used to choose anything here), and the cross entropy of every
reference. Per language: BLEU and chrF (sacrebleu) with 95% bootstrap intervals, copy-the-source
scores, held-out loss. Per resource bucket (training pairs: high >= 10k, low < 1k): the mean
over its languages, and the paired-bootstrap difference between models (deep - wide and deep -
small) with its 95% interval. Writes ``<out>/depth_width.json`` and ``<out>/depth_width.png``
(per-language BLEU difference sorted by training-set size, as in the paper's figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apps.nmt.config import NMTConfig, load_nmt_config  # noqa: E402
from apps.nmt.data import language_counts, load_tokenizer, resource_buckets  # noqa: E402
from apps.nmt.evaluate import (  # noqa: E402
    Sentence,
    load_eval_sentences,
    load_model,
    resolve_checkpoint,
    train_languages,
    translate,
)
from scripts.nmt_runs import Run, parse_settings, read_log, train  # noqa: E402

BUCKETS = ("high", "medium", "low")
# (name, minuend, subtrahend): the paper's two comparisons
ROLES = ("deep", "wide", "small")
COMPARISONS = (("deep_minus_wide", "deep", "wide"), ("deep_minus_small", "deep", "small"))


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


def corpus_score(metric: str, stats: np.ndarray) -> float:
    """sacrebleu's corpus score from summed sentence statistics."""
    from sacrebleu.metrics import BLEU, CHRF

    scorer = BLEU() if metric == "bleu" else CHRF()
    return float(scorer._compute_score_from_stats(list(stats.sum(0))).score)


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
        sources = [s.src_ids[: config.max_positions] for s in chunk]
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
# Evaluation of one trained model


def evaluate_run(out_dir: Path, split_sets: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """Translations, sentence statistics and losses of one run's final checkpoint for every
    named set of splits (e.g. {"test": ["test"], "held_out": ["dev", "test"]})."""
    checkpoint = resolve_checkpoint(out_dir)
    config = load_nmt_config([f"--config={checkpoint / 'config.yaml'}"])
    tokenizer = load_tokenizer(config.data_dir)
    model = load_model(config, checkpoint, torch.device("cpu"))
    languages = train_languages(config)
    per_split: dict[str, dict[str, Any]] = {}
    for split in sorted({s for splits in split_sets.values() for s in splits}):
        sentences, _ = load_eval_sentences(config.data_dir, split, languages, max_per_lang=None,
                                           pad_id=tokenizer.pad_id, strict=False)
        hypotheses = translate(model, sentences, tokenizer, beam_size=config.beam_size,
                               alpha=config.length_penalty, max_decode_len=config.max_decode_len,
                               device=torch.device("cpu"))
        assert hypotheses is not None
        losses, tokens = sentence_losses(model, config, sentences, tokenizer)
        per_split[split] = {"sentences": sentences, "hypotheses": hypotheses,
                            "losses": losses, "tokens": tokens}
    result: dict[str, Any] = {}
    for name, splits in split_sets.items():
        sentences = [s for split in splits for s in per_split[split]["sentences"]]
        hypotheses = [h for split in splits for h in per_split[split]["hypotheses"]]
        losses = np.concatenate([per_split[split]["losses"] for split in splits])
        tokens = np.concatenate([per_split[split]["tokens"] for split in splits])
        by_lang: dict[str, dict[str, Any]] = {}
        for lang in languages:
            rows = [i for i, s in enumerate(sentences) if s.lang == lang]
            if not rows:
                continue
            refs = [sentences[i].reference for i in rows]
            by_lang[lang] = {
                "stats": sentence_stats([hypotheses[i] for i in rows], refs),
                "copy_stats": sentence_stats([sentences[i].source for i in rows], refs),
                "loss": losses[rows],
                "tokens": tokens[rows],
                "example": {"source": sentences[rows[0]].source, "reference": refs[0],
                            "hypothesis": hypotheses[rows[0]]},
            }
        result[name] = by_lang
    return result


# ---------------------------------------------------------------------------------------------
# Scores with bootstrap intervals


def signatures() -> dict[str, str]:
    """sacrebleu's signatures of the BLEU and chrF used here (known once a metric has run)."""
    from sacrebleu.metrics import BLEU, CHRF

    result = {}
    for name, metric in (("bleu", BLEU()), ("chrf", CHRF())):
        metric.corpus_score(["a"], [["a"]])
        result[name] = str(metric.get_signature())
    return result


def interval(samples: np.ndarray) -> list[float]:
    low, high = np.percentile(samples, [2.5, 97.5])
    return [round(float(low), 2), round(float(high), 2)]


def score_set(evals: Mapping[str, Mapping[str, Any]], buckets: Mapping[str, str],
              train_counts: Mapping[str, int], n_boot: int, seed: int = 12345) -> dict[str, Any]:
    """Per-language and per-bucket scores with 95% intervals for every model, and the paired
    differences of ``COMPARISONS``; every model is scored on the same resamples."""
    models = list(evals)
    languages = sorted(set.intersection(*(set(e) for e in evals.values())),
                       key=lambda lang: (-train_counts.get(lang, 0), lang))
    rng = np.random.default_rng(seed)
    # samples[metric][model][lang] -> [n_boot] scores
    samples: dict[str, dict[str, dict[str, np.ndarray]]] = {
        m: {model: {} for model in [*models, "copy"]} for m in ("bleu", "chrf", "loss")
    }
    point: dict[str, dict[str, dict[str, float]]] = {
        m: {model: {} for model in [*models, "copy"]} for m in ("bleu", "chrf", "loss")
    }
    for lang in languages:
        n = len(evals[models[0]][lang]["loss"])
        index = rng.integers(0, n, size=(n_boot, n))
        for model in [*models, "copy"]:
            source = evals[models[0]][lang] if model == "copy" else evals[model][lang]
            stats = source["copy_stats"] if model == "copy" else source["stats"]
            for metric in ("bleu", "chrf"):
                point[metric][model][lang] = corpus_score(metric, stats[metric])
                samples[metric][model][lang] = np.array(
                    [corpus_score(metric, stats[metric][idx]) for idx in index])
            if model != "copy":
                loss, tokens = source["loss"], source["tokens"]
                point["loss"][model][lang] = float(loss.sum() / tokens.sum())
                samples["loss"][model][lang] = loss[index].sum(1) / tokens[index].sum(1)

    def summary(metric: str, model: str, langs: Sequence[str]) -> dict[str, Any]:
        value = float(np.mean([point[metric][model][lang] for lang in langs]))
        boot = np.mean([samples[metric][model][lang] for lang in langs], axis=0)
        return {"mean": round(value, 3 if metric == "loss" else 2), "ci95": interval(boot)}

    per_language = {}
    for lang in languages:
        row: dict[str, Any] = {
            "bucket": buckets[lang], "train_pairs": int(train_counts.get(lang, 0)),
            "sentences": len(evals[models[0]][lang]["loss"]),
        }
        for metric in ("bleu", "chrf", "loss"):
            for model in [*models, "copy"]:
                if model == "copy" and metric == "loss":
                    continue
                row[f"{model}_{metric}"] = summary(metric, model, [lang])
        for name, a, b in COMPARISONS:
            if a in models and b in models:
                for metric in ("bleu", "loss"):
                    diff = samples[metric][a][lang] - samples[metric][b][lang]
                    value = point[metric][a][lang] - point[metric][b][lang]
                    row[f"{name}_{metric}"] = {"mean": round(value, 3), "ci95": interval(diff)}
        per_language[lang] = row
    per_bucket = {}
    for bucket in BUCKETS:
        langs = [lang for lang in languages if buckets[lang] == bucket]
        if not langs:
            continue
        row = {"languages": langs, "sentences": sum(per_language[x]["sentences"] for x in langs)}
        for metric in ("bleu", "chrf", "loss"):
            for model in [*models, "copy"]:
                if model == "copy" and metric == "loss":
                    continue
                row[f"{model}_{metric}"] = summary(metric, model, langs)
        for name, a, b in COMPARISONS:
            if a in models and b in models:
                for metric in ("bleu", "chrf", "loss"):
                    diff = (np.mean([samples[metric][a][x] for x in langs], axis=0)
                            - np.mean([samples[metric][b][x] for x in langs], axis=0))
                    value = (np.mean([point[metric][a][x] for x in langs])
                             - np.mean([point[metric][b][x] for x in langs]))
                    row[f"{name}_{metric}"] = {"mean": round(float(value), 3),
                                               "ci95": interval(diff)}
        per_bucket[bucket] = row
    return {"languages": per_language, "buckets": per_bucket}


def plot(scores: Mapping[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    langs = list(scores["languages"])
    rows = [scores["languages"][x] for x in langs]
    comparisons = [(name, f"{a} - {b}") for name, a, b in COMPARISONS if f"{name}_bleu" in rows[0]]
    fig, axes = plt.subplots(len(comparisons), 2, figsize=(14, 4 * len(comparisons)), squeeze=False)
    x = np.arange(len(langs))
    colors = {"high": "tab:blue", "medium": "tab:orange", "low": "tab:red"}
    for row_axes, (name, label) in zip(axes, comparisons, strict=True):
        for ax, metric, unit in ((row_axes[0], "bleu", "BLEU"), (row_axes[1], "loss", "nats/token")):
            means = [r[f"{name}_{metric}"]["mean"] for r in rows]
            low = [r[f"{name}_{metric}"]["mean"] - r[f"{name}_{metric}"]["ci95"][0] for r in rows]
            high = [r[f"{name}_{metric}"]["ci95"][1] - r[f"{name}_{metric}"]["mean"] for r in rows]
            ax.bar(x, means, color=[colors[r["bucket"]] for r in rows])
            ax.errorbar(x, means, yerr=[low, high], fmt="none", ecolor="black", capsize=2)
            ax.axhline(0, color="gray", linewidth=0.8)
            ax.set_xticks(x)
            ax.set_xticklabels([f"{lang}\n{r['train_pairs']}" for lang, r in zip(langs, rows,
                                                                                  strict=True)],
                               fontsize=7)
            ax.set_ylabel(f"{label}: {'BLEU' if metric == 'bleu' else 'held-out loss'} ({unit})")
            ax.grid(axis="y", alpha=0.3)
        row_axes[0].set_title(f"{label}: BLEU difference per language (95% bootstrap), "
                              "sorted by training pairs", fontsize=9)
        row_axes[1].set_title(f"{label}: loss difference (negative = first model better)",
                              fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deep", default="cpu_deep", help="config of the deep-narrow model")
    parser.add_argument("--wide", default="cpu_wide", help="config of the shallow-wide model")
    parser.add_argument("--small", default="cpu_t6", help="config of the smaller model")
    parser.add_argument("--steps", type=int, default=None, help="override every config's max_steps")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more apps.nmt.train settings for every run")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/depth_width"))
    parser.add_argument("--out", type=Path, default=Path("docs/reproduction"))
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for evaluation")
    parser.add_argument("--skip-training", action="store_true",
                        help="evaluate the runs already in --runs-dir")
    parser.add_argument("--reuse", action="store_true",
                        help="train only the roles without a finished run (summary.json) in "
                             "--runs-dir; evaluate all")
    parser.add_argument("--timeout-minutes", type=float, default=90.0, help="per run")
    args = parser.parse_args(argv)
    started = time.monotonic()
    extra = parse_settings(args.set)
    runs: dict[str, dict[str, Any]] = {}
    configs = {"deep": args.deep, "wide": args.wide, "small": args.small}
    for name in ROLES:
        settings: dict[str, Any] = {"config": configs[name], "wandb_mode": "disabled",
                                    "eval_max_sentences": 20, **extra}
        if args.steps is not None:
            settings["max_steps"] = args.steps
        out_dir = args.runs_dir / name
        if args.skip_training or (args.reuse and (out_dir / "summary.json").exists()):
            run = Run(name, out_dir, settings, 0, 0.0)
            run.summary = json.loads((out_dir / "summary.json").read_text())
            run.records = read_log(out_dir)
        else:
            run = train(name, out_dir, settings, timeout_s=60 * args.timeout_minutes)
            if run.returncode != 0:
                raise SystemExit(f"error: training {name} failed (exit {run.returncode}); see "
                                 f"{out_dir}.out")
        assert run.summary is not None
        config = load_nmt_config([f"--config={out_dir / 'config.yaml'}"])
        from apps.nmt.config import build_model
        from apps.nmt.model import count_parameters

        runs[name] = {
            "config": configs[name],
            "T": [config.num_layers, config.ffn_dim, config.num_heads],
            "d_model": config.d_model, "head_dim": config.head_dim,
            "parameters": count_parameters(build_model(config, device="meta")),
            "steps": run.summary["steps"], "tokens": run.summary["tokens"],
            "stopped_by": run.summary["stopped_by"],
            "train_minutes": run.summary["train_minutes"],
            "tokens_per_second": run.summary["tokens_per_second"],
            "final_train_loss": (run.records[-1]["loss"] if run.records else None),
            "dev_loss": run.summary["dev_loss"],
        }
    torch.set_num_threads(args.threads)
    split_sets = {"test": ["test"], "held_out": ["dev", "test"]}
    evals = {name: evaluate_run(args.runs_dir / name, split_sets) for name in ROLES}
    config = load_nmt_config([f"--config={args.runs_dir / 'deep' / 'config.yaml'}"])
    train_counts = language_counts(config.data_dir, "train")
    trained = train_languages(config)
    buckets = resource_buckets({x: train_counts.get(x, 0) for x in trained},
                               config.bucket_thresholds)
    scores = {name: score_set({m: evals[m][name] for m in ROLES}, buckets, train_counts,
                              args.bootstrap) for name in split_sets}
    examples = {m: {lang: e["example"] for lang, e in evals[m]["test"].items()}
                for m in ROLES}
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python scripts/reproduce_depth_width.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": runs,
        "languages": {x: {"train_pairs": int(train_counts.get(x, 0)), "bucket": buckets[x]}
                      for x in trained},
        "sampling_temperature": config.sampling_temperature,
        "bucket_thresholds": config.bucket_thresholds,
        "bootstrap_resamples": args.bootstrap,
        "signatures": signatures(),
        "test": scores["test"],
        "held_out": scores["held_out"],
        "examples": {m: dict(list(v.items())[:3]) for m, v in examples.items()},
        "wall_minutes": round((time.monotonic() - started) / 60, 1),
    }
    (args.out / "depth_width.json").write_text(json.dumps(result, indent=1, ensure_ascii=False)
                                               + "\n")
    deep = runs["deep"]
    plot(scores["held_out"], args.out / "depth_width.png",
         f"held-out (dev + test) per language, {deep['tokens'] / 1e6:.2f}M training tokens each; "
         + ", ".join(f"{m} T{tuple(r['T'])} {r['parameters'] / 1e6:.2f}M" for m, r in runs.items()))
    for split, score in scores.items():
        for bucket, row in score["buckets"].items():
            line = "  ".join(f"{m} {row[f'{m}_bleu']['mean']:.2f}" for m in [*ROLES, "copy"])
            diffs = "  ".join(f"{name} {row[f'{name}_bleu']['mean']:+.2f} {row[f'{name}_bleu']['ci95']}"
                              for name, a, b in COMPARISONS if f"{name}_bleu" in row)
            print(f"{split:<9}{bucket:<7} BLEU {line}  {diffs}")
    return result


if __name__ == "__main__":
    main()
