"""Build the many-to-English gettext corpus: catalogs -> cleaned pairs -> splits -> SentencePiece -> shards."""

from __future__ import annotations

import argparse
import gettext
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# (language, source sentence, English sentence)
Triple = tuple[str, str, str]

QUICK_PACKAGES: tuple[str, ...] = ("vlc-l10n", "libgtk-3-common", "cinnamon-l10n")
FULL_PACKAGES: tuple[str, ...] = QUICK_PACKAGES + (
    "evolution-common",
    "pidgin-data",
    "gnucash-common",
    "gnome-control-center-data",
    "wordpress-l10n",
    "krita-l10n",
    "gnumeric-common",
    "nautilus-data",
    "libglib2.0-data",
)
PACKAGE_LISTS: dict[str, tuple[str, ...]] = {"quick": QUICK_PACKAGES, "full": FULL_PACKAGES}

DEFAULT_OUT = Path(".cache/gettext_m2en")
SYSTEM_LOCALE_ROOT = Path("/usr/share/locale")
SPLITS: tuple[str, ...] = ("train", "dev", "test")
FORMAT_VERSION = 2  # 2: leak-free split (assign_splits)

# Fixed special ids, so every consumer (model, beam search, checkpoints) can rely on them.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# A locale name after normalisation: language, optional script or region, optional modifier
# (sr@latin, ca@valencia are different written languages and stay distinct).
_LANG_RE = re.compile(r"^[a-z]{2,3}(?:_(?:[A-Z]{2}|[0-9]{3}|[A-Z][a-z]{3}))?(?:@[a-z]+)?$")
# Locale embedded in a file name, as WordPress ships them: admin-network-pt_BR.mo, fr_FR.mo.
_FILENAME_LANG_RE = re.compile(r"(?:^|-)([a-z]{2,3}(?:_[A-Za-z]{2,4})?(?:@[a-z]+)?)$")

# Regions that are the default for their language, so `de_DE` and `de` count as one language
# while `pt_BR`, `es_MX`, `zh_TW`, `bn_IN`, `fr_CA` stay separate. A region equal to the
# language code upper-cased (de_DE, fr_FR, it_IT, ...) is always treated as the default.
DEFAULT_REGIONS: dict[str, str] = {
    "am": "ET", "ar": "SA", "be": "BY", "bn": "BD", "bs": "BA", "ca": "ES", "cs": "CZ",
    "cy": "GB", "da": "DK", "el": "GR", "et": "EE", "eu": "ES", "fa": "IR", "ga": "IE",
    "gl": "ES", "gu": "IN", "he": "IL", "hi": "IN", "hy": "AM", "ja": "JP", "jv": "ID",
    "ka": "GE", "kk": "KZ", "km": "KH", "kn": "IN", "ko": "KR", "lo": "LA", "ml": "IN",
    "mr": "IN", "ms": "MY", "my": "MM", "nb": "NO", "ne": "NP", "nn": "NO", "or": "IN",
    "pa": "IN", "pt": "PT", "si": "LK", "sl": "SI", "sq": "AL", "sr": "RS", "su": "ID",
    "sv": "SE", "sw": "TZ", "ta": "IN", "te": "IN", "ug": "CN", "uk": "UA", "ur": "PK",
    "uz": "UZ", "vi": "VN", "zu": "ZA", "af": "ZA", "ks": "IN", "ku": "TR", "as": "IN",
    "mai": "IN", "kab": "DZ", "ast": "ES", "oc": "FR", "br": "FR", "tt": "RU", "ky": "KG",
}  # fmt: skip


class PrepareError(RuntimeError):
    """Preparation cannot go on; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------
# Languages


def normalize_lang(code: str) -> str | None:
    """Canonical language tag of a locale name, or None for English and non-languages.

    `de_DE.UTF-8` -> `de`, `pt_BR` -> `pt_BR`, `pt_PT` -> `pt`, `sr@Latin` -> `sr@latin`,
    `en_GB` -> None (English is the target side), `C` -> None.
    """
    code = code.strip()
    modifier = ""
    if "@" in code:
        code, modifier = code.split("@", 1)
        modifier = "@" + modifier.lower()
    code = code.split(".", 1)[0]  # drop a charset such as .UTF-8 or .GB2312
    parts = code.replace("-", "_").split("_")
    language = parts[0].lower()
    region = ""
    if len(parts) > 1 and parts[1]:
        region = parts[1]
        # Scripts are title case (Latn, Hans), regions upper case (BR).
        region = region.title() if len(region) == 4 else region.upper()
    if language == "en":
        return None
    if region and (region == language.upper() or DEFAULT_REGIONS.get(language) == region):
        region = ""
    tag = language + ("_" + region if region else "") + modifier
    return tag if _LANG_RE.match(tag) else None


def language_of_catalog(path: Path) -> str | None:
    """Language of a `.mo` file, from `<lang>/LC_MESSAGES/x.mo` or a file name like `admin-fr_FR.mo`."""
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "LC_MESSAGES":
        return normalize_lang(parts[-3])
    match = _FILENAME_LANG_RE.search(path.stem)
    return normalize_lang(match.group(1)) if match else None


def temperature_probs(counts: Mapping[str, int], temperature: float) -> dict[str, float]:
    """Sampling probability per language, p_lang proportional to n_lang ** (1 / temperature).

    T=1 samples in proportion to the data, large T approaches uniform (the paper's recipe for
    giving low-resource languages more weight).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (1 = proportional, 5 = paper)")
    weights = {lang: float(n) ** (1.0 / temperature) for lang, n in counts.items() if n > 0}
    if not weights:
        raise ValueError("no language has any example; nothing to sample from")
    total = sum(weights.values())
    return {lang: weight / total for lang, weight in sorted(weights.items())}


# ---------------------------------------------------------------------------------------------
# Fetching catalogs


def resolve_packages(packages: str | Sequence[str] | None) -> tuple[str, ...]:
    """`quick`, `full`, a comma-separated list or a sequence of Debian package names."""
    if packages is None:
        return ()
    if isinstance(packages, str):
        if packages in PACKAGE_LISTS:
            return PACKAGE_LISTS[packages]
        return tuple(name.strip() for name in packages.split(",") if name.strip())
    return tuple(packages)


def _run(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)


def fetch_packages(
    packages: Sequence[str], deb_dir: Path, log: Callable[[str], None]
) -> list[Path]:
    """Download .debs with `apt-get download` (no install); already downloaded ones are reused."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise PrepareError("apt-get/dpkg-deb not found (not a Debian-like system)")
    deb_dir.mkdir(parents=True, exist_ok=True)

    def cached(name: str) -> Path | None:
        found = sorted(deb_dir.glob(f"{name}_*.deb"))
        return found[-1] if found else None

    missing = [name for name in packages if cached(name) is None]
    stderr = ""
    if missing:
        log(f"apt-get download {' '.join(missing)}")
        result = _run(["apt-get", "download", *missing], cwd=deb_dir)
        if result.returncode != 0:
            # Empty package lists are the usual cause on a fresh container.
            log("apt-get download failed; running apt-get update once")
            _run(["apt-get", "update"])
            result = _run(["apt-get", "download", *missing], cwd=deb_dir)
        stderr = result.stderr.strip()[-300:]
        if result.returncode != 0:
            # One unknown name fails the whole command: retry one by one to keep the others.
            for name in missing:
                if _run(["apt-get", "download", name], cwd=deb_dir).returncode != 0:
                    log(f"warning: could not download package {name!r}; skipping it")
    debs = [deb for name in packages if (deb := cached(name)) is not None]
    if not debs:
        raise PrepareError(f"apt-get download fetched none of {list(packages)}: {stderr}")
    return debs


def unpack_deb(deb: Path, dest: Path) -> Path:
    """Extract a .deb's files into `dest` with `dpkg-deb -x` (no system install)."""
    done = dest / ".unpacked"
    if done.exists() and done.read_text() == deb.name:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    result = _run(["dpkg-deb", "-x", str(deb), str(dest)])
    if result.returncode != 0:
        raise PrepareError(f"dpkg-deb -x {deb} failed: {result.stderr.strip()}")
    done.write_text(deb.name)
    return dest


def find_catalogs(root: Path) -> list[tuple[str, Path]]:
    """All (language, path) of `.mo` catalogs under `root`, English and unknown names skipped."""
    found = []
    for path in sorted(root.rglob("*.mo")):
        lang = language_of_catalog(path)
        if lang is not None and path.is_file():
            found.append((lang, path))
    return found


# ---------------------------------------------------------------------------------------------
# Reading and cleaning


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


_WHITESPACE = re.compile(r"\s+")
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
    english = _WHITESPACE.sub(" ", english).strip()
    source = _WHITESPACE.sub(" ", source).strip()
    if not english or not source:
        return "empty"
    if source == english:
        return "untranslated"
    if not _has_letter(english) or not _has_letter(source):
        return "no_letters"  # format strings such as "%s: %d" carry nothing to translate
    if len(english) > max_chars or len(source) > max_chars:
        return "too_long"
    return english, source


# ---------------------------------------------------------------------------------------------
# User corpora


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


# ---------------------------------------------------------------------------------------------
# Splits


def split_key(text: str) -> str:
    """The form under which two strings count as the same sentence for splitting.

    Case, whitespace, punctuation and symbols are folded, and with them ellipses and hyphens:
    "Connecting..." and "Connecting", "Bottom-Left" and "Bottom left" share one key, so one
    can never be a dev or test sentence while the other trains.
    """
    folded = "".join(
        " " if unicodedata.category(char)[0] in "PSZ" else char for char in text.casefold()
    )
    return _WHITESPACE.sub(" ", folded).strip()


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


# ---------------------------------------------------------------------------------------------
# Tokenizer


def lang_tag(lang: str) -> str:
    """The control token prepended to a source sentence in language `lang`, e.g. `<pt_BR>`."""
    return f"<{lang}>"


def character_coverage(lines: Sequence[str], *, budget: int, target: float = 0.9995) -> float:
    """SentencePiece `character_coverage` that needs at most `budget` distinct characters.

    SentencePiece refuses a vocabulary smaller than the characters it must cover; with 150+
    scripts and a CPU-sized vocabulary (a few thousand pieces) 0.9995 can need more. The rare
    characters left out are not lost: byte fallback spells them as bytes.
    """
    counts = Counter("".join(lines).replace(" ", ""))  # spaces become the ▁ meta piece
    frequencies = sorted(counts.values(), reverse=True)
    total = sum(frequencies)
    if total == 0 or len(frequencies) <= budget:
        return target
    return min(target, sum(frequencies[:budget]) / total - 1e-6)


def train_tokenizer(
    train: Sequence[Triple],
    model_dir: Path,
    *,
    vocab_size: int,
    temperature: float,
    max_sentences: int,
    seed: int,
    num_threads: int,
) -> Path:
    """Train one unigram SentencePiece model shared by all sources and English.

    Input: a temperature-sampled subset of the sources (half of `max_sentences`) plus unique
    English sentences (the other half), so low-resource scripts get pieces too while training
    time stays bounded. Language tags are control symbols: they never match text (so a literal
    "<br>" in a message is not Breton), they are only inserted by id.
    """
    import sentencepiece as spm

    rng = np.random.default_rng(seed)
    by_lang: dict[str, list[str]] = {}
    for lang, source, _ in train:
        by_lang.setdefault(lang, []).append(source)
    probs = temperature_probs({lang: len(v) for lang, v in by_lang.items()}, temperature)
    lines: list[str] = []
    for lang, prob in probs.items():
        sources = by_lang[lang]
        take = min(len(sources), max(1, round(prob * max_sentences / 2)))
        lines.extend(sources[i] for i in rng.choice(len(sources), size=take, replace=False))
    english = sorted({english for _, _, english in train})
    take = min(len(english), max(1, max_sentences - len(lines)))
    lines.extend(english[i] for i in rng.choice(len(english), size=take, replace=False))

    control_symbols = [lang_tag(lang) for lang in sorted(by_lang)]
    # Half of what is left after special, byte and tag pieces may go to single characters.
    reserved = 4 + 256 + len(control_symbols)
    if vocab_size < reserved + 64:
        raise PrepareError(
            f"vocab_size={vocab_size} leaves no room for pieces: {reserved} ids are reserved "
            f"(4 special, 256 bytes, {len(control_symbols)} language tags); "
            f"use at least {reserved + 64} (8000 for CPU runs, 64000 as in the paper)"
        )
    coverage = character_coverage(lines, budget=max(1, (vocab_size - reserved) // 2))
    spm.set_random_generator_seed(seed)
    model_dir.mkdir(parents=True, exist_ok=True)
    input_file = model_dir / "spm_input.txt"
    input_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = model_dir / "spm"
    spm.SentencePieceTrainer.train(
        input=str(input_file),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        # Rare characters fall back to bytes instead of <unk>: 150 scripts share the vocabulary.
        character_coverage=coverage,
        byte_fallback=True,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        control_symbols=control_symbols,
        # A small corpus (tests, a few languages) may not support the requested size.
        hard_vocab_limit=False,
        # The input is already a bounded random sample; reading all of it keeps runs repeatable.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=num_threads,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


# ---------------------------------------------------------------------------------------------
# Shards


def write_shards(
    triples: Sequence[Triple],
    pattern: str,
    *,
    sp: Any,
    id_dtype: np.dtype[Any],
    block_size: int,
    with_text: bool,
    split: str,
) -> list[str]:
    """Write one split as webdataset shards; returns the shard file names.

    One webdataset sample is a *block* of up to `block_size` pairs of one language (a tar member
    costs at least 1 KiB, so one member per short sentence would be mostly padding):
      `lang.txt`    the language
      `src.npy`     all source ids (language tag first) concatenated, `id_dtype`
      `src_len.npy` int32 length of each source
      `tgt.npy`     all English ids concatenated (no BOS/EOS; the loader adds them)
      `tgt_len.npy` int32 length of each target
      `text.json`   dev/test only: {"sources": [...], "references": [...]} raw text for BLEU
    """
    import webdataset as wds

    Path(pattern).parent.mkdir(parents=True, exist_ok=True)
    by_lang: dict[str, list[Triple]] = {}
    for triple in triples:
        by_lang.setdefault(triple[0], []).append(triple)
    written: list[str] = []

    def remember(name: str) -> None:
        written.append(Path(name).name)

    with wds.ShardWriter(pattern, maxcount=1000, maxsize=64e6, post=remember, verbose=0) as sink:
        for lang in sorted(by_lang):
            rows = by_lang[lang]
            tag_id = sp.piece_to_id(lang_tag(lang))
            for block_index, start in enumerate(range(0, len(rows), block_size)):
                block = rows[start : start + block_size]
                sources = sp.encode([row[1] for row in block])
                targets = sp.encode([row[2] for row in block])
                sources = [[tag_id, *ids] for ids in sources]
                sample: dict[str, Any] = {
                    "__key__": f"{split}-{lang}-{block_index:06d}",
                    "lang.txt": lang,
                    "src.npy": np.fromiter((i for ids in sources for i in ids), dtype=id_dtype),
                    "src_len.npy": np.array([len(ids) for ids in sources], dtype=np.int32),
                    "tgt.npy": np.fromiter((i for ids in targets for i in ids), dtype=id_dtype),
                    "tgt_len.npy": np.array([len(ids) for ids in targets], dtype=np.int32),
                }
                if with_text:
                    sample["text.json"] = {
                        "sources": [row[1] for row in block],
                        "references": [row[2] for row in block],
                    }
                sink.write(sample)
    # ShardWriter calls `post` when a shard is closed; the last one is closed on exit.
    return sorted(set(written))


# ---------------------------------------------------------------------------------------------
# The whole pipeline


def _write_tsv(path: Path, triples: Iterable[Triple]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for lang, source, english in triples:
            handle.write(f"{lang}\t{source}\t{english}\n")


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
    exists, nothing is rebuilt (unless `force`).
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
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and not force:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("config") == config and manifest.get("format") == FORMAT_VERSION:
            return dict(manifest)

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
    manifest_path.unlink(missing_ok=True)  # a half-built corpus must not look finished

    # 1. Gather catalogs: (origin, language, path).
    catalogs: list[tuple[str, str, Path]] = []
    sources_used: list[str] = []
    if package_names:
        try:
            for deb in fetch_packages(package_names, out / "debs", log):
                package = deb.name.split("_", 1)[0]
                tree = unpack_deb(deb, out / "unpacked" / package)
                catalogs.extend((package, lang, path) for lang, path in find_catalogs(tree))
                sources_used.append(f"deb:{deb.name}")
        except PrepareError as error:
            log(f"warning: {error}; falling back to catalogs under {SYSTEM_LOCALE_ROOT}")
            found = find_catalogs(SYSTEM_LOCALE_ROOT) if SYSTEM_LOCALE_ROOT.is_dir() else []
            if not found and not (locale_roots or tsv_files or aligned_dirs):
                raise PrepareError(
                    f"apt failed ({error}) and {SYSTEM_LOCALE_ROOT} holds no .mo catalogs; "
                    "give a corpus with --locale-root, --tsv or --aligned"
                ) from error
            catalogs.extend(("system", lang, path) for lang, path in found)
            sources_used.append(f"locale:{SYSTEM_LOCALE_ROOT}")
    for root in map(Path, locale_roots):
        if not root.is_dir():
            raise PrepareError(f"locale root {root} is not a directory")
        catalogs.extend((str(root), lang, path) for lang, path in find_catalogs(root))
        sources_used.append(f"locale:{root}")
    log(f"{len(catalogs)} catalogs")

    # 2. Read and clean into a set of unique triples.
    triples: set[Triple] = set()
    dropped: Counter[str] = Counter()
    raw_pairs = 0

    def add(lang: str, source: str, english: str) -> None:
        nonlocal raw_pairs
        raw_pairs += 1
        cleaned = clean_pair(english, source, max_chars=max_chars)
        if isinstance(cleaned, str):
            dropped[cleaned] += 1
            return
        triple = (lang, cleaned[1], cleaned[0])
        if triple in triples:
            dropped["duplicate"] += 1
        triples.add(triple)

    for _origin, lang, path in catalogs:
        try:
            for english, source in read_catalog(path):
                add(lang, source, english)
        except (OSError, ValueError) as error:
            log(f"warning: skipping unreadable catalog {path}: {error}")
            dropped["unreadable_catalog"] += 1
    user_triples: list[Iterator[Triple]] = [read_tsv(Path(p)) for p in tsv_files]
    user_triples += [read_aligned_dir(Path(d)) for d in aligned_dirs]
    sources_used += [f"tsv:{p}" for p in tsv_files] + [f"aligned:{d}" for d in aligned_dirs]
    for stream in user_triples:
        for raw_lang, source, english in stream:
            user_lang = normalize_lang(raw_lang)
            if user_lang is None:
                dropped["bad_or_english_language"] += 1
                continue
            add(user_lang, source, english)
    if not triples:
        raise PrepareError(f"no usable pair found in {sources_used} (dropped: {dict(dropped)})")
    # The split links every language's pairs (see assign_splits), so it is computed over all of
    # them: the same English sentence is held out whichever languages are kept.
    all_triples = set(triples)
    if languages is not None:
        present = {t[0] for t in triples}
        missing = sorted(set(languages) - present)
        if missing:
            raise PrepareError(
                f"no pairs for language(s) {missing} in {sources_used}; "
                f"available: {' '.join(sorted(present))}"
            )
        keep = set(languages)
        triples = {t for t in triples if t[0] in keep}  # split below over all_triples
    log(f"{raw_pairs} raw pairs -> {len(triples)} unique clean pairs; dropped {dict(dropped)}")

    # 3. Split without leaks (assign_splits) and write the raw text (needed for BLEU references).
    splits: dict[str, list[Triple]] = {split: [] for split in SPLITS}
    for triple, split in assign_splits(
        all_triples, dev_fraction=dev_fraction, test_fraction=test_fraction
    ).items():
        if triple in triples:
            splits[split].append(triple)
    (out / "pairs").mkdir(exist_ok=True)
    for split in SPLITS:
        splits[split].sort(key=_order_key)
        _write_tsv(out / "pairs" / f"{split}.tsv", splits[split])
    counts: dict[str, Any] = {
        split: dict(sorted(Counter(t[0] for t in rows).items())) for split, rows in splits.items()
    }
    languages = sorted({t[0] for t in triples})
    counts["total"] = {
        lang: sum(counts[split].get(lang, 0) for split in SPLITS) for lang in languages
    }
    (out / "counts.json").write_text(json.dumps(counts, indent=1, ensure_ascii=False) + "\n")
    log(
        f"{len(languages)} languages; "
        + ", ".join(f"{split} {len(splits[split])}" for split in SPLITS)
    )
    if not splits["train"]:
        raise PrepareError("the train split is empty; lower dev_fraction/test_fraction")

    # 4. Tokenizer.
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
    actual_vocab = sp.get_piece_size()
    log(f"sentencepiece: {actual_vocab} pieces (asked {vocab_size})")

    # 5. Shards of token ids.
    id_dtype = (
        np.dtype(np.uint16) if actual_vocab <= np.iinfo(np.uint16).max else np.dtype(np.int32)
    )
    shards_dir = out / "shards"
    if shards_dir.exists():
        shutil.rmtree(shards_dir)
    shard_files = {
        split: write_shards(
            splits[split],
            str(shards_dir / f"{split}-%06d.tar"),
            sp=sp,
            id_dtype=id_dtype,
            block_size=block_size,
            with_text=split != "train",
            split=split,
        )
        for split in SPLITS
    }
    elapsed = time.monotonic() - started
    manifest = {
        "format": FORMAT_VERSION,
        "config": config,
        "sources": sources_used,
        "tokenizer": "spm/spm.model",
        "vocab_size": actual_vocab,
        "pad_id": PAD_ID,
        "unk_id": UNK_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "id_dtype": id_dtype.name,
        "languages": languages,
        "lang_tags": {lang: sp.piece_to_id(lang_tag(lang)) for lang in languages},
        "splits": {
            split: {"pairs": len(splits[split]), "shards": [f"shards/{name}" for name in names]}
            for split, names in shard_files.items()
        },
        "stats": {
            "catalogs": len(catalogs),
            "raw_pairs": raw_pairs,
            "unique_pairs": len(triples),
            "dropped": dict(dropped),
            "languages": len(languages),
            "languages_10k_plus": sum(1 for n in counts["total"].values() if n >= 10_000),
            "languages_under_1k": sum(1 for n in counts["total"].values() if n < 1_000),
            "seconds": round(elapsed, 1),
        },
    }
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, manifest_path)
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
