"""Phase 5, tokenizer: one SentencePiece model shared by every source language and English.

Trained on a bounded sample (sources drawn per language by ``temperature_probs``, plus unique
English sentences), with the corpus format's fixed special ids and one control symbol per
source language.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data.gettext_m2en.corpus_format import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Triple,
    lang_tag,
    temperature_probs,
)
from data.gettext_m2en.errors import PrepareError


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
