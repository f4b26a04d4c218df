"""scripts/bench_amoebanet_input.py end to end on synthetic shards: both pipelines measured in
alternating rounds, medians and provenance written, the decoded pipeline the cheaper one."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import bench_amoebanet_input
from tests.scripts.published import assert_provenance


def test_the_benchmark_writes_paired_rounds_with_provenance(tmp_path: Path) -> None:
    out = tmp_path / "input.json"
    assert bench_amoebanet_input.main(["--tiny", "--rounds", "2", "--batches", "2",
                                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["order"] for r in result["rounds"]] == [["old", "new"], ["new", "old"]]
    for name in ("old", "new"):
        for mode in ("in_process", "default_workers"):
            assert result["median"][name][mode]["cpu_ms_per_image"] > 0
            assert result["median"][name][mode]["images_per_second"] > 0
        assert all(r[name]["in_process"]["images"] == 2 * 128 for r in result["rounds"])
    # the decoded pipeline does a fraction of the work (about a fifth on the default's config)
    assert result["median_cpu_ratio_old_over_new"] > 1.5
    assert_provenance(result)
