"""Phase 6, shards: each split's pairs as token ids in webdataset shards (``shards/*.tar``)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.gettext_m2en.corpus_format import SPLITS, TEXT_MEMBER, Triple, lang_tag


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

    One sample is a *block* of up to `block_size` pairs of one language, with the members that
    ``corpus_format`` lists (`text.json` when `with_text`).
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
                    sample[TEXT_MEMBER] = {
                        "sources": [row[1] for row in block],
                        "references": [row[2] for row in block],
                    }
                sink.write(sample)
    # ShardWriter calls `post` when a shard is closed; the last one is closed on exit.
    return sorted(set(written))


def write_corpus_shards(
    splits: Mapping[str, Sequence[Triple]], shards_dir: Path, *, sp: Any, block_size: int
) -> tuple[np.dtype[Any], dict[str, list[str]]]:
    """Every split's shards under ``shards_dir`` (emptied first), ids as uint16 when the
    vocabulary fits, else int32; returns that dtype and each split's shard file names."""
    id_dtype = (
        np.dtype(np.uint16) if sp.get_piece_size() <= np.iinfo(np.uint16).max
        else np.dtype(np.int32)
    )
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
    return id_dtype, shard_files
