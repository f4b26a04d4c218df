"""docs/REPRODUCTION.md's verdict table cannot drift from the data (issue 40).

Each row of the table names its JSON files (under docs/reproduction/) in its last column and
prints its own numbers in **bold** in the "ours" column. For every row this test checks that
the files exist, and recomputes the bold numbers, in order, from those files (``NUMBERS``
below: one function per row, keyed by the row's section anchor); a number on the page must
equal the recomputed one to the digits printed. A new row without a function here fails.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "REPRODUCTION.md"
DATA = ROOT / "docs" / "reproduction"
START, END = "<!-- verdict-table:start -->", "<!-- verdict-table:end -->"
COLUMNS = ["claim", "paper", "ours", "scale, machine", "kind", "verdict", "JSON"]


@cache
def load(relative: str) -> Any:
    return json.loads((DATA / relative).read_text())


# --- the numbers of each row, from its JSON ------------------------------------------------


def _cells(family: str) -> dict[str, dict[str, Any]]:
    return {c["column"]: c for c in load("memory_bracketed/memory.json")["families"][family]["cells"]}


def bracket(family: str, column: str, over: str) -> list[float]:
    """[fits / does not fit, does not fit / fits]: the ratio of the largest model that fits in
    ``column`` to that of ``over``, bracketed by the ladder."""
    cells = _cells(family)
    top, bottom = cells[column]["bracket"], cells[over]["bracket"]
    return [top["fits"]["parameters"] / bottom["does_not_fit"]["parameters"],
            top["does_not_fit"]["parameters"] / bottom["fits"]["parameters"]]


def remat_numbers() -> list[float]:
    return [*bracket("amoebanet_56px", "pipeline-1", "naive-1"),
            *bracket("amoebanet", "pipeline-1", "naive-1"),
            *bracket("transformer", "pipeline-1", "naive-1")]


def pipeline_scaling_numbers() -> list[float]:
    return [*bracket("amoebanet_56px", "pipeline-8", "naive-1"),
            *bracket("amoebanet", "pipeline-8", "naive-1"),
            *bracket("transformer", "pipeline-8", "naive-1")]


def table1_cpu_numbers() -> list[float]:
    ratios = [bracket(f, "pipeline-8", "pipeline-1")
              for f in ("amoebanet_56px", "amoebanet", "transformer")]
    errors = [100 * c["plan_check"]["error_vs_live_tensor"]
              for f in ("amoebanet", "amoebanet_56px", "transformer")
              for c in _cells(f).values()]
    return [min(r[0] for r in ratios), max(r[1] for r in ratios), min(errors), max(errors)]


def table1_paper_scale_numbers() -> list[float]:
    cells = load("paper_scale.json")["table1"]
    within = sum(bool(c["within_one_step"]) for c in cells)
    return [within, len(cells)]


def _efficient_transformer(checkpoint: str, m: int) -> float:
    rows = load("throughput_efficient.json")["families"]["transformer"]["rows"]
    return next(r["seconds"] for r in rows
                if r["schedule"] == "gpipe" and r["checkpoint"] == checkpoint and r["M"] == m)


def table2_m_numbers() -> list[float]:
    never1, never4 = _efficient_transformer("never", 1), _efficient_transformer("never", 4)
    remat1, remat4 = (_efficient_transformer("except_last", 1),
                      _efficient_transformer("except_last", 4))
    return [never1 / never4, remat1 / never4, remat1 / remat4]


def table2_k_numbers() -> list[float]:
    cells = [c for c in load("paper_scale.json")["table2"]["comparisons"]
             if c.get("reference") is not True]
    errors = [abs(c["error"]) for c in cells]
    return [len(cells), 100 * statistics.median(errors), sum(e > 0.10 for e in errors),
            100 * max(errors)]


def recompute_numbers() -> list[float]:
    shares = [1 - _efficient_transformer("never", m) / _efficient_transformer("except_last", m)
              for m in (4, 8)]
    apps = [r["remat_overhead"] for r in load("app_efficiency.json")["rows"]
            if r["balance_rule"] == "time" and r["M"] >= 2]
    return [100 * shares[0], 100 * shares[1], 100 * min(apps), 100 * max(apps)]


def deep_128_numbers() -> list[float]:
    finals = {c["name"]: c["final_loss"] for c in load("stability/_summary.json")["confirm"]}
    return [finals["L128_pre_neither_lr0.3_s0"], finals["L128_pre_both_lr0.3_s0"],
            finals["L128_post_neither_lr0.001_s0"], finals["L128_post_both_lr0.001_s0"],
            load("stability/_summary.json")["unigram_entropy"]]


def fixes_numbers() -> list[float]:
    pairs = load("stability/_summary.json")["paired_differences"]
    pre, post = pairs["pre/both/0.3"], pairs["post/scaled_init/0.001"]
    return [pre["mean"], *pre["ci95"], post["mean"], *post["ci95"]]


def depth_width_numbers() -> list[float]:
    real = load("depth_width/_summary.json")["D"]["loss"]
    related = load("depth_width_related/_summary.json")["D"]["loss"]
    return [real["point"], *real["ci95"], related["point"], *related["ci95"]]


NUMBERS: dict[str, Callable[[], list[float]]] = {
    "re-materialization-alone": remat_numbers,
    "memory-against-the-naive-model-25x-and-298x": pipeline_scaling_numbers,
    "table-1-at-cpu-scale": table1_cpu_numbers,
    "tables-1-and-2-at-the-papers-scale-predicted-make-reproduce-paper-scale": table1_paper_scale_numbers,
    "table-2-in-m": table2_m_numbers,
    "table-2-in-k": table2_k_numbers,
    "recomputation-overhead": recompute_numbers,
    "128-layer-trainability": deep_128_numbers,
    "the-two-fixes": fixes_numbers,
    "depth-against-width": depth_width_numbers,
}


# --- reading the page ------------------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def verdict_rows(text: str) -> list[dict[str, str]]:
    assert START in text and END in text, "the verdict table's markers are missing"
    lines = [x for x in text.split(START)[1].split(END)[0].splitlines() if x.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells, strict=True)))
    return rows


def bold_numbers(cell: str) -> list[str]:
    """The numbers printed in bold in a cell, in order (``**+0.035 [-0.087, +0.157]**`` gives
    three)."""
    return [n for part in re.findall(r"\*\*(.+?)\*\*", cell)
            for n in re.findall(r"[-+−]?\d[\d,]*(?:\.\d+)?", part)]


def matches(printed: str, value: float) -> bool:
    text = printed.replace(",", "").replace("−", "-")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - value) <= 0.5 * 10 ** -decimals + 1e-9


def row_key(row: dict[str, str]) -> str:
    found = re.search(r"\]\(#([^)]+)\)", row["claim"])
    assert found, f"the claim cell links to its section: {row['claim']}"
    return found.group(1)


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text()


def test_every_row_has_its_section_its_json_and_a_recomputation(page: str) -> None:
    rows = verdict_rows(page)
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", page, flags=re.M)}
    assert {row_key(r) for r in rows} == set(NUMBERS), "one row per claim, each recomputed here"
    for row in rows:
        assert row_key(row) in anchors, f"no section for {row_key(row)}"
        paths = re.findall(r"`([^`]+\.json)`", row["JSON"])
        assert paths, f"{row_key(row)} names no JSON"
        for path in paths:
            assert (DATA / path).is_file(), f"{row_key(row)}: docs/reproduction/{path} missing"
        assert row["kind"].split()[0].strip("*").rstrip(",;") in {
            "measured", "simulated", "predicted"}, row["kind"]
        assert re.match(r"\**(reproduced|not reproduced|partly reproduced|not testable here)",
                        row["verdict"]), row["verdict"]


@pytest.mark.parametrize("key", sorted(NUMBERS))
def test_the_rows_numbers_are_the_jsons(page: str, key: str) -> None:
    row = next(r for r in verdict_rows(page) if row_key(r) == key)
    printed, computed = bold_numbers(row["ours"]), NUMBERS[key]()
    assert len(printed) == len(computed), (key, printed, computed)
    for shown, value in zip(printed, computed, strict=True):
        assert matches(shown, value), f"{key}: the page says {shown}, the JSON gives {value:.4f}"


def test_matches_reads_the_printed_precision() -> None:
    assert matches("1.52", 1.5193) and not matches("1.68", 1.5193)
    assert matches("+0.035", 0.03507) and matches("−0.181", -0.18137)
    assert matches("2", 2) and not matches("8", 2) and matches("1,234", 1234.4)
    assert bold_numbers("a **[3.98, 6.72]**x at 56 px, **2** of **10**") == ["3.98", "6.72", "2",
                                                                           "10"]


NOTEBOOK = DATA / "NOTEBOOK.md"
GROUPS = ("<!-- unbacked-groups:start -->", "<!-- unbacked-groups:end -->")


def test_the_notebooks_list_of_unbacked_groups_names_only_files_that_exist() -> None:
    """The notebook's top list of number groups that once had no JSON (issue 40): each entry
    that cites a JSON cites one that exists under docs/reproduction/."""
    text = NOTEBOOK.read_text()
    assert GROUPS[0] in text and GROUPS[1] in text, "the notebook's list markers are missing"
    block = text.split(GROUPS[0])[1].split(GROUPS[1])[0]
    entries = [line for line in block.splitlines() if line.startswith("- ")]
    assert entries, "the list has no entries"
    cited = re.findall(r"`([^`]+\.json)`", block)
    assert cited, "the list cites no JSON"
    missing = [path for path in cited if not (DATA / path).is_file()]
    assert not missing, f"the notebook's list names missing files: {missing}"


def _recorded_commits(value: Any) -> set[str]:
    """Every ``"commit"`` string in a result, at any depth (a summary's runs carry their own)."""
    if isinstance(value, dict):
        found = {value["commit"]} if isinstance(value.get("commit"), str) else set()
        return found.union(*(_recorded_commits(inner) for inner in value.values()))
    if isinstance(value, list):
        return set().union(*(_recorded_commits(inner) for inner in value))
    return set()


def test_every_published_result_names_a_commit_of_this_history() -> None:
    """A result's provenance is checkable only if the commit it names can be checked out: a run
    from a branch that never landed (or was lost) names a commit no clone has. Skipped on a
    shallow clone, which lacks the older commits by design."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone lacks older commits")
    commits: dict[str, list[str]] = {}
    for path in sorted((ROOT / "docs").rglob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        for commit in _recorded_commits(result):
            sha = commit.removesuffix("+dirty").strip()
            if re.fullmatch(r"[0-9a-f]{7,40}", sha):
                commits.setdefault(sha, []).append(str(path.relative_to(ROOT)))
    assert commits, "no result under docs/ records a commit"
    # one git call for all: --batch-check prints "<sha> missing" for an unknown object
    answer = subprocess.run([git, "cat-file", "--batch-check"], cwd=ROOT, capture_output=True,
                            text=True, check=True, input="".join(f"{sha}^{{commit}}\n"
                                                                 for sha in commits)).stdout
    missing = [line.split()[0].removesuffix("^{commit}") for line in answer.splitlines()
               if line.endswith(" missing")]
    unknown = {sha: commits[sha] for sha in missing}
    assert not unknown, ("results name commits that are not in this repository's history "
                         f"(rerun them from a clean tree of a landed commit): {unknown}")
