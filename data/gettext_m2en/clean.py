"""Phase 3, clean: every source's pairs cleaned and deduplicated into (language, source, English).

Mnemonics and old KDE contexts are stripped and whitespace collapsed; a pair is dropped when a
side is empty, untranslated, without letters outside placeholders, or too long; each drop is
counted by its reason. ``select_languages`` then keeps the languages asked for.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from data.gettext_m2en.corpus_format import Triple
from data.gettext_m2en.errors import PrepareError
from data.gettext_m2en.fetch import Catalog
from data.gettext_m2en.languages import normalize_lang
from data.gettext_m2en.read import read_aligned_dir, read_catalog, read_tsv

_WHITESPACE = re.compile(r"\s+")


def collapse_whitespace(text: str) -> str:
    """Runs of whitespace (newlines too) as one space, none at either end."""
    return _WHITESPACE.sub(" ", text).strip()


_KDE_CONTEXT = re.compile(r"^_:[^\n]*\n")  # old KDE convention: "_: context\nmessage"
# A mnemonic marker: `_` or `&` right before a letter or digit, not doubled (`&&` is a literal
# ampersand in Qt) and not an HTML entity (`&amp;`).
_MARKER = {
    "_": re.compile(r"(?<!_)_(?=[^\W_])"),
    "&": re.compile(r"(?<!&)&(?=[^\W_])(?![A-Za-z]+;|#[0-9]+;|#x[0-9A-Fa-f]+;)"),
}
# English mnemonics sit at the start of a word for `_` ("Save _As"), anywhere for `&` ("E&xit").
_ENGLISH_MARKER = {"_": re.compile(r"(?:^|(?<=\s))_(?=[^\W_])"), "&": _MARKER["&"]}
# CJK translations put the mnemonic in parentheses after the word: "ファイル(_F)".
_PAREN_MARKER = {c: re.compile(rf"\s*[(（]{re.escape(c)}[^\W_][)）]") for c in "_&"}


def strip_accelerators(english: str, source: str) -> tuple[str, str]:
    """Remove keyboard mnemonics (`_File`, `&File`, `ファイル(_F)`) from both sides.

    Decided from the English side: when it carries exactly one marker of a kind, that kind is a
    mnemonic and is removed from the English; from the translation when it also carries exactly
    one (translators place it anywhere: "Фа_йл", "С&оотношение"). Identifiers such as
    `file_name` or `x/_y` (no underscore after a space) are left alone.
    """
    for mark in "_&":
        if len(_ENGLISH_MARKER[mark].findall(english)) != 1:
            continue
        english = _MARKER[mark].sub("", english, count=1)
        if len(_PAREN_MARKER[mark].findall(source)) == 1:
            source = _PAREN_MARKER[mark].sub("", source)
        elif len(_MARKER[mark].findall(source)) == 1:
            source = _MARKER[mark].sub("", source)
        break
    return english, source


# Placeholders and markup: printf (`%s`, `%1$d`, `%(name)s`), braces (`{0}`, `${name}`), tags.
_PLACEHOLDER = re.compile(
    r"%(?:\(\w+\)|\d+\$)?[-+ #0]*\d*(?:\.\d+)?[hlLqjzt]*[a-zA-Z%]|\$?\{[^}]*\}|<[^>]*>"
)


def _has_letter(text: str) -> bool:
    """Whether `text` has a letter outside placeholders and markup (something to translate)."""
    return any(ch.isalpha() for ch in _PLACEHOLDER.sub("", text))


def clean_pair(english: str, source: str, *, max_chars: int) -> tuple[str, str] | str:
    """Cleaned (English, source), or the reason (a short string) the pair is dropped."""
    english = _KDE_CONTEXT.sub("", english)
    source = _KDE_CONTEXT.sub("", source)
    english, source = strip_accelerators(english, source)
    english = collapse_whitespace(english)
    source = collapse_whitespace(source)
    if not english or not source:
        return "empty"
    if source == english:
        return "untranslated"
    if not _has_letter(english) or not _has_letter(source):
        return "no_letters"  # format strings such as "%s: %d" carry nothing to translate
    if len(english) > max_chars or len(source) > max_chars:
        return "too_long"
    return english, source


class UniquePairs:
    """The unique clean triples of all sources, and how many pairs were read and dropped (why)."""

    def __init__(self, *, max_chars: int) -> None:
        self.max_chars = max_chars
        self.triples: set[Triple] = set()
        self.dropped: Counter[str] = Counter()
        self.raw_pairs = 0

    def add(self, lang: str, source: str, english: str) -> None:
        self.raw_pairs += 1
        cleaned = clean_pair(english, source, max_chars=self.max_chars)
        if isinstance(cleaned, str):
            self.dropped[cleaned] += 1
            return
        triple = (lang, cleaned[1], cleaned[0])
        if triple in self.triples:
            self.dropped["duplicate"] += 1
        self.triples.add(triple)


def collect_pairs(
    catalogs: Sequence[Catalog],
    tsv_files: Sequence[str | Path],
    aligned_dirs: Sequence[str | Path],
    *,
    max_chars: int,
    log: Callable[[str], None],
) -> UniquePairs:
    """Read every catalog, then the user's TSV files and aligned folders, into unique pairs."""
    pairs = UniquePairs(max_chars=max_chars)
    for _origin, lang, path in catalogs:
        try:
            for english, source in read_catalog(path):
                pairs.add(lang, source, english)
        except (OSError, ValueError) as error:
            log(f"warning: skipping unreadable catalog {path}: {error}")
            pairs.dropped["unreadable_catalog"] += 1
    user_triples: list[Iterator[Triple]] = [read_tsv(Path(p)) for p in tsv_files]
    user_triples += [read_aligned_dir(Path(d)) for d in aligned_dirs]
    for stream in user_triples:
        for raw_lang, source, english in stream:
            user_lang = normalize_lang(raw_lang)
            if user_lang is None:
                pairs.dropped["bad_or_english_language"] += 1
                continue
            pairs.add(user_lang, source, english)
    return pairs


def select_languages(
    pairs: UniquePairs, languages: Sequence[str] | None, sources: Sequence[str]
) -> set[Triple]:
    """The triples of ``languages`` (all when None); an error naming the sources when there is
    no pair at all, or none for a language asked for."""
    if not pairs.triples:
        raise PrepareError(f"no usable pair found in {list(sources)} "
                           f"(dropped: {dict(pairs.dropped)})")
    if languages is None:
        return pairs.triples
    present = {t[0] for t in pairs.triples}
    missing = sorted(set(languages) - present)
    if missing:
        raise PrepareError(
            f"no pairs for language(s) {missing} in {list(sources)}; "
            f"available: {' '.join(sorted(present))}"
        )
    keep = set(languages)
    return {t for t in pairs.triples if t[0] in keep}
