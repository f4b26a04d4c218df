"""Tests of the gettext many-to-English corpus, its tokenizer, shards and NMT batches."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import polib
import pytest
import torch
import webdataset as wds

from apps.nmt.data import (
    CorpusError,
    TrainBatches,
    eval_batches,
    language_counts,
    load_manifest,
    load_tokenizer,
    resource_buckets,
)
from data.gettext_m2en.clean import strip_accelerators
from data.gettext_m2en.corpus_format import temperature_probs
from data.gettext_m2en.errors import PrepareError
from data.gettext_m2en.languages import normalize_lang
from data.gettext_m2en.prepare import prepare
from data.gettext_m2en.splits import MAX_HELD_OUT_GROUP, assign_splits, split_key
from data.gettext_m2en.tokenizer import character_coverage

# Languages of the synthetic corpus and how many distinct English messages each translates:
# a high/low-resource skew like the real one.
SIZES = {"de": 600, "fr": 300, "ru": 120, "pt_BR": 40}
WORDS = "open save file folder print close window network audio video track playlist".split()
RU_PLURAL = (
    "nplurals=3; plural=(n%10==1 && n%100!=11 ? 0 : "
    "n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) ? 1 : 2);"
)
LONG = "word " * 80  # 400 characters: over the length filter


def english_sentence(i: int) -> str:
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(2 + i % 5)]
    return f"{' '.join(words).capitalize()} number {i}"


def translate(lang: str, english: str) -> str:
    # A deterministic stand-in for a translation: differs from English, keeps its length.
    return " ".join(f"{lang[:2]}{word[::-1]}" for word in english.split())


def write_catalog(path: Path, entries: list[polib.POEntry], plural_forms: str) -> None:
    catalog = polib.POFile()
    catalog.metadata = {
        "Content-Type": "text/plain; charset=UTF-8",
        "Plural-Forms": plural_forms,
    }
    for entry in entries:
        catalog.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    catalog.save_as_mofile(str(path))


def build_locale_tree(root: Path) -> None:
    """Catalogs in the /usr/share/locale layout, with every case the cleaning must handle."""
    locale = root / "usr" / "share" / "locale"
    for lang, size in SIZES.items():
        entries = [
            polib.POEntry(msgid=english_sentence(i), msgstr=translate(lang, english_sentence(i)))
            for i in range(size)
        ]
        plural_forms = RU_PLURAL if lang == "ru" else "nplurals=2; plural=(n != 1);"
        if lang == "de":
            entries += [
                polib.POEntry(msgid="_File", msgstr="_Datei"),
                polib.POEntry(msgid="&Open", msgstr="Ö&ffnen"),
                polib.POEntry(msgid="VLC media player", msgstr="VLC media player"),
                polib.POEntry(msgid="%s: %d", msgstr="%s – %d"),
                polib.POEntry(msgid=LONG, msgstr=LONG.upper()),
                # Same message under two contexts: one pair once context is stripped.
                polib.POEntry(msgctxt="menu", msgid="Print", msgstr="Drucken"),
                polib.POEntry(msgctxt="toolbar", msgid="Print", msgstr="Drucken"),
                polib.POEntry(
                    msgid="%d file",
                    msgid_plural="%d files",
                    msgstr_plural={0: "%d Datei", 1: "%d Dateien"},
                ),
            ]
        if lang == "ru":
            entries.append(
                polib.POEntry(
                    msgid="%d file",
                    msgid_plural="%d files",
                    msgstr_plural={0: "%d файл", 1: "%d файла", 2: "%d файлов"},
                )
            )
        write_catalog(locale / lang / "LC_MESSAGES" / "app.mo", entries, plural_forms)
    # The same messages again from a second program: duplicates.
    write_catalog(
        locale / "de" / "LC_MESSAGES" / "other.mo",
        [polib.POEntry(msgid="_File", msgstr="_Datei"), polib.POEntry(msgid="Quit", msgstr="")],
        "nplurals=2; plural=(n != 1);",
    )
    # A regional alias of fr (merged) and English variants (dropped: English is the target).
    write_catalog(
        locale / "fr_FR.UTF-8" / "LC_MESSAGES" / "app.mo",
        [polib.POEntry(msgid="Window title", msgstr="Titre de la fenêtre")],
        "nplurals=2; plural=(n > 1);",
    )
    write_catalog(
        locale / "en_GB" / "LC_MESSAGES" / "app.mo",
        [polib.POEntry(msgid="Color", msgstr="Colour")],
        "nplurals=2; plural=(n != 1);",
    )


PREPARE_ARGS: dict[str, Any] = {
    "packages": None,
    "vocab_size": 400,
    "dev_fraction": 0.1,
    "test_fraction": 0.1,
    "block_size": 64,
    "verbose": False,
}


def read_pairs(corpus: Path, split: str) -> list[tuple[str, str, str]]:
    lines = (corpus / "pairs" / f"{split}.tsv").read_text(encoding="utf-8").splitlines()
    return [tuple(line.split("\t")) for line in lines]  # type: ignore[misc]


def all_pairs(corpus: Path) -> list[tuple[str, str, str]]:
    return [pair for split in ("train", "dev", "test") for pair in read_pairs(corpus, split)]


# ---------------------------------------------------------------------------------------------
# Languages and cleaning


def test_normalize_lang() -> None:
    assert normalize_lang("de_DE.UTF-8") == "de"
    assert normalize_lang("pt_BR") == "pt_BR"
    assert normalize_lang("pt_PT") == "pt"
    assert normalize_lang("zh_TW") == "zh_TW"
    assert normalize_lang("sr@Latin") == "sr@latin"
    assert normalize_lang("ca@valencia") == "ca@valencia"
    assert normalize_lang("en_GB") is None
    assert normalize_lang("en@quot") is None
    assert normalize_lang("C") is None


@pytest.mark.parametrize(
    ("english", "source", "expected"),
    [
        ("_File", "_Datei", ("File", "Datei")),
        ("Save _As", "Speichern _unter", ("Save As", "Speichern unter")),
        ("&Open", "Ö&ffnen", ("Open", "Öffnen")),
        ("E&xit", "&Beenden", ("Exit", "Beenden")),
        ("_File", "ファイル(_F)", ("File", "ファイル")),
        ("_Open", "Фа_йл", ("Open", "Файл")),
        # Not mnemonics: identifiers and HTML entities are left alone.
        ("file_name", "Dateiname", ("file_name", "Dateiname")),
        ("x/_y properties", "x/_y Eigenschaften", ("x/_y properties", "x/_y Eigenschaften")),
        ("Tom &amp; Jerry", "Tom &amp; Jerry", ("Tom &amp; Jerry", "Tom &amp; Jerry")),
    ],
)
def test_strip_accelerators(english: str, source: str, expected: tuple[str, str]) -> None:
    assert strip_accelerators(english, source) == expected


def test_character_coverage_fits_the_vocabulary() -> None:
    # 300 distinct characters, the most frequent first: a budget of 100 must leave some out.
    lines = ["".join(chr(0x4E00 + i) * (300 - i) for i in range(300))]
    coverage = character_coverage(lines, budget=100)
    frequencies = sorted(range(1, 301), reverse=True)
    assert coverage <= sum(frequencies[:100]) / sum(frequencies)
    assert coverage > sum(frequencies[:99]) / sum(frequencies)
    assert character_coverage(["abc abc"], budget=100) == 0.9995


def test_cleaning(corpus: Path) -> None:
    pairs = all_pairs(corpus)
    triples = Counter(pairs)
    assert max(triples.values()) == 1, "duplicates must be removed"
    assert ("de", "Datei", "File") in triples
    assert ("de", "Öffnen", "Open") in triples
    assert triples[("de", "Drucken", "Print")] == 1  # context stripped, then deduplicated
    # Plural forms: the n=1 form for msgid, the n=5 form (Russian: index 2) for msgid_plural.
    assert ("de", "%d Datei", "%d file") in triples and ("de", "%d Dateien", "%d files") in triples
    assert ("ru", "%d файл", "%d file") in triples and ("ru", "%d файлов", "%d files") in triples
    englishes = {english for _, _, english in pairs}
    assert "VLC media player" not in englishes  # untranslated
    assert "Quit" not in englishes  # empty translation
    assert "%s: %d" not in englishes  # nothing to translate
    assert not any(len(english) > 256 for english in englishes)  # length filter
    assert all(source != english for _, source, english in pairs)
    assert {lang for lang, _, _ in pairs} == set(SIZES)  # fr_FR merged into fr, en_GB dropped
    assert ("fr", "Titre de la fenêtre", "Window title") in triples


def test_no_dev_or_test_english_in_train(corpus: Path) -> None:
    train_english = {english for _, _, english in read_pairs(corpus, "train")}
    for split in ("dev", "test"):
        held_out = {english for _, _, english in read_pairs(corpus, split)}
        assert held_out, f"{split} is empty"
        assert not held_out & train_english
    assert not {e for *_, e in read_pairs(corpus, "dev")} & {
        e for *_, e in read_pairs(corpus, "test")
    }


def test_split_key_folds_case_punctuation_ellipses_and_hyphens() -> None:
    assert split_key("Connecting...") == split_key("connecting") == "connecting"
    assert split_key("Bottom-Left") == split_key("Bottom left") == "bottom left"
    assert split_key("Loading…") == split_key("Loading")
    assert split_key("  Save   as: ") == "save as"
    assert split_key("Öffnen") != split_key("Offnen")  # letters are not folded


def assert_no_key_crosses_splits(splits: dict[tuple[str, str, str], str]) -> None:
    english_side: dict[str, str] = {}
    source_side: dict[tuple[str, str], str] = {}
    for (lang, source, english), split in splits.items():
        assert english_side.setdefault(split_key(english), split) == split, english
        assert source_side.setdefault((lang, split_key(source)), split) == split, source


def test_assign_splits_keeps_near_duplicates_and_shared_sources_together() -> None:
    # Large held-out fractions: without the grouping, many of these would cross splits.
    triples = []
    for i in range(200):
        english = f"Item number {i}"
        triples += [
            ("fr", f"Élément {i}", english),
            ("de", f"Eintrag {i}", english.upper() + "..."),
            ("de", f"Eintrag {i}", f"Item-number {i} please"),  # same source, other English
            ("fr", f"Élément {i} !", f"item number {i}…"),
        ]
    splits = assign_splits(triples, dev_fraction=0.3, test_fraction=0.3)
    assert set(splits) == set(triples)
    assert_no_key_crosses_splits(splits)
    assert {"train", "dev", "test"} <= set(splits.values())


def test_assign_splits_trains_groups_too_large_to_hold_out() -> None:
    # One source string ("OK") linking many English strings makes one large group.
    triples = [("de", "OK", f"Confirm choice {i}") for i in range(MAX_HELD_OUT_GROUP + 1)]
    assert set(assign_splits(triples, dev_fraction=0.5, test_fraction=0.5).values()) == {"train"}


def test_no_normalised_english_or_source_crosses_splits(corpus: Path) -> None:
    splits = {pair: split for split in ("train", "dev", "test") for pair in read_pairs(corpus, split)}
    assert_no_key_crosses_splits(splits)


def test_counts_json(corpus: Path) -> None:
    counts = json.loads((corpus / "counts.json").read_text())
    for split in ("train", "dev", "test"):
        assert counts[split] == dict(Counter(lang for lang, _, _ in read_pairs(corpus, split)))
    assert counts["total"]["de"] == sum(counts[s].get("de", 0) for s in ("train", "dev", "test"))
    assert language_counts(corpus, "train") == counts["train"]
    manifest = load_manifest(corpus)
    assert manifest["stats"]["unique_pairs"] == len(all_pairs(corpus))
    assert manifest["splits"]["dev"]["pairs"] == sum(counts["dev"].values())


def test_prepare_reuses_a_finished_corpus(corpus: Path) -> None:
    manifest = load_manifest(corpus)
    again = prepare(corpus, locale_roots=manifest["config"]["locale_roots"], **PREPARE_ARGS)
    assert again == manifest


# ---------------------------------------------------------------------------------------------
# Tokenizer and shards


def test_tokenizer_round_trip(corpus: Path) -> None:
    tokenizer = load_tokenizer(corpus)
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    for text in ["Open file number 12", "Öffnen", "Titre de la fenêtre", "%d файлов", "日本語"]:
        ids = tokenizer.encode_target(text)
        assert tokenizer.unk_id not in ids  # byte fallback covers unseen characters
        assert tokenizer.decode(ids) == text
    source = tokenizer.encode_source("Datei", "de")
    assert source[0] == tokenizer.lang_id("de")
    assert tokenizer.decode(source) == "Datei"  # the language tag decodes to nothing
    assert len({tokenizer.lang_id(lang) for lang in SIZES}) == len(SIZES)
    # A literal "<de>" in a message is text, not the language tag (tags are control symbols).
    assert tokenizer.lang_id("de") not in tokenizer.encode_target("<de>")


def test_shards_readable(corpus: Path) -> None:
    manifest = load_manifest(corpus)
    tokenizer = load_tokenizer(corpus)
    for split in ("train", "dev"):
        urls = [str(corpus / name) for name in manifest["splits"][split]["shards"]]
        total = 0
        for sample in wds.WebDataset(urls, shardshuffle=False).decode():
            lengths = sample["src_len.npy"]
            assert sample["src.npy"].dtype == np.uint16
            assert lengths.sum() == len(sample["src.npy"])
            assert sample["tgt_len.npy"].sum() == len(sample["tgt.npy"])
            assert sample["src.npy"][0] == tokenizer.lang_id(sample["lang.txt"])
            total += len(lengths)
            if split == "dev":
                text = sample["text.json"]
                first = sample["tgt.npy"][: sample["tgt_len.npy"][0]]
                assert tokenizer.decode(first.tolist()) == text["references"][0]
                assert len(text["sources"]) == len(lengths)
        assert total == manifest["splits"][split]["pairs"]


# ---------------------------------------------------------------------------------------------
# Batches


def test_temperature_sampling_matches_formula(corpus: Path) -> None:
    temperature = 2.0
    stream = TrainBatches(corpus, max_tokens=512, temperature=temperature, seed=3, max_len=64)
    counts = language_counts(corpus, "train")
    weights = {lang: n ** (1 / temperature) for lang, n in counts.items()}
    expected = {lang: w / sum(weights.values()) for lang, w in weights.items()}
    assert stream.probs == pytest.approx(expected)
    assert temperature_probs(counts, 1.0)["de"] == pytest.approx(
        counts["de"] / sum(counts.values())
    )
    seen: Counter[str] = Counter()
    while sum(seen.values()) < 20_000:
        seen.update(next(stream).langs)
    rows = sum(seen.values())
    for lang, prob in expected.items():
        # 5 standard deviations of a binomial frequency: fails by chance ~1e-6 of the time.
        tolerance = 5 * (prob * (1 - prob) / rows) ** 0.5
        assert abs(seen[lang] / rows - prob) < tolerance, (lang, seen[lang] / rows, prob)


def test_batches_respect_max_tokens_and_padding(corpus: Path) -> None:
    tokenizer = load_tokenizer(corpus)
    stream = TrainBatches(corpus, max_tokens=300, seed=0, max_len=48, pool_size=512)
    for _ in range(60):
        batch = next(stream)
        assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.int64
        assert batch.src.numel() <= 300 and batch.tgt_in.numel() <= 300
        assert batch.tgt_in.shape == batch.tgt_out.shape
        assert batch.src.shape[0] == batch.tgt_in.shape[0] == len(batch.langs)
        for row, lang in enumerate(batch.langs):
            src = batch.src[row]
            src_len = int((src != tokenizer.pad_id).sum())
            assert (src[src_len:] == tokenizer.pad_id).all()  # padding only on the right
            assert src[0] == tokenizer.lang_id(lang)
            tgt_len = int((batch.tgt_out[row] != tokenizer.pad_id).sum())
            tgt_out, tgt_in = batch.tgt_out[row], batch.tgt_in[row]
            assert tgt_out[tgt_len - 1] == tokenizer.eos_id
            assert tgt_in[0] == tokenizer.bos_id
            assert torch.equal(tgt_in[1:tgt_len], tgt_out[: tgt_len - 1])
            assert (tgt_in[tgt_len:] == tokenizer.pad_id).all()
        # Every column is used by some row: no all-padding columns.
        assert (batch.src[:, -1] != tokenizer.pad_id).any()
        assert (batch.tgt_out[:, -1] != tokenizer.pad_id).any()


def test_batches_deterministic_and_resumable(corpus: Path) -> None:
    def take(stream: TrainBatches, n: int) -> list[torch.Tensor]:
        return [next(stream).src for _ in range(n)]

    first = TrainBatches(corpus, max_tokens=256, seed=7, max_len=48, pool_size=128)
    reference = take(first, 12)  # crosses pool boundaries
    again = take(TrainBatches(corpus, max_tokens=256, seed=7, max_len=48, pool_size=128), 12)
    assert all(torch.equal(a, b) for a, b in zip(reference, again, strict=True))
    other_seed = take(TrainBatches(corpus, max_tokens=256, seed=8, max_len=48, pool_size=128), 3)
    assert not all(torch.equal(a, b) for a, b in zip(reference, other_seed, strict=False))

    stream = TrainBatches(corpus, max_tokens=256, seed=7, max_len=48, pool_size=128)
    take(stream, 5)
    state = stream.state_dict()
    resumed = TrainBatches(corpus, max_tokens=256, seed=7, max_len=48, pool_size=128)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 7), reference[5:], strict=True))


def test_eval_batches(corpus: Path) -> None:
    dev = read_pairs(corpus, "dev")
    batches = list(eval_batches(corpus, "dev", max_tokens=200))
    assert all(len(set(batch.langs)) == 1 for batch in batches)
    assert [lang for batch in batches for lang in batch.langs] == [lang for lang, _, _ in dev]
    assert [s for batch in batches for s in batch.sources or []] == [s for _, s, _ in dev]
    assert [r for batch in batches for r in batch.references or []] == [e for _, _, e in dev]
    assert all(batch.src.numel() <= 200 or len(batch) == 1 for batch in batches)
    tokenizer = load_tokenizer(corpus)
    assert tokenizer.decode(batches[0].tgt_out[0]) == (batches[0].references or [])[0]
    limited = list(eval_batches(corpus, "test", languages=["ru", "de"], max_per_lang=3))
    langs = [lang for batch in limited for lang in batch.langs]
    assert langs == ["ru"] * min(3, language_counts(corpus, "test")["ru"]) + ["de"] * 3


def test_resource_buckets_by_absolute_size() -> None:
    counts = {"fr": 12_400, "af": 4_254, "sw": 508, "edge_high": 10_000, "edge_low": 999}
    assert resource_buckets(counts, (10_000, 1_000)) == {
        "fr": "high", "af": "medium", "sw": "low", "edge_high": "high", "edge_low": "low",
    }
    with pytest.raises(ValueError, match="high > low"):
        resource_buckets(counts, (1_000, 10_000))


def test_resource_buckets() -> None:
    counts = {"a": 600, "b": 500, "c": 40, "d": 30, "e": 2, "f": 1}
    assert resource_buckets(counts) == {
        "a": "high", "b": "high", "c": "medium", "d": "medium", "e": "low", "f": "low",
    }  # fmt: skip
    assert resource_buckets({"x": 5}) == {"x": "high"}
    assert set(resource_buckets({lang: n for lang, n in SIZES.items()}).values()) == {
        "high",
        "medium",
        "low",
    }


# ---------------------------------------------------------------------------------------------
# User corpora and errors


def test_user_corpus_tsv_and_aligned(tmp_path: Path) -> None:
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text(
        "".join(
            f"es\t{translate('es', english_sentence(i))}\t{english_sentence(i)}\n"
            for i in range(80)
        ),
        encoding="utf-8",
    )
    aligned = tmp_path / "aligned"
    aligned.mkdir()
    englishes = [english_sentence(i) for i in range(100, 160)]
    (aligned / "it-en.en").write_text("\n".join(englishes) + "\n", encoding="utf-8")
    (aligned / "it-en.it").write_text(
        "\n".join(translate("it", e) for e in englishes) + "\n", encoding="utf-8"
    )
    out = tmp_path / "corpus"
    manifest = prepare(out, tsv_files=[tsv], aligned_dirs=[aligned], **PREPARE_ARGS)
    assert manifest["languages"] == ["es", "it"]
    assert json.loads((out / "counts.json").read_text())["total"] == {"es": 80, "it": 60}


def test_prepare_keeps_only_requested_languages(tmp_path: Path) -> None:
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text(
        "".join(
            f"{lang}\t{translate(lang, english_sentence(i))}\t{english_sentence(i)}\n"
            for lang in ("de", "fr", "pt_BR")
            for i in range(40)
        ),
        encoding="utf-8",
    )
    manifest = prepare(tmp_path / "c", tsv_files=[tsv], languages=["pt_BR", "de"], **PREPARE_ARGS)
    assert manifest["languages"] == ["de", "pt_BR"]
    with pytest.raises(PrepareError, match=r"no pairs for language\(s\) \['xx'\].*de fr pt_BR"):
        prepare(tmp_path / "d", tsv_files=[tsv], languages=["de", "xx"], **PREPARE_ARGS)


def test_missing_corpus_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"python -m data\.gettext_m2en\.prepare --out"):
        TrainBatches(tmp_path / "nothing", max_tokens=512)
    with pytest.raises(PrepareError, match="no corpus source"):
        prepare(tmp_path / "out", packages=None, verbose=False)


def test_too_small_vocabulary_is_an_error(tmp_path: Path) -> None:
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"de\tHallo {i}\tHello {i}\n" for i in range(30)), encoding="utf-8")
    with pytest.raises(PrepareError, match="vocab_size=100 leaves no room.*use at least 325"):
        prepare(tmp_path / "out", **{**PREPARE_ARGS, "vocab_size": 100}, tsv_files=[tsv])


def test_unknown_language_is_an_error(corpus: Path) -> None:
    with pytest.raises(CorpusError, match=r"no train data for language\(s\) \['xx'\].*de fr"):
        TrainBatches(corpus, max_tokens=512, languages=["de", "xx"])
    with pytest.raises(CorpusError, match="no dev data"):
        eval_batches(corpus, "dev", languages=["xx"])  # raised at the call, before iterating


def test_missing_tokenizer_is_an_error(corpus: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(corpus, broken)
    (broken / "spm" / "spm.model").unlink()
    with pytest.raises(CorpusError, match=r"tokenizer .*spm\.model is missing.*--force"):
        load_tokenizer(broken)


def test_max_tokens_below_max_len_is_an_error(corpus: Path) -> None:
    with pytest.raises(ValueError, match="max_tokens=32 is smaller than max_len=64"):
        TrainBatches(corpus, max_tokens=32, max_len=64)


def test_a_truncated_shard_is_named_with_the_prepare_command(corpus: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "corpus"
    shutil.copytree(corpus, damaged)
    manifest = json.loads((damaged / "manifest.json").read_text())
    shard = damaged / manifest["splits"]["train"]["shards"][0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with pytest.raises(CorpusError, match=rf"corpus shard {shard} is damaged .*; rebuild the "
                       rf"corpus with `python -m data.gettext_m2en.prepare --out {damaged} "
                       "--force`"):
        TrainBatches(damaged, max_tokens=256, temperature=1.0, seed=0)


def test_one_process_at_a_time_prepares_a_corpus(tmp_path: Path) -> None:
    from data.gettext_m2en.errors import PrepareError
    from data.gettext_m2en.lock import corpus_lock

    out = tmp_path / "corpus"
    with corpus_lock(out):  # another holder (a second open file is another lock owner)
        with pytest.raises(PrepareError, match=r"corpus\.lock for over 0 s while preparing"):
            with corpus_lock(out, timeout_s=0.2, poll_s=0.05):
                pass
    with corpus_lock(out, timeout_s=0.2):  # released: taken at once
        assert (tmp_path / "corpus.lock").exists()
