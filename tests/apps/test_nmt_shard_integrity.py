"""NMT corpus shards: a hash per shard in manifest.json, checked once per run when the shard is
first read, and token ids checked against the vocabulary when a shard is opened, naming it
(``apps.nmt.data._read_split``, ``data.gettext_m2en.corpus_format.shard_entry``)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from apps.nmt import data as nmt_data
from apps.nmt.data import CorpusError, TrainBatches, eval_batches
from data.gettext_m2en.corpus_format import shard_entry


@pytest.fixture
def corpus_copy(corpus: Path, tmp_path: Path) -> Path:
    """A private copy of the session's corpus, to damage."""
    out = tmp_path / "corpus"
    shutil.copytree(corpus, out)
    return out


def train_shard(corpus: Path) -> Path:
    manifest = json.loads((corpus / "manifest.json").read_text())
    return corpus / manifest["splits"]["train"]["shards"][0]


def first_src_id_offset(shard: Path) -> tuple[int, int]:
    """The byte offset in ``shard`` of the first token id of its first ``src.npy`` (a language
    tag; ids are little-endian uint16 in this vocabulary) and that id."""
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".src.npy"))
        payload = tar.extractfile(member).read()  # type: ignore[union-attr]
    stream = io.BytesIO(payload)
    version = np.lib.format.read_magic(stream)
    _, _, dtype = (np.lib.format.read_array_header_1_0(stream) if version == (1, 0)
                   else np.lib.format.read_array_header_2_0(stream))
    assert dtype == np.dtype("<u2")
    start = stream.tell()
    return member.offset_data + start, int.from_bytes(payload[start:start + 2], "little")


def write_id(shard: Path, offset: int, value: int) -> None:
    with open(shard, "r+b") as file:
        file.seek(offset)
        file.write(int(value).to_bytes(2, "little"))


def read_train(corpus: Path) -> None:
    TrainBatches(corpus, max_tokens=256, max_len=32, seed=0)


def test_prepare_records_each_shard_s_size_and_hash(corpus: Path) -> None:
    manifest = json.loads((corpus / "manifest.json").read_text())
    for split in ("train", "dev", "test"):
        files = manifest["splits"][split]["files"]
        assert sorted(files) == sorted(manifest["splits"][split]["shards"])
        for name, entry in files.items():
            assert entry == shard_entry(corpus / name)


def test_a_byte_flipped_to_another_valid_id_is_named(corpus_copy: Path) -> None:
    shard = train_shard(corpus_copy)
    offset, value = first_src_id_offset(shard)
    write_id(shard, offset, value ^ 1)  # a language tag becomes another valid id
    with pytest.raises(CorpusError, match=(
            rf"^corpus shard {shard} is damaged \(its SHA-256 differs from the one manifest.json "
            r"records: same size, altered bytes\); rebuild the corpus with `python -m "
            r"data.gettext_m2en.prepare .* --force`$")):
        read_train(corpus_copy)


def test_a_truncated_shard_is_named_by_its_size(corpus_copy: Path) -> None:
    shard = train_shard(corpus_copy)
    size = shard.stat().st_size
    with open(shard, "r+b") as file:
        file.truncate(size - 1024)
    with pytest.raises(CorpusError, match=rf"^corpus shard {shard} is damaged \({size - 1024} "
                                          rf"bytes, but manifest.json records {size}: truncated\)"):
        read_train(corpus_copy)


def test_a_token_id_past_the_vocabulary_is_named_when_the_shard_is_opened(
        corpus_copy: Path) -> None:
    """A shard whose ids do not fit the vocabulary (another tokenizer's shards, or a corpus from
    before hashes were recorded): the embedding's raw ``IndexError`` before."""
    shard = train_shard(corpus_copy)
    offset, _ = first_src_id_offset(shard)
    write_id(shard, offset, 60000)
    manifest_path = corpus_copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["splits"]["train"]["files"]  # an older corpus: nothing to check the bytes by
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorpusError, match=(
            rf"^corpus shard {shard} is damaged \(ValueError: sample train-\w+-\d+: src.npy holds "
            r"token id 60000, outside the vocabulary \[0, 400\)\); rebuild the corpus")):
        read_train(corpus_copy)


def test_each_shard_is_hashed_once_per_run(corpus_copy: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[Path] = []
    real = nmt_data.shard_entry

    def counting(path: Path) -> dict[str, object]:
        hashed.append(Path(path))
        return real(path)

    monkeypatch.setattr(nmt_data, "shard_entry", counting)
    for _ in range(3):  # as the evaluations of a run read the dev split again
        list(eval_batches(corpus_copy, "dev", max_tokens=4096))
    dev = json.loads((corpus_copy / "manifest.json").read_text())["splits"]["dev"]["shards"]
    assert sorted(hashed) == sorted(corpus_copy / name for name in dev)
