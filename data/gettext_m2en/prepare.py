"""Build the many-to-English gettext corpus: catalogs -> cleaned pairs -> splits -> SentencePiece -> shards.

    python -m data.gettext_m2en.prepare --out .cache/gettext_m2en

``prepare`` composes the phases, one module each: ``fetch`` (Debian packages and their ``.mo``
catalogs), ``clean`` (pairs read by ``read``, cleaned, deduplicated, languages selected),
``splits`` (leak-free train / dev / test, ``pairs/*.tsv``, counts), ``tokenizer``
(SentencePiece), ``shards`` (token ids); the manifest last (``corpus_format``, the on-disk
format that the NMT app reads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.gettext_m2en.clean import collect_pairs, select_languages
from data.gettext_m2en.corpus_format import (
    DEFAULT_OUT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    build_manifest,
    lang_tag,
    read_manifest,
    shard_entry,
    write_manifest,
)
from data.gettext_m2en.errors import PrepareError
from data.gettext_m2en.fetch import gather_catalogs, resolve_packages
from data.gettext_m2en.lock import corpus_lock
from data.gettext_m2en.shards import write_corpus_shards
from data.gettext_m2en.splits import split_corpus
from data.gettext_m2en.tokenizer import train_tokenizer


def prepare(
    out: str | Path = DEFAULT_OUT,
    *,
    packages: str | Sequence[str] | None = "quick",
    locale_roots: Sequence[str | Path] = (),
    tsv_files: Sequence[str | Path] = (),
    aligned_dirs: Sequence[str | Path] = (),
    languages: Sequence[str] | None = None,
    vocab_size: int = 8000,
    spm_temperature: float = 5.0,
    spm_max_sentences: int = 200_000,
    max_chars: int = 256,
    dev_fraction: float = 0.02,
    test_fraction: float = 0.02,
    block_size: int = 1024,
    seed: int = 0,
    num_threads: int = 2,
    force: bool = False,
    verbose: bool = True,
) -> dict[str, Any]:
    """Build (or reuse) the corpus under `out` and return its manifest.

    Sources, combined: Debian `packages` fetched with apt (`"quick"`, `"full"`, names, or None),
    catalogs under `locale_roots` (any tree holding `.mo` files), `tsv_files` and
    `aligned_dirs` (see `read_tsv`, `read_aligned_dir`). When apt is unavailable the packages
    are replaced by the catalogs installed under /usr/share/locale. `languages` keeps only those
    source languages (normalised names, e.g. `["de", "fr", "pt_BR"]`), so the tokenizer's
    vocabulary is spent on them; None keeps all.

    Writes under `out`: `pairs/{train,dev,test}.tsv`, `counts.json`, `spm/spm.model`,
    `shards/{split}-NNNNNN.tar` and, last, `manifest.json`. If a manifest with the same settings
    exists, nothing is rebuilt (unless `force`). The whole runs under the lock `<out>.lock`
    (`data.gettext_m2en.lock`): processes started together build the corpus once.
    """
    started = time.monotonic()
    out = Path(out)
    package_names = resolve_packages(packages)
    config = {
        "packages": list(package_names),
        "locale_roots": [str(Path(p).resolve()) for p in locale_roots],
        "tsv_files": [str(Path(p).resolve()) for p in tsv_files],
        "aligned_dirs": [str(Path(p).resolve()) for p in aligned_dirs],
        "languages": sorted(languages) if languages is not None else None,
        "vocab_size": vocab_size,
        "spm_temperature": spm_temperature,
        "spm_max_sentences": spm_max_sentences,
        "max_chars": max_chars,
        "dev_fraction": dev_fraction,
        "test_fraction": test_fraction,
        "block_size": block_size,
        "seed": seed,
    }
    with corpus_lock(out):  # one builder at a time; the others then find it built
        manifest = read_manifest(out)
        if manifest is not None and not force:
            if manifest.get("config") == config and manifest.get("format") == FORMAT_VERSION:
                return manifest

        def log(message: str) -> None:
            if verbose:
                print(f"[gettext_m2en {time.monotonic() - started:6.1f}s] {message}", file=sys.stderr)

        if not (package_names or locale_roots or tsv_files or aligned_dirs):
            raise PrepareError(
                "no corpus source given; pass packages='quick' (or --packages quick), "
                "locale_roots, tsv_files or aligned_dirs"
            )
        if not (dev_fraction >= 0 and test_fraction >= 0 and dev_fraction + test_fraction < 1):
            raise ValueError(
                f"dev_fraction={dev_fraction}, test_fraction={test_fraction}: "
                "each must be >= 0 and their sum < 1"
            )
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST_FILE).unlink(missing_ok=True)  # a half-built corpus must not look finished

        catalogs, sources = gather_catalogs(package_names, locale_roots, out, log,
                                            has_user_corpora=bool(tsv_files or aligned_dirs))
        pairs = collect_pairs(catalogs, tsv_files, aligned_dirs, max_chars=max_chars, log=log)
        sources += [f"tsv:{p}" for p in tsv_files] + [f"aligned:{d}" for d in aligned_dirs]
        kept = select_languages(pairs, languages, sources)
        log(f"{pairs.raw_pairs} raw pairs -> {len(kept)} unique clean pairs; "
            f"dropped {dict(pairs.dropped)}")
        splits, counts, kept_languages = split_corpus(
            pairs.triples, kept, out, dev_fraction=dev_fraction, test_fraction=test_fraction, log=log
        )

        import sentencepiece as spm

        model_path = train_tokenizer(
            splits["train"],
            out / "spm",
            vocab_size=vocab_size,
            temperature=spm_temperature,
            max_sentences=spm_max_sentences,
            seed=seed,
            num_threads=num_threads,
        )
        sp = spm.SentencePieceProcessor(model_file=str(model_path))
        log(f"sentencepiece: {sp.get_piece_size()} pieces (asked {vocab_size})")
        id_dtype, shard_files = write_corpus_shards(splits, out / "shards", sp=sp,
                                                    block_size=block_size)

        elapsed = time.monotonic() - started
        manifest = build_manifest(
            config=config,
            sources=sources,
            vocab_size=sp.get_piece_size(),
            id_dtype=id_dtype.name,
            lang_tags={lang: sp.piece_to_id(lang_tag(lang)) for lang in kept_languages},
            split_pairs={split: len(rows) for split, rows in splits.items()},
            shard_files=shard_files,
            shard_hashes={split: {name: shard_entry(out / "shards" / name) for name in names}
                          for split, names in shard_files.items()},
            stats={
                "catalogs": len(catalogs),
                "raw_pairs": pairs.raw_pairs,
                "unique_pairs": len(kept),
                "dropped": dict(pairs.dropped),
                "languages": len(kept_languages),
                "languages_10k_plus": sum(1 for n in counts["total"].values() if n >= 10_000),
                "languages_under_1k": sum(1 for n in counts["total"].values() if n < 1_000),
                "seconds": round(elapsed, 1),
            },
        )
        write_manifest(out, manifest)
        log(f"done in {elapsed:.1f}s: {manifest['stats']}")
        return manifest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m data.gettext_m2en.prepare",
        description="Build the many-to-English corpus from gettext catalogs (see README.md).",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="cache directory")
    parser.add_argument(
        "--packages",
        default=None,
        help="'quick' (default unless another source is given), 'full', 'none' or pkg1,pkg2",
    )
    parser.add_argument(
        "--locale-root",
        action="append",
        default=[],
        type=Path,
        help="a tree holding .mo catalogs (repeatable)",
    )
    parser.add_argument(
        "--tsv",
        action="append",
        default=[],
        type=Path,
        help="a lang<TAB>source<TAB>english file (repeatable)",
    )
    parser.add_argument(
        "--aligned",
        action="append",
        default=[],
        type=Path,
        help="a directory of aligned <stem>.<lang> / <stem>.en files (repeatable)",
    )
    parser.add_argument(
        "--languages",
        default=None,
        help="keep only these source languages, e.g. de,fr,pt_BR (default all)",
    )
    parser.add_argument("--vocab-size", type=int, default=8000, help="8000 for CPU, 64000 paper")
    parser.add_argument("--spm-temperature", type=float, default=5.0)
    parser.add_argument("--spm-max-sentences", type=int, default=200_000)
    parser.add_argument("--max-chars", type=int, default=256)
    parser.add_argument("--dev-fraction", type=float, default=0.02)
    parser.add_argument("--test-fraction", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    packages: str | None = args.packages
    if packages is None and not (args.locale_root or args.tsv or args.aligned):
        packages = "quick"
    if packages == "none":
        packages = None
    try:
        manifest = prepare(
            args.out,
            packages=packages,
            locale_roots=args.locale_root,
            tsv_files=args.tsv,
            aligned_dirs=args.aligned,
            languages=args.languages.split(",") if args.languages else None,
            vocab_size=args.vocab_size,
            spm_temperature=args.spm_temperature,
            spm_max_sentences=args.spm_max_sentences,
            max_chars=args.max_chars,
            dev_fraction=args.dev_fraction,
            test_fraction=args.test_fraction,
            seed=args.seed,
            num_threads=args.threads,
            force=args.force,
        )
    except PrepareError as error:
        raise SystemExit(f"error: {error}") from error
    print(json.dumps(manifest["stats"], indent=1))


if __name__ == "__main__":
    main()
