"""Build the related-languages corpus: English sentences of a prepared gettext corpus, written in
two synthetic families (``family.py``), prepared like any corpus (``data.gettext_m2en.prepare``
with a TSV), so the NMT app trains on it with ``packages: none``.

    python -m data.related_languages.build [--english-from .cache/gettext_m2en_dw]
        [--out .cache/related_languages] [--vocab-size 2000] [--seed 0] [--force]

THE DESIGN (``DESIGN``; fixed before any run on it):

- Family A: parent ``qaa``, English word order; letters p t k m n s l r f v / a e i o u.
  Family B: parent ``qba``, reversed word order; letters b d g z h w j c x q / a e i o u y.
  (``qaa``-``qtz`` are the ISO 639 codes reserved for local use.)
- Each parent trains on 30,000 pairs: the high bucket.
- Relatives ``qab qac qad`` of ``qaa`` and ``qbb qbc qbd`` of ``qba`` train on 300, 600 and
  1,200 pairs: the low bucket. Each has 3 sound changes and its own word for 20% of the English
  word types (chosen by a hash); the other 80% are the parent's words, sound-changed.
- Every language's dev and test sets are the same 300 + 300 English sentences (multi-way
  parallel), so languages are scored on the same content.
- The English comes from the gettext corpus's three splits, pooled and put back where the
  corpus's hash puts them (``split_of``), so ``prepare``'s leak-free split keeps every held-out
  English sentence held out; training sentences are a seeded sample per language.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data.gettext_m2en.corpus_format import SPLITS, read_manifest
from data.gettext_m2en.errors import PrepareError
from data.gettext_m2en.lock import corpus_lock
from data.gettext_m2en.read import read_tsv
from data.gettext_m2en.splits import split_key, split_of
from data.related_languages.family import (
    Language,
    Phonology,
    english_words,
    parent_language,
    relative_language,
)

DEFAULT_OUT = Path(".cache/related_languages")
DEFAULT_ENGLISH = Path(".cache/gettext_m2en_dw")
DEV_FRACTION = TEST_FRACTION = 0.02  # prepare's defaults: the split the English sits in
DESIGN_FILE = "source/design.json"
TSV_FILE = "source/related.tsv"


@dataclass(frozen=True)
class FamilyDesign:
    parent: str
    consonants: str
    vowels: str
    reverse: bool
    relatives: tuple[str, ...]


@dataclass(frozen=True)
class Design:
    families: tuple[FamilyDesign, ...] = (
        FamilyDesign("qaa", "ptkmnslrfv", "aeiou", False, ("qab", "qac", "qad")),
        FamilyDesign("qba", "bdgzhwjcxq", "aeiouy", True, ("qbb", "qbc", "qbd")),
    )
    parent_pairs: int = 30_000
    relative_pairs: tuple[int, ...] = (300, 600, 1_200)  # per relative, in the families' order
    held_out: Mapping[str, int] = field(default_factory=lambda: {"dev": 300, "test": 300})
    sound_changes: int = 3
    own_fraction: float = 0.2

    def train_pairs(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for family in self.families:
            sizes[family.parent] = self.parent_pairs
            for relative, pairs in zip(family.relatives, self.relative_pairs, strict=True):
                sizes[relative] = pairs
        return sizes

    def bucket_thresholds(self) -> list[int]:
        """``[high, low]`` training pairs that put the parents in the high bucket and the
        relatives in the low one (``NMTConfig.bucket_thresholds``)."""
        return [self.parent_pairs // 2, 2 * max(self.relative_pairs)]


DESIGN = Design()


def languages(design: Design, words: set[str]) -> dict[str, Language]:
    """Every language of ``design`` over the English word types ``words``."""
    result: dict[str, Language] = {}
    for family in design.families:
        phonology = Phonology(family.consonants, family.vowels)
        parent = parent_language(family.parent, words, phonology, reverse=family.reverse)
        result[parent.name] = parent
        for name in family.relatives:
            result[name] = relative_language(name, parent, phonology,
                                             changes=design.sound_changes,
                                             own_fraction=design.own_fraction)
    return result


def read_english(corpus: Path) -> dict[str, list[str]]:
    """The English sentences of a prepared corpus, one per ``split_key``, grouped by the split
    ``split_of`` gives them (the corpus's own split, bar its groups forced into training)."""
    if read_manifest(corpus) is None:
        raise PrepareError(
            f"no prepared corpus in {corpus} to take English sentences from; prepare one first "
            f"(python -m data.gettext_m2en.prepare --out {corpus} ...), or pass --english-from")
    by_key: dict[str, str] = {}
    for split in SPLITS:
        for _, _, english in read_tsv(corpus / "pairs" / f"{split}.tsv"):
            key = split_key(english)
            if key and (key not in by_key or english < by_key[key]):
                by_key[key] = english
    pools: dict[str, list[str]] = {split: [] for split in SPLITS}
    for english in sorted(by_key.values()):
        pools[split_of(english, dev_fraction=DEV_FRACTION,
                       test_fraction=TEST_FRACTION)].append(english)
    return pools


def _hash_order(sentences: Sequence[str]) -> list[str]:
    return sorted(sentences, key=lambda s: hashlib.blake2b(s.encode("utf-8"),
                                                           digest_size=8).digest())


def draw_sentences(pools: Mapping[str, Sequence[str]], design: Design,
                   seed: int) -> dict[str, dict[str, list[str]]]:
    """English sentences per language and split: a seeded sample of the training pool of each
    language's size; the same first held-out sentences (hash order) for every language."""
    sizes = design.train_pairs()
    short = {split: (len(pools[split]), n) for split, n in design.held_out.items()
             if len(pools[split]) < n}
    biggest = max(sizes.values())
    if short or len(pools["train"]) < biggest:
        raise PrepareError(
            f"the English corpus is too small for the design: (available, needed) per split "
            f"{short or ''} train {(len(pools['train']), biggest)}; take English from a larger "
            f"corpus (--english-from) or build with a smaller design")
    held = {split: _hash_order(pools[split])[:n] for split, n in design.held_out.items()}
    return {lang: {"train": random.Random(f"{seed}:{lang}").sample(pools["train"], n), **held}
            for lang, n in sizes.items()}


def build(out: str | Path = DEFAULT_OUT, *, english_from: str | Path = DEFAULT_ENGLISH,
          design: Design = DESIGN, vocab_size: int = 2000, seed: int = 0, num_threads: int = 2,
          force: bool = False, verbose: bool = True) -> dict[str, Any]:
    """Write the languages' pairs as a TSV under ``out/source/`` and prepare the corpus under
    ``out``; returns its manifest. A corpus there from another design or English is an error
    (``force`` rebuilds it)."""
    from data.gettext_m2en.prepare import prepare

    out, english_from = Path(out), Path(english_from)
    pools = read_english(english_from)
    record = {"design": asdict(design), "english_from": str(english_from.resolve()),
              "english_sentences": {s: len(p) for s, p in pools.items()}, "seed": seed}
    design_path = out / DESIGN_FILE
    # One builder at a time: the check, the TSV and prepare under one lock (``out/source.lock``;
    # prepare takes ``out.lock`` itself), so a second build waits, then finds the corpus built.
    with corpus_lock(out / "source"):
        if read_manifest(out) is not None and not force:
            built = json.loads(design_path.read_text()) if design_path.exists() else {}
            built.pop("languages", None)
            if built != json.loads(json.dumps(record)):
                raise PrepareError(
                    f"{out} holds a corpus built from another design or English ({design_path}); "
                    f"pass force=True (--force) to rebuild it, or another out directory")
        else:
            sentences = draw_sentences(pools, design, seed)
            written = languages(design, english_words(s for splits in sentences.values()
                                                      for rows in splits.values() for s in rows))
            (out / "source").mkdir(parents=True, exist_ok=True)
            tsv = out / TSV_FILE
            with open(tsv.with_suffix(".tmp"), "w", encoding="utf-8") as handle:
                for lang, splits in sentences.items():
                    for rows in splits.values():
                        for english in rows:
                            handle.write(f"{lang}\t{written[lang].write(english)}\t{english}\n")
            tsv.with_suffix(".tmp").replace(tsv)
            languages_record = {name: {"parent": lang.parent, "reverse": lang.reverse,
                                       "sound_changes": dict(lang.changes),
                                       "own_words": len(lang.own_words), "words": len(lang.lexicon)}
                                for name, lang in written.items()}
            design_path.write_text(json.dumps({**record, "languages": languages_record}, indent=1))
            force = True  # the TSV changed: prepare must read it again
        manifest = prepare(out, packages=None, tsv_files=[out / TSV_FILE], vocab_size=vocab_size,
                           dev_fraction=DEV_FRACTION, test_fraction=TEST_FRACTION, seed=seed,
                           num_threads=num_threads, force=force, verbose=verbose)
    return manifest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--english-from", type=Path, default=DEFAULT_ENGLISH,
                        help="a prepared gettext corpus whose English sentences are written")
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        build(args.out, english_from=args.english_from, vocab_size=args.vocab_size,
              seed=args.seed, num_threads=args.threads, force=args.force)
    except PrepareError as error:
        raise SystemExit(f"error: {error}") from error


if __name__ == "__main__":
    main()
