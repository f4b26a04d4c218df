"""Phase 4, split: train / dev / test without leaks, written as ``pairs/<split>.tsv`` and counts.

Strings count as one sentence under a folded key (``split_key``); pairs linked by an English or
a same-language source key share a split (``assign_splits``), which a stable hash of the group
chooses, so no held-out sentence, folded, ever trains, for any subset of languages.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Set
from pathlib import Path
from typing import Any

from data.gettext_m2en.clean import collapse_whitespace
from data.gettext_m2en.corpus_format import COUNTS_FILE, SPLITS, Triple
from data.gettext_m2en.errors import PrepareError


def split_key(text: str) -> str:
    """The form under which two strings count as the same sentence for splitting.

    Case, whitespace, punctuation and symbols are folded, and with them ellipses and hyphens:
    "Connecting..." and "Connecting", "Bottom-Left" and "Bottom left" share one key, so one
    can never be a dev or test sentence while the other trains.
    """
    folded = "".join(
        " " if unicodedata.category(char)[0] in "PSZ" else char for char in text.casefold()
    )
    return collapse_whitespace(folded)


def _hash_unit(key: str) -> float:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_of(english: str, *, dev_fraction: float, test_fraction: float) -> str:
    """`train`, `dev` or `test` from a stable hash of the English side's `split_key`."""
    unit = _hash_unit(split_key(english))
    if unit < dev_fraction:
        return "dev"
    if unit < dev_fraction + test_fraction:
        return "test"
    return "train"


# A group of linked sentences larger than this always trains: held out whole it would be a
# sizeable, topically narrow slice of dev or test (the largest seen in the quick list is a few
# hundred English strings joined through one-word source strings such as "Ok").
MAX_HELD_OUT_GROUP = 64


def assign_splits(
    triples: Iterable[Triple], *, dev_fraction: float, test_fraction: float
) -> dict[Triple, str]:
    """The split of every (language, source, English) triple, with nothing leaking across.

    Two triples must share a split when their English sides have the same `split_key`, or when
    they are in the same language and their source sides have the same `split_key` (the same
    source string translated to two Englishes, e.g. "Ouvrir" for "Open" and "Open file").
    These links join triples into groups (connected components, found with union-find); a group
    takes the split of its smallest English key by `split_of`, so a group of one English
    sentence lands where `split_of` puts it for every language and language subset. Groups of
    more than `MAX_HELD_OUT_GROUP` English keys train.
    """
    triples = list(triples)
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        root = node
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[node] != root:  # path compression
            parent[node], node = root, parent[node]
        return root

    def union(a: str, b: str) -> None:
        root_a, root_b = find(a), find(b)
        if root_a != root_b:
            parent[max(root_a, root_b)] = min(root_a, root_b)

    # English nodes sort before source nodes ("E" < "S"), so a group's root is an English node:
    # the smallest English key of the group.
    for lang, source, english in triples:
        union("E" + split_key(english), "S" + lang + "\t" + split_key(source))
    group_size: Counter[str] = Counter()
    for node in parent:
        if node.startswith("E"):
            group_size[find(node)] += 1
    result: dict[Triple, str] = {}
    for triple in triples:
        root = find("E" + split_key(triple[2]))
        if group_size[root] > MAX_HELD_OUT_GROUP:
            result[triple] = "train"
        else:
            result[triple] = split_of(
                root[1:], dev_fraction=dev_fraction, test_fraction=test_fraction
            )
    return result


def _order_key(triple: Triple) -> tuple[str, bytes, str]:
    # Within a language, a hash order: any prefix (e.g. max_per_lang in evaluation) is a fair
    # sample instead of the alphabetically first strings.
    lang, source, english = triple
    return lang, hashlib.blake2b(english.encode("utf-8"), digest_size=8).digest(), source


def _write_tsv(path: Path, triples: Iterable[Triple]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for lang, source, english in triples:
            handle.write(f"{lang}\t{source}\t{english}\n")


def split_corpus(
    all_triples: Iterable[Triple],
    kept: Set[Triple],
    out: Path,
    *,
    dev_fraction: float,
    test_fraction: float,
    log: Callable[[str], None],
) -> tuple[dict[str, list[Triple]], dict[str, Any], list[str]]:
    """The ``kept`` triples per split, the split assigned over ``all_triples`` (so the same
    English sentence is held out whichever languages are kept); writes ``pairs/<split>.tsv``
    (the raw text: BLEU's references) and counts.json. Returns the splits, the counts and the
    kept languages, sorted."""
    splits: dict[str, list[Triple]] = {split: [] for split in SPLITS}
    for triple, split in assign_splits(
        all_triples, dev_fraction=dev_fraction, test_fraction=test_fraction
    ).items():
        if triple in kept:
            splits[split].append(triple)
    (out / "pairs").mkdir(exist_ok=True)
    for split in SPLITS:
        splits[split].sort(key=_order_key)
        _write_tsv(out / "pairs" / f"{split}.tsv", splits[split])
    counts: dict[str, Any] = {
        split: dict(sorted(Counter(t[0] for t in rows).items())) for split, rows in splits.items()
    }
    languages = sorted({t[0] for t in kept})
    counts["total"] = {
        lang: sum(counts[split].get(lang, 0) for split in SPLITS) for lang in languages
    }
    (out / COUNTS_FILE).write_text(json.dumps(counts, indent=1, ensure_ascii=False) + "\n")
    log(
        f"{len(languages)} languages; "
        + ", ".join(f"{split} {len(splits[split])}" for split in SPLITS)
    )
    if not splits["train"]:
        raise PrepareError("the train split is empty; lower dev_fraction/test_fraction")
    return splits, counts, languages
