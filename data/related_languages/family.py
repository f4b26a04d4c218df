"""Synthetic languages written from English, in families whose members are related by design.

A *parent* language rewrites every English word with its own lexicon (a made-up word per English
word type, from the family's letters) and, for one of the families, reverses the word order. A
*relative* of a parent takes most of its words from the parent, changed by a few regular sound
changes (a letter of the family's inventory written as another, everywhere), and the rest from
a lexicon of its own. So what a model learns for the parent transfers to its relatives through
a rule it can find, which is what the depth-against-width complement needs (issue 21): in the
real mix, whether a low-resource language can borrow from its high-resource relative depends on
how related they are on these UI strings; here it is guaranteed.

Only letters A-Z are words. Placeholders (``%s``, ``%1$d``, ``{name}``), markup (``<b>``,
``&amp;``), addresses, digits, punctuation and spaces are copied unchanged, where they stand;
reversal moves words only, so the copied parts keep their places.

Everything is a pure function of the English vocabulary and the names: building twice gives the
same languages. This module imports nothing of the apps (nor torch).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Placeholders, markup, entities and addresses: copied as they are.
_OPAQUE = (r"%(?:\d+\$)?[-+ #0]*\d*(?:\.\d+)?[a-zA-Z]|\{[^{}]*\}|<[^<>]*>|&[a-zA-Z]+;"
           r"|[a-z]+://\S+|\S+@\S+\.\S+")
_TOKEN = re.compile(rf"(?P<opaque>{_OPAQUE})|(?P<word>[A-Za-z]+)|(?P<other>.)", re.DOTALL)


def tokens(english: str) -> list[tuple[bool, str]]:
    """``(is_word, text)`` pieces of ``english`` that concatenate back to it."""
    pieces: list[tuple[bool, str]] = []
    for match in _TOKEN.finditer(english):
        is_word = match.lastgroup == "word"
        if not is_word and pieces and not pieces[-1][0]:
            pieces[-1] = (False, pieces[-1][1] + match.group())
        else:
            pieces.append((is_word, match.group()))
    return pieces


def english_words(sentences: Iterable[str]) -> set[str]:
    """The English word types (lower case) of ``sentences``: what a lexicon must cover."""
    return {text.lower() for sentence in sentences for is_word, text in tokens(sentence) if is_word}


def _rng(*key: object) -> random.Random:
    digest = hashlib.blake2b("\x1f".join(map(str, key)).encode("utf-8"), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


@dataclass(frozen=True)
class Phonology:
    """A family's letters: words are syllables of a consonant, a vowel and, at times, a coda."""

    consonants: str
    vowels: str
    coda_rate: float = 0.3

    def word(self, rng: random.Random, syllables: int) -> str:
        parts = []
        for _ in range(syllables):
            parts.append(rng.choice(self.consonants) + rng.choice(self.vowels))
            if rng.random() < self.coda_rate:
                parts.append(rng.choice(self.consonants))
        return "".join(parts)


def syllables_for(word: str) -> int:
    """A made-up word's length follows the English one: 1 syllable up to 2 letters, then one
    more for every 3 letters ("the" 2, "file" 2, "settings" 3)."""
    return 1 + len(word) // 3


def make_lexicon(words: Iterable[str], phonology: Phonology, name: str,
                 taken: Iterable[str] = ()) -> dict[str, str]:
    """A made-up word for each English word, none equal to another (nor to one in ``taken``):
    drawn from a hash of (``name``, word), redrawn on a clash, in sorted order."""
    used = set(taken)
    lexicon: dict[str, str] = {}
    for word in sorted(set(words)):
        attempt = 0
        while True:
            candidate = phonology.word(_rng(name, word, attempt), syllables_for(word) + attempt // 8)
            if candidate not in used:
                break
            attempt += 1
        used.add(candidate)
        lexicon[word] = candidate
    return lexicon


def sound_changes(phonology: Phonology, name: str, count: int) -> dict[str, str]:
    """``count`` regular sound changes of a relative ``name``: each letter of the family's
    inventory changed becomes another of the same kind (consonant to consonant, vowel to vowel);
    at most one change per letter, none chained."""
    rng = _rng(name, "changes")
    changes: dict[str, str] = {}
    letters = sorted(phonology.consonants + phonology.vowels)
    rng.shuffle(letters)
    for letter in letters:
        if len(changes) == count:
            break
        kind = phonology.consonants if letter in phonology.consonants else phonology.vowels
        targets = [t for t in kind if t != letter and t not in changes]
        if targets:
            changes[letter] = rng.choice(targets)
    return changes


def change_sounds(word: str, changes: Mapping[str, str]) -> str:
    return "".join(changes.get(letter, letter) for letter in word)


@dataclass(frozen=True)
class Language:
    """One synthetic language: how it writes an English sentence."""

    name: str
    lexicon: Mapping[str, str] = field(repr=False)
    reverse: bool
    parent: str | None = None
    changes: Mapping[str, str] = field(default_factory=dict)
    own_words: frozenset[str] = field(default_factory=frozenset, repr=False)

    def write(self, english: str) -> str:
        """``english`` in this language: each word from the lexicon in the English word's case,
        the word order reversed where the language does, everything else where it stood."""
        pieces = tokens(english)
        words = [self._word(text) for is_word, text in pieces if is_word]
        if self.reverse:
            words.reverse()
        out, index = [], 0
        for is_word, text in pieces:
            if is_word:
                out.append(words[index])
                index += 1
            else:
                out.append(text)
        return "".join(out)

    def _word(self, english: str) -> str:
        made = self.lexicon[english.lower()]
        if len(english) > 1 and english.isupper():
            return made.upper()
        if english[0].isupper():
            return made[:1].upper() + made[1:]
        return made


def parent_language(name: str, words: Iterable[str], phonology: Phonology, *,
                    reverse: bool) -> Language:
    return Language(name, make_lexicon(words, phonology, name), reverse)


def relative_language(name: str, parent: Language, phonology: Phonology, *, changes: int,
                      own_fraction: float) -> Language:
    """A relative of ``parent``: its word order; for a hash-chosen ``own_fraction`` of the word
    types a word of its own, for the rest the parent's word under ``changes`` sound changes."""
    sound = sound_changes(phonology, name, changes)
    own = frozenset(w for w in parent.lexicon if _rng(name, "own", w).random() < own_fraction)
    inherited = {w: change_sounds(made, sound) for w, made in parent.lexicon.items() if w not in own}
    lexicon = {**inherited, **make_lexicon(own, phonology, name, taken=inherited.values())}
    return Language(name, lexicon, parent.reverse, parent=parent.name, changes=sound,
                    own_words=own)
