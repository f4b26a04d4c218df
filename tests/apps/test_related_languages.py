"""The related-languages corpus: synthetic families written from English (data.related_languages),
prepared like the gettext corpus, and the depth-against-width complement that trains on it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from data.gettext_m2en.corpus_format import read_manifest
from data.gettext_m2en.errors import PrepareError
from data.gettext_m2en.lock import corpus_lock
from data.related_languages.build import Design, FamilyDesign, build, languages, read_english
from data.related_languages.family import (
    Phonology,
    change_sounds,
    english_words,
    parent_language,
    relative_language,
    sound_changes,
    tokens,
)

PHONOLOGY = Phonology("ptkmnslrfv", "aeiou")
SENTENCES = ["Open the file %s", "Save as <b>HDR</b> image (2020)", "The file {name} was saved",
             "Could not open %1$d files: &amp; more", "Visit https://example.org/File now"]
WORDS = english_words(SENTENCES) | {f"word{chr(97 + i)}{chr(97 + j)}" for i in range(26)
                                    for j in range(26)}


def test_tokens_rebuild_the_sentence_and_keep_placeholders_and_markup_whole() -> None:
    for sentence in SENTENCES:
        assert "".join(text for _, text in tokens(sentence)) == sentence
    words = [text for is_word, text in tokens(SENTENCES[3]) if is_word]
    assert words == ["Could", "not", "open", "files", "more"]  # not the d of %1$d, nor amp
    assert [t for w, t in tokens(SENTENCES[4]) if w] == ["Visit", "now"]
    assert [t for w, t in tokens("{name} <b>bold</b>") if w] == ["bold"]


def test_a_parent_writes_each_word_type_one_way_in_the_english_case() -> None:
    parent = parent_language("qaa", WORDS, PHONOLOGY, reverse=False)
    assert len(set(parent.lexicon.values())) == len(parent.lexicon) == len(WORDS)  # no homonyms
    written = parent.write("Open the file %s")
    first, the, file_, placeholder = written.split(" ")
    assert placeholder == "%s" and first[0].isupper() and the.islower()
    assert parent.write("open the FILE %s") == f"{first.lower()} {the} {file_.upper()} %s"
    assert all(set(w) <= set(PHONOLOGY.consonants + PHONOLOGY.vowels)
               for w in parent.lexicon.values())
    # a pure function of the vocabulary and the name
    assert parent_language("qaa", WORDS, PHONOLOGY, reverse=False).lexicon == parent.lexicon
    assert parent_language("qba", WORDS, PHONOLOGY, reverse=False).lexicon != parent.lexicon


def test_a_reversing_language_moves_words_only() -> None:
    forward = parent_language("qaa", WORDS, PHONOLOGY, reverse=False)
    backward = parent_language("qaa", WORDS, PHONOLOGY, reverse=True)
    sentence = "Save as <b>HDR</b> image (2020)"
    words = [forward.lexicon[w.lower()] for w in ["Save", "as", "HDR", "image"]]
    assert forward.write(sentence) == (f"{words[0].capitalize()} {words[1]} <b>"
                                       f"{words[2].upper()}</b> {words[3]} (2020)")
    # reversed: "image HDR as Save", each word keeping its own English case
    assert backward.write(sentence) == (f"{words[3]} {words[2].upper()} <b>{words[1]}</b> "
                                        f"{words[0].capitalize()} (2020)")


def test_a_relative_takes_most_words_from_its_parent_under_regular_sound_changes() -> None:
    parent = parent_language("qaa", WORDS, PHONOLOGY, reverse=True)
    relative = relative_language("qab", parent, PHONOLOGY, changes=3, own_fraction=0.2)
    changes = sound_changes(PHONOLOGY, "qab", 3)
    assert relative.changes == changes and len(changes) == 3
    assert all((a in PHONOLOGY.vowels) == (b in PHONOLOGY.vowels) for a, b in changes.items())
    assert not set(changes) & set(changes.values())  # no chains: one rule per letter
    inherited = [w for w in WORDS if w not in relative.own_words]
    assert 0.15 < len(relative.own_words) / len(WORDS) < 0.25
    assert all(relative.lexicon[w] == change_sounds(parent.lexicon[w], changes) for w in inherited)
    own = set(relative.lexicon[w] for w in relative.own_words)
    assert not own & {relative.lexicon[w] for w in inherited}
    assert relative.reverse and relative.parent == "qaa"


SMALL = Design(families=(FamilyDesign("qaa", "ptkmnslrfv", "aeiou", False, ("qab", "qac")),
                         FamilyDesign("qba", "bdgzhwjcxq", "aeiouy", True, ("qbb", "qbc"))),
               parent_pairs=150, relative_pairs=(20, 40), held_out={"dev": 5, "test": 5})


def test_the_built_corpus_has_the_designed_sizes_and_shared_held_out_english(
        corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "related"
    manifest = build(out, english_from=corpus, design=SMALL, vocab_size=400, num_threads=1,
                     verbose=False)
    assert read_manifest(out) == manifest
    counts = json.loads((out / "counts.json").read_text())
    assert counts["train"] == {"qaa": 150, "qab": 20, "qac": 40, "qba": 150, "qbb": 20,
                               "qbc": 40}
    assert set(counts["test"].values()) == {5} and set(counts["dev"].values()) == {5}
    rows: dict[str, dict[str, set[str]]] = {}
    for split in ("train", "dev", "test"):
        for line in (out / "pairs" / f"{split}.tsv").read_text().splitlines():
            lang, source, english = line.split("\t")
            rows.setdefault(split, {}).setdefault(lang, set()).add(english)
            assert source != english
    # the same held-out English for every language, none of it trained on
    assert len({frozenset(s) for s in rows["test"].values()}) == 1
    trained = set().union(*rows["train"].values())
    assert not trained & set().union(*rows["test"].values(), *rows["dev"].values())
    design = json.loads((out / "source" / "design.json").read_text())
    assert design["languages"]["qbc"]["parent"] == "qba" and design["languages"]["qbc"]["reverse"]
    # again: reused; another design: refused with the fix named
    assert build(out, english_from=corpus, design=SMALL, vocab_size=400, verbose=False) == manifest
    other = Design(families=SMALL.families, parent_pairs=100, relative_pairs=(20, 40),
                   held_out={"dev": 5, "test": 5})
    with pytest.raises(PrepareError, match="another design or English.*--force"):
        build(out, english_from=corpus, design=other, vocab_size=400, verbose=False)


def test_a_build_waits_while_another_holds_the_directory_then_builds(corpus: Path,
                                                                   tmp_path: Path) -> None:
    # Two builds into one directory (two runs of a sweep started together): the second must not
    # write the TSV the first is preparing from; it waits for the lock, then builds (or reuses).
    out = tmp_path / "related"
    result: dict[str, object] = {}

    def second() -> None:
        result["manifest"] = build(out, english_from=corpus, design=SMALL, vocab_size=400,
                                   num_threads=1, verbose=False)

    with corpus_lock(out / "source"):  # the first builder, mid-way
        waiting = threading.Thread(target=second)
        waiting.start()
        waiting.join(timeout=2.0)
        assert waiting.is_alive() and not (out / "source" / "design.json").exists()
    waiting.join(timeout=120.0)
    assert not waiting.is_alive() and result["manifest"] == read_manifest(out)


def test_a_design_larger_than_the_english_is_refused_with_the_numbers(corpus: Path,
                                                                       tmp_path: Path) -> None:
    pools = read_english(corpus)
    big = Design(families=SMALL.families, parent_pairs=len(pools["train"]) + 1,
                 relative_pairs=(20, 40), held_out={"dev": 5, "test": 5})
    with pytest.raises(PrepareError, match=rf"train \({len(pools['train'])}, "
                                           rf"{len(pools['train']) + 1}\)"):
        build(tmp_path / "x", english_from=corpus, design=big, verbose=False)
    with pytest.raises(PrepareError, match="no prepared corpus in .*--english-from"):
        build(tmp_path / "y", english_from=tmp_path / "nothing", design=SMALL, verbose=False)


def test_every_language_of_the_design_writes_every_word() -> None:
    written = languages(SMALL, WORDS)
    assert sorted(written) == ["qaa", "qab", "qac", "qba", "qbb", "qbc"]
    for lang in written.values():
        assert set(lang.lexicon) == WORDS
        lang.write(" ".join(sorted(WORDS)))  # no KeyError
