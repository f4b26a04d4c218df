"""Phase 7 and the contract: the corpus's on-disk format, which ``apps/nmt/data.py`` reads.

Under the corpus folder (``DEFAULT_OUT`` unless told otherwise)::

    pairs/<split>.tsv         lang<TAB>source<TAB>english, hash-ordered within each language
    counts.json               {"train": {lang: pairs}, "dev": ..., "test": ..., "total": ...}
    spm/spm.model             one SentencePiece model for every source and English; fixed
                              special ids (pad 0, unk 1, bos 2, eos 3) and one control symbol
                              ``lang_tag(lang)`` per source language
    shards/<split>-NNNNNN.tar webdataset samples, each a block of pairs of one language
                              (a tar member costs at least 1 KiB: one per sentence would be
                              mostly padding), with the members
        lang.txt                  the language
        src.npy                   all source ids (language tag first) concatenated, ``id_dtype``
        src_len.npy               int32 length of each source
        tgt.npy                   all English ids concatenated (no BOS/EOS: the reader adds them)
        tgt_len.npy               int32 length of each target
        text.json                 dev/test only: {"sources": [...], "references": [...]}, the
                                  raw text for BLEU and the copy-the-source baseline
    manifest.json             written last (its presence means "complete"); see ``build_manifest``

Languages are sampled with ``temperature_probs`` both when the tokenizer's input is drawn and
when training batches are. This module imports nothing of the apps (nor torch).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(".cache/gettext_m2en")
SPLITS: tuple[str, ...] = ("train", "dev", "test")
FORMAT_VERSION = 2  # 2: leak-free split (assign_splits)
MANIFEST_FILE = "manifest.json"
COUNTS_FILE = "counts.json"
TOKENIZER_FILE = "spm/spm.model"

# (language, source sentence, English sentence)
Triple = tuple[str, str, str]

# Fixed special ids, so every consumer (model, beam search, checkpoints) can rely on them.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# The members of every shard sample, and the one that dev and test samples add.
SAMPLE_MEMBERS = frozenset({"lang.txt", "src.npy", "src_len.npy", "tgt.npy", "tgt_len.npy"})
TEXT_MEMBER = "text.json"


def lang_tag(lang: str) -> str:
    """The control token prepended to a source sentence in language `lang`, e.g. `<pt_BR>`."""
    return f"<{lang}>"


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


def build_manifest(
    *,
    config: Mapping[str, Any],
    sources: Sequence[str],
    vocab_size: int,
    id_dtype: str,
    lang_tags: Mapping[str, int],
    split_pairs: Mapping[str, int],
    shard_files: Mapping[str, Sequence[str]],
    stats: Mapping[str, Any],
    shard_hashes: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """manifest.json's content: the settings it was built with (``config``), where the pairs
    came from, the tokenizer and its ids, the languages and their tag ids, each split's pair
    count and shards (relative to the corpus folder), and statistics of the preparation.

    ``shard_hashes`` (``{split: {shard file name: {"bytes", "sha256"}}}``, :func:`shard_entry`)
    go to each split's ``"files"``, which a reader checks once per run; a manifest without
    them (older corpora) is read unchecked."""
    return {
        "format": FORMAT_VERSION,
        "config": dict(config),
        "sources": list(sources),
        "tokenizer": TOKENIZER_FILE,
        "vocab_size": vocab_size,
        "pad_id": PAD_ID,
        "unk_id": UNK_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "id_dtype": id_dtype,
        "languages": sorted(lang_tags),
        "lang_tags": dict(lang_tags),
        "splits": {
            split: {"pairs": split_pairs[split], "shards": [f"shards/{name}" for name in names],
                    **({"files": {f"shards/{name}": dict(shard_hashes[split][name])
                                  for name in names}} if shard_hashes is not None else {})}
            for split, names in shard_files.items()
        },
        "stats": dict(stats),
    }


def shard_entry(path: Path) -> dict[str, Any]:
    """A shard's size and SHA-256, as manifest.json records them."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def write_manifest(out: Path, manifest: Mapping[str, Any]) -> None:
    """Write manifest.json atomically: a corpus counts as built once it exists."""
    path = out / MANIFEST_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_manifest(out: str | Path) -> dict[str, Any] | None:
    """The manifest of the corpus under ``out``, or None when it is not (completely) built."""
    path = Path(out) / MANIFEST_FILE
    if not path.exists():
        return None
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest
