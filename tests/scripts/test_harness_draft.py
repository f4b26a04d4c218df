"""Issue 40: a published result (under docs/reproduction/) is not written from a tree with
uncommitted changes unless it is marked a draft; results elsewhere are written as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import harness, nmt_runs


@pytest.fixture
def dirty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(harness.DRAFT_ENV, raising=False)
    monkeypatch.setattr(harness, "uncommitted_files", lambda: ["gpipe_core/stage.py"])


@pytest.fixture
def published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for docs/reproduction/ (so that the test writes nothing into the repo)."""
    monkeypatch.setattr(harness, "PUBLISHED", tmp_path / "published")
    return tmp_path / "published"


def test_a_dirty_tree_refuses_a_published_result(dirty: None, published: Path) -> None:
    with pytest.raises(harness.DirtyTreeError, match="gpipe_core/stage.py.*--draft"):
        harness.write_json(published / "memory.json", {"x": 1})
    assert not (published / "memory.json").exists()
    with pytest.raises(harness.DirtyTreeError):  # the NMT sweeps' own write path too
        nmt_runs.write_result(published / "stability" / "run.json", {"x": 1})


def test_a_draft_is_written_and_says_so(dirty: None, published: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = harness.write_json(published / "a.json", {"x": 1}, draft=True)
    assert json.loads(path.read_text()) == {"x": 1, "draft": True}
    monkeypatch.setenv(harness.DRAFT_ENV, "1")  # what --draft sets (harness.set_draft)
    nmt_runs.write_result(published / "b.json", {"x": 2})
    assert json.loads((published / "b.json").read_text())["draft"] is True


def test_clean_trees_and_other_folders_write_as_before(published: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(harness.DRAFT_ENV, raising=False)
    monkeypatch.setattr(harness, "uncommitted_files", lambda: ["x.py"])
    harness.write_json(tmp_path / "elsewhere" / "r.json", {"x": 1})  # not published: written
    assert json.loads((tmp_path / "elsewhere" / "r.json").read_text()) == {"x": 1}
    monkeypatch.setattr(harness, "uncommitted_files", lambda: [])
    harness.write_json(published / "clean.json", {"x": 1})  # clean: written, no draft mark
    assert json.loads((published / "clean.json").read_text()) == {"x": 1}


def test_the_scripts_flag_sets_the_draft_for_every_write_path(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    import argparse

    monkeypatch.delenv(harness.DRAFT_ENV, raising=False)
    parser = argparse.ArgumentParser()
    harness.add_draft_argument(parser)
    assert not harness.is_draft()
    harness.set_draft(parser.parse_args(["--draft"]).draft)
    assert harness.is_draft()
    monkeypatch.setenv(harness.DRAFT_ENV, "0")
    assert not harness.is_draft()


def test_the_real_published_folder_is_docs_reproduction() -> None:
    assert harness.PUBLISHED == harness.ROOT / "docs" / "reproduction"


def test_results_already_written_do_not_make_the_tree_dirty() -> None:
    """make reproduce-app-pipelines writes a result, then measures the next one in the same
    tree: the first result is not code, so it does not refuse the second."""
    porcelain = (" M docs/reproduction/throughput_apps_params.json\n"
                 " M docs/reproduction/simulator_apps_params.png\n"
                 " M scripts/harness.py\n"
                 "M  docs/RESULTS.md\n")
    assert harness.changed_code(porcelain) == ["scripts/harness.py", "docs/RESULTS.md"]
    assert harness.changed_code(" M docs/reproduction/a.json\n") == []
