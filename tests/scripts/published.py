"""What every published result JSON holds (issue 22): ``scripts.harness.provenance`` and the
per-round samples behind each median, so that a number on a page can be traced."""

from __future__ import annotations

from typing import Any

PROVENANCE = {"commit", "uncommitted_changes", "torch", "utc", "machine", "load_average_before",
              "load_average_after", "cpu_model", "cpu_flags", "cpu_cores"}


def assert_provenance(report: dict[str, Any]) -> None:
    """``report["provenance"]`` names the commit, torch, the UTC time, the machine (CPU model,
    flags, cores) and the load average (1, 5, 15 min) before and after the measurement."""
    record = report["provenance"]
    assert PROVENANCE <= set(record), PROVENANCE - set(record)
    assert len(record["commit"]) == 40 and record["torch"] and record["utc"].endswith("+00:00")
    assert record["machine"]["cpus"] >= 1
    assert record["cpu_model"] and record["cpu_cores"] >= 1
    assert isinstance(record["cpu_flags"], list)
    for key in ("load_average_before", "load_average_after"):
        assert len(record[key]) == 3 and all(x >= 0 for x in record[key])
