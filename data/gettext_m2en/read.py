"""Phase 2, read: (English, translation) from gettext catalogs, triples from the user's files."""

from __future__ import annotations

import gettext
import re
from collections.abc import Iterator
from pathlib import Path

from data.gettext_m2en.corpus_format import Triple
from data.gettext_m2en.errors import PrepareError


def _plural_indices(plural_forms: str | None) -> tuple[int, int]:
    """msgstr indices to pair with msgid (n=1) and msgid_plural (n=5, a generic plural)."""
    if plural_forms:
        match = re.search(r"plural\s*=\s*([^;]+)", plural_forms)
        if match:
            try:
                plural = gettext.c2py(match.group(1))
                return int(plural(1)), int(plural(5))
            except (ValueError, SyntaxError, RecursionError):
                pass
    return 0, 1


def read_catalog(path: Path) -> Iterator[tuple[str, str]]:
    """(English, translation) pairs of a `.mo` file, plural forms included, context dropped.

    The context (msgctxt) only disambiguates identical English strings for translators; the
    pair itself is what we keep. A plural entry gives two pairs: msgid with the form used for
    n=1 and msgid_plural with the form used for n=5, chosen by the catalog's Plural-Forms.
    """
    import polib  # imported here so importing this module stays cheap

    catalog = polib.mofile(str(path))
    singular_index, plural_index = _plural_indices(catalog.metadata.get("Plural-Forms"))
    for entry in catalog:
        if not entry.msgid:
            continue  # the header entry
        if entry.msgid_plural:
            forms = entry.msgstr_plural
            if singular_index in forms:
                yield entry.msgid, forms[singular_index]
            if plural_index in forms:
                yield entry.msgid_plural, forms[plural_index]
        else:
            yield entry.msgid, entry.msgstr


def read_tsv(path: Path) -> Iterator[Triple]:
    """Triples from a `lang<TAB>source<TAB>english` file (raw languages, not yet normalised)."""
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 3:
                raise PrepareError(
                    f"{path}:{line_number}: expected 3 tab-separated fields "
                    f"(lang, source, english), got {len(fields)}"
                )
            yield fields[0], fields[1], fields[2]


def read_aligned_dir(directory: Path) -> Iterator[Triple]:
    """Triples from aligned text files: `<stem>.en` next to `<stem>.<lang>`, one sentence a line.

    The Moses/OPUS naming works as is: `de-en.de` + `de-en.en`, `train.fr` + `train.en`.
    """
    english_files = sorted(directory.glob("*.en"))
    if not english_files:
        raise PrepareError(f"no '<stem>.en' file in {directory}; expected e.g. fr-en.fr + fr-en.en")
    for english_file in english_files:
        english_lines = english_file.read_text(encoding="utf-8").splitlines()
        for source_file in sorted(directory.glob(english_file.stem + ".*")):
            lang = source_file.suffix[1:]
            if source_file == english_file or not lang:
                continue
            source_lines = source_file.read_text(encoding="utf-8").splitlines()
            if len(source_lines) != len(english_lines):
                raise PrepareError(
                    f"{source_file} has {len(source_lines)} lines but {english_file} has "
                    f"{len(english_lines)}; aligned files need one sentence per line each"
                )
            for source, english in zip(source_lines, english_lines, strict=True):
                yield lang, source, english

