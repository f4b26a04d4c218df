"""Training and evaluation batches for the many-to-English NMT app, read from prepared shards."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from data.gettext_m2en.corpus_format import (
    COUNTS_FILE,
    DEFAULT_OUT,
    MANIFEST_FILE,
    SAMPLE_MEMBERS,
    TEXT_MEMBER,
    lang_tag,
    read_manifest,
    shard_entry,
    temperature_probs,
)

__all__ = [
    "Batch",
    "CorpusError",
    "Tokenizer",
    "TrainBatches",
    "eval_batches",
    "language_counts",
    "load_manifest",
    "load_tokenizer",
    "resource_buckets",
]

RESOURCE_BUCKETS: tuple[str, ...] = ("high", "medium", "low")


class CorpusError(RuntimeError):
    """The prepared corpus is missing or does not hold what was asked; the message says the fix."""


def _prepare_command(cache_dir: Path) -> str:
    return f"python -m data.gettext_m2en.prepare --out {cache_dir}"


def load_manifest(cache_dir: str | Path = DEFAULT_OUT) -> dict[str, Any]:
    """The `manifest.json` written by prepare, or a CorpusError naming the command that builds it."""
    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise CorpusError(
            f"no prepared corpus at {cache_dir} ({MANIFEST_FILE} missing); "
            f"build it with `{_prepare_command(cache_dir)}`"
        )
    return manifest


# ---------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """The corpus's shared SentencePiece model plus the conventions of this app.

    A source is `[<lang>] + pieces(text)` (the language tag is a control symbol), a target is
    `pieces(text)`; BOS/EOS are added by the batcher. `fingerprint` identifies the model file:
    save it in checkpoints and compare on load to catch a tokenizer that does not match.
    """

    def __init__(self, model_file: str | Path, manifest: Mapping[str, Any]) -> None:
        import sentencepiece as spm

        model_file = Path(model_file)
        if not model_file.exists():
            raise CorpusError(
                f"tokenizer {model_file} is missing; rebuild the corpus with "
                f"`{_prepare_command(model_file.parent.parent)} --force`"
            )
        self.path = model_file
        self.processor = spm.SentencePieceProcessor(model_file=str(model_file))
        self.fingerprint = hashlib.sha256(model_file.read_bytes()).hexdigest()[:16]
        self.vocab_size: int = self.processor.get_piece_size()
        self.pad_id: int = int(manifest["pad_id"])
        self.unk_id: int = int(manifest["unk_id"])
        self.bos_id: int = int(manifest["bos_id"])
        self.eos_id: int = int(manifest["eos_id"])
        self.languages: list[str] = list(manifest["languages"])
        self._lang_ids: dict[str, int] = {
            lang: self.processor.piece_to_id(lang_tag(lang)) for lang in self.languages
        }

    def lang_id(self, lang: str) -> int:
        """Id of the source-language tag `<lang>`."""
        if lang not in self._lang_ids:
            raise CorpusError(
                f"language {lang!r} has no tag in tokenizer {self.path}; "
                f"known: {' '.join(self.languages)}"
            )
        return self._lang_ids[lang]

    def encode_source(self, text: str, lang: str) -> list[int]:
        return [self.lang_id(lang), *self.processor.encode(text)]

    def encode_target(self, text: str) -> list[int]:
        return list(self.processor.encode(text))

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text of `ids`, stopping at the first EOS; pad, BOS and language tags are dropped."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        kept: list[int] = []
        for token in ids:
            if token == self.eos_id:
                break
            kept.append(int(token))
        # Control symbols (pad, bos, eos, language tags) decode to nothing.
        return str(self.processor.decode(kept))


def load_tokenizer(cache_dir: str | Path = DEFAULT_OUT) -> Tokenizer:
    """The tokenizer of the corpus prepared under `cache_dir`."""
    cache_dir = Path(cache_dir)
    manifest = load_manifest(cache_dir)
    return Tokenizer(cache_dir / manifest["tokenizer"], manifest)


# ---------------------------------------------------------------------------------------------
# Languages


def language_counts(cache_dir: str | Path = DEFAULT_OUT, split: str = "train") -> dict[str, int]:
    """Number of pairs per language in `split`, from `counts.json` (no shard is read)."""
    cache_dir = Path(cache_dir)
    load_manifest(cache_dir)  # a clear error if the corpus is missing
    counts = json.loads((cache_dir / COUNTS_FILE).read_text())
    if split not in counts:
        raise CorpusError(f"split {split!r} not in {cache_dir / COUNTS_FILE}: {list(counts)}")
    return {lang: int(n) for lang, n in counts[split].items()}


def resource_buckets(
    counts: Mapping[str, int], thresholds: Sequence[int] | None = None
) -> dict[str, str]:
    """`high`, `medium` or `low` per language, by training-set size.

    With ``thresholds = (high, low)``: `high` from ``high`` pairs up, `low` below ``low``,
    `medium` between (the NMT default is (10000, 1000): buckets that differ by 10x or more, a
    real resource contrast). With None: terciles of the languages present, for corpora too
    small or too even for absolute sizes to mean anything; languages are sorted by count,
    largest first (ties by name), and the i-th of n goes to bucket `i * 3 // n` (4 languages:
    2 high, 1 medium, 1 low; 1 language: high).
    """
    if thresholds is not None:
        high, low = thresholds
        if not high > low > 0:
            raise ValueError(f"thresholds={list(thresholds)} must be (high, low) with high > low > 0")
        return {
            lang: "high" if n >= high else "low" if n < low else "medium"
            for lang, n in counts.items()
        }
    ordered = sorted(counts, key=lambda lang: (-counts[lang], lang))
    return {lang: RESOURCE_BUCKETS[i * 3 // len(ordered)] for i, lang in enumerate(ordered)}


# ---------------------------------------------------------------------------------------------
# Reading a split


@dataclass
class _Language:
    """All pairs of one language of one split, ids concatenated (compact: no object per pair)."""

    src: np.ndarray  # flat source ids
    src_start: np.ndarray  # int64 offset of each source in `src`
    src_len: np.ndarray  # int64
    tgt: np.ndarray
    tgt_start: np.ndarray
    tgt_len: np.ndarray
    sources: list[str] = field(default_factory=list)  # raw text, dev/test only
    references: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.src_len)


def _check_languages(
    languages: Sequence[str] | None, counts: Mapping[str, int], split: str, cache_dir: Path
) -> list[str]:
    if languages is None:
        return sorted(lang for lang, n in counts.items() if n > 0)
    missing = [lang for lang in languages if counts.get(lang, 0) == 0]
    if missing:
        available = " ".join(sorted(lang for lang, n in counts.items() if n > 0))
        raise CorpusError(
            f"no {split} data for language(s) {missing} in {cache_dir}; "
            f"languages with {split} data: {available} (counts in {cache_dir / COUNTS_FILE})"
        )
    return list(dict.fromkeys(languages))


# shards whose size and SHA-256 were checked in this process: (path, size, mtime), so that a
# run checks each once (the dev split is read again at every evaluation), not per read
_VERIFIED: set[tuple[str, int, int]] = set()


def _verify_shard(path: Path, entry: Mapping[str, Any] | None, rebuild: str) -> None:
    """CorpusError naming ``path`` unless its size and SHA-256 are those manifest.json records
    (``entry``; None: an older corpus that records none, read unchecked). Once per process."""
    if entry is None:
        return
    status = path.stat()
    key = (str(path.resolve()), status.st_size, status.st_mtime_ns)
    if key in _VERIFIED:
        return
    if status.st_size != entry["bytes"]:
        raise CorpusError(
            f"corpus shard {path} is damaged ({status.st_size} bytes, but manifest.json "
            f"records {entry['bytes']}: {'truncated' if status.st_size < entry['bytes'] else 'extended'}); {rebuild}"
        )
    if shard_entry(path)["sha256"] != entry["sha256"]:
        raise CorpusError(
            f"corpus shard {path} is damaged (its SHA-256 differs from the one manifest.json "
            f"records: same size, altered bytes); {rebuild}"
        )
    _VERIFIED.add(key)


def _check_ids(sample: Mapping[str, Any], vocab_size: int) -> None:
    """ValueError unless every token id of a shard's ``sample`` is in [0, vocab_size): an id
    past the vocabulary would fail inside the embedding as ``IndexError: index out of range in
    self``, naming nothing; an id count that disagrees with the lengths is damage too."""
    for ids, lengths in (("src.npy", "src_len.npy"), ("tgt.npy", "tgt_len.npy")):
        values = sample[ids]
        if len(values) != int(np.sum(sample[lengths])):
            raise ValueError(f"sample {sample['__key__']}: {ids} holds {len(values)} ids but "
                             f"{lengths} sums to {int(np.sum(sample[lengths]))}")
        if len(values) and (int(values.max()) >= vocab_size or int(values.min()) < 0):
            bad = int(values.max()) if int(values.max()) >= vocab_size else int(values.min())
            raise ValueError(f"sample {sample['__key__']}: {ids} holds token id {bad}, outside "
                             f"the vocabulary [0, {vocab_size})")


def _read_split(cache_dir: Path, split: str, languages: Sequence[str]) -> dict[str, _Language]:
    import webdataset as wds

    manifest = load_manifest(cache_dir)
    urls = [str(cache_dir / name) for name in manifest["splits"][split]["shards"]]
    missing = [url for url in urls if not Path(url).exists()]
    if missing:
        raise CorpusError(
            f"shards {missing[:3]} are missing; rebuild with `{_prepare_command(cache_dir)} --force`"
        )
    wanted = set(languages)
    blocks: dict[str, list[dict[str, Any]]] = {lang: [] for lang in languages}
    # Every process reads the whole split (under torchrun too: each rank draws the same batches
    # from it by seed), so no node or worker splitting; webdataset's default node splitter
    # raises as soon as torch.distributed is initialised with more than one rank.
    rebuild = f"rebuild the corpus with `{_prepare_command(cache_dir)} --force`"
    recorded = manifest["splits"][split].get("files") or {}  # none in older corpora
    vocab_size = int(manifest["vocab_size"])
    pairs = 0
    for name, url in zip(manifest["splits"][split]["shards"], urls, strict=True):
        # one shard at a time, so that a damaged one is named
        _verify_shard(Path(url), recorded.get(name), rebuild)
        dataset = wds.WebDataset(
            [url], shardshuffle=False, empty_check=False, nodesplitter=None, workersplitter=None
        ).decode()
        try:
            for sample in dataset:
                missing_keys = SAMPLE_MEMBERS - set(sample)
                if missing_keys:  # a tar cut short ends in a partial sample
                    raise KeyError(f"sample {sample.get('__key__')} lacks {sorted(missing_keys)}")
                pairs += len(sample["src_len.npy"])
                _check_ids(sample, vocab_size)
                lang = sample["lang.txt"]
                if lang in wanted:
                    blocks[lang].append(sample)
        except Exception as error:  # noqa: BLE001 - tarfile, decoding and key errors alike
            detail = " ".join(f"{type(error).__name__}: {error}".split())[:200]
            raise CorpusError(f"corpus shard {url} is damaged ({detail}); {rebuild}") from None
    expected = manifest["splits"][split].get("pairs")
    if expected is not None and pairs != expected:
        raise CorpusError(
            f"the {split} shards of {cache_dir} hold {pairs} pairs but manifest.json records "
            f"{expected}: a shard is truncated; {rebuild}"
        )
    result = {}
    for lang in languages:
        parts = sorted(blocks[lang], key=lambda sample: sample["__key__"])
        src_len = np.concatenate([p["src_len.npy"] for p in parts]).astype(np.int64)
        tgt_len = np.concatenate([p["tgt_len.npy"] for p in parts]).astype(np.int64)
        texts = [p[TEXT_MEMBER] for p in parts if TEXT_MEMBER in p]
        result[lang] = _Language(
            src=np.concatenate([p["src.npy"] for p in parts]),
            src_start=np.concatenate([[0], np.cumsum(src_len)[:-1]]).astype(np.int64),
            src_len=src_len,
            tgt=np.concatenate([p["tgt.npy"] for p in parts]),
            tgt_start=np.concatenate([[0], np.cumsum(tgt_len)[:-1]]).astype(np.int64),
            tgt_len=tgt_len,
            sources=[s for text in texts for s in text["sources"]],
            references=[r for text in texts for r in text["references"]],
        )
    return result


# ---------------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    """Padded, batch-first int64 tensors for teacher forcing, plus each row's language.

    `src` [B, S]: language tag + source pieces; `tgt_in` [B, T]: BOS + target pieces;
    `tgt_out` [B, T]: target pieces + EOS. Padding (pad id) on the right; a position is real
    where `tensor != pad_id`. Evaluation batches also carry the raw text.
    """

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    langs: list[str]
    sources: list[str] | None = None  # raw source sentences (copy-the-source baseline)
    references: list[str] | None = None  # raw English references (BLEU)

    def __len__(self) -> int:
        return len(self.langs)


def _collate(
    rows: Sequence[tuple[_Language, int]], special_ids: tuple[int, int, int]
) -> tuple[Tensor, Tensor, Tensor]:
    """Pad `rows` (language data, pair index) into src, tgt_in, tgt_out."""
    pad_id, bos_id, eos_id = special_ids
    src_width = max(int(data.src_len[i]) for data, i in rows)
    tgt_width = max(int(data.tgt_len[i]) for data, i in rows) + 1
    src = np.full((len(rows), src_width), pad_id, dtype=np.int64)
    tgt_in = np.full((len(rows), tgt_width), pad_id, dtype=np.int64)
    tgt_out = np.full((len(rows), tgt_width), pad_id, dtype=np.int64)
    for row, (data, i) in enumerate(rows):
        s0, sn = data.src_start[i], data.src_len[i]
        t0, tn = data.tgt_start[i], data.tgt_len[i]
        src[row, :sn] = data.src[s0 : s0 + sn]
        target = data.tgt[t0 : t0 + tn]
        tgt_in[row, 0] = bos_id
        tgt_in[row, 1 : tn + 1] = target
        tgt_out[row, :tn] = target
        tgt_out[row, tn] = eos_id
    return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


class TrainBatches(Iterator[Batch]):
    """Infinite, deterministic stream of training batches.

    Rows are drawn in *pools* of `pool_size`: each row's language is drawn with temperature
    sampling (p_lang proportional to n_lang ** (1/T)), then a pair uniformly (with replacement)
    within that language. A pool is sorted by length (bucketing, little padding) and cut
    greedily into batches whose padded size stays within `max_tokens` on each side:
    `B * S <= max_tokens` and `B * T <= max_tokens`. The batches of a pool come in a random
    order. Pool k depends only on (seed, k), so the stream resumes exactly from
    `state_dict()` and every pipeline stage that builds it with the same seed sees the same
    batches.

    Pairs longer than `max_len` tokens (source with its tag, or target + 1) are skipped.
    """

    def __init__(
        self,
        cache_dir: str | Path = DEFAULT_OUT,
        *,
        max_tokens: int,
        temperature: float = 5.0,
        seed: int = 0,
        languages: Sequence[str] | None = None,
        max_len: int = 128,
        pool_size: int = 4096,
    ) -> None:
        if max_tokens < max_len:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than max_len={max_len}: the longest pair "
                "would not fit in a batch; raise max_tokens or lower max_len"
            )
        cache_dir = Path(cache_dir)
        self.tokenizer = load_tokenizer(cache_dir)
        counts = language_counts(cache_dir, "train")
        self.languages = _check_languages(languages, counts, "train", cache_dir)
        data = _read_split(cache_dir, "train", self.languages)
        # Keep only pairs that fit; index arrays into each language's data.
        self._data: list[_Language] = []
        self._keep: list[np.ndarray] = []
        kept_counts: dict[str, int] = {}
        for lang in self.languages:
            lang_data = data[lang]
            keep = np.flatnonzero(
                (lang_data.src_len <= max_len) & (lang_data.tgt_len + 1 <= max_len)
            )
            if len(keep) == 0:
                raise CorpusError(
                    f"language {lang!r} has no train pair within max_len={max_len} tokens; "
                    "raise max_len or leave the language out"
                )
            self._data.append(lang_data)
            self._keep.append(keep)
            kept_counts[lang] = len(keep)
        self.counts = kept_counts
        self.probs = temperature_probs(kept_counts, temperature)
        self._p = np.array([self.probs[lang] for lang in self.languages])
        self.max_tokens = max_tokens
        self.seed = seed
        self.pool_size = pool_size
        self._pool_index = 0
        self._offset = 0
        self._pool: list[Batch] | None = None

    def state_dict(self) -> dict[str, int]:
        """Position in the stream (save with the checkpoint)."""
        return {"seed": self.seed, "pool": self._pool_index, "offset": self._offset}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"state was saved with seed={state['seed']}, this stream has {self.seed}"
            )
        self._pool_index, self._offset = int(state["pool"]), int(state["offset"])
        self._pool = None

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> Batch:
        if self._pool is None:
            self._pool = self._make_pool(self._pool_index)
        while self._offset >= len(self._pool):
            self._pool_index, self._offset = self._pool_index + 1, 0
            self._pool = self._make_pool(self._pool_index)
        batch = self._pool[self._offset]
        self._offset += 1
        return batch

    def _make_pool(self, pool_index: int) -> list[Batch]:
        rng = np.random.default_rng([self.seed, pool_index])
        lang_of_row = rng.choice(len(self.languages), size=self.pool_size, p=self._p)
        pair_of_row = np.empty(self.pool_size, dtype=np.int64)
        src_len = np.empty(self.pool_size, dtype=np.int64)
        tgt_len = np.empty(self.pool_size, dtype=np.int64)
        for lang_index in range(len(self.languages)):
            rows = np.flatnonzero(lang_of_row == lang_index)
            keep = self._keep[lang_index]
            pairs = keep[rng.integers(0, len(keep), size=len(rows))]
            pair_of_row[rows] = pairs
            src_len[rows] = self._data[lang_index].src_len[pairs]
            tgt_len[rows] = self._data[lang_index].tgt_len[pairs] + 1
        # Sort by padded length (ties in random order), then cut greedily under max_tokens.
        order = np.lexsort((rng.random(self.pool_size), np.maximum(src_len, tgt_len)))
        groups: list[list[int]] = []
        current: list[int] = []
        widest_src = widest_tgt = 0
        for row in order:
            new_src, new_tgt = max(widest_src, src_len[row]), max(widest_tgt, tgt_len[row])
            if current and (len(current) + 1) * max(new_src, new_tgt) > self.max_tokens:
                groups.append(current)
                current, new_src, new_tgt = [], src_len[row], tgt_len[row]
            current.append(int(row))
            widest_src, widest_tgt = new_src, new_tgt
        groups.append(current)
        batches = []
        for group_index in rng.permutation(len(groups)):
            group = groups[group_index]
            langs = [self.languages[lang_of_row[row]] for row in group]
            chosen = [(self._data[lang_of_row[row]], int(pair_of_row[row])) for row in group]
            src, tgt_in, tgt_out = _collate(chosen, self._special_ids)
            batches.append(Batch(src, tgt_in, tgt_out, langs))
        return batches

    @property
    def _special_ids(self) -> tuple[int, int, int]:
        return self.tokenizer.pad_id, self.tokenizer.bos_id, self.tokenizer.eos_id


def eval_batches(
    cache_dir: str | Path = DEFAULT_OUT,
    split: str = "dev",
    *,
    max_tokens: int = 4096,
    languages: Sequence[str] | None = None,
    max_per_lang: int | None = None,
) -> Iterator[Batch]:
    """Finite, ordered batches of `split` (`dev` or `test`) for evaluation.

    Languages in sorted order (or the order given), pairs in file order, the first
    `max_per_lang` of each language (file order is a hash order, so that is a fair sample).
    A batch holds one language only and consecutive pairs while `B * max(S, T) <= max_tokens`;
    a pair longer than `max_tokens` alone forms its own batch (nothing is skipped: BLEU needs
    every reference). Batches carry the raw `sources` and English `references`.
    """
    if split not in ("dev", "test"):
        raise ValueError(f"split={split!r}: evaluation batches exist for 'dev' and 'test'")
    cache_dir = Path(cache_dir)
    tokenizer = load_tokenizer(cache_dir)
    counts = language_counts(cache_dir, split)
    chosen = _check_languages(languages, counts, split, cache_dir)
    data = _read_split(cache_dir, split, chosen)
    special = (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)

    return _eval_batches(data, chosen, special, max_tokens=max_tokens, max_per_lang=max_per_lang)


def _eval_batches(
    data: Mapping[str, _Language],
    languages: Sequence[str],
    special: tuple[int, int, int],
    *,
    max_tokens: int,
    max_per_lang: int | None,
) -> Iterator[Batch]:
    # A separate generator, so that eval_batches raises its errors when called, not when first
    # iterated.
    def make(lang: str, lang_data: _Language, rows: list[int]) -> Batch:
        src, tgt_in, tgt_out = _collate([(lang_data, i) for i in rows], special)
        return Batch(
            src,
            tgt_in,
            tgt_out,
            [lang] * len(rows),
            sources=[lang_data.sources[i] for i in rows],
            references=[lang_data.references[i] for i in rows],
        )

    for lang in languages:
        lang_data = data[lang]
        total = len(lang_data) if max_per_lang is None else min(len(lang_data), max_per_lang)
        rows: list[int] = []
        widest = 0
        for i in range(total):
            width = max(int(lang_data.src_len[i]), int(lang_data.tgt_len[i]) + 1)
            if rows and (len(rows) + 1) * max(widest, width) > max_tokens:
                yield make(lang, lang_data, rows)
                rows, widest = [], 0
            rows.append(i)
            widest = max(widest, width)
        if rows:
            yield make(lang, lang_data, rows)
