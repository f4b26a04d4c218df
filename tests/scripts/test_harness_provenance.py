"""The machine in a result's provenance: CPU model, flags and cores, and the refusal to call
two records the same machine when they do not show it."""

from __future__ import annotations

from scripts.harness import cpu_identity, cpu_times, host_cpu_shares, provenance, same_machine

INTEL = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_vnni
"""
AMD = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni
"""


def test_cpu_identity_reads_model_and_the_flags_that_matter() -> None:
    intel, amd = cpu_identity(INTEL), cpu_identity(AMD)
    assert intel["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert intel["cpu_flags"] == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                  "amx_tile", "amx_bf16", "amx_int8"]
    assert "fpu" not in intel["cpu_flags"] and "amx_bf16" not in amd["cpu_flags"]
    assert intel["cpu_cores"] >= 1


def test_same_machine_refuses_different_or_unknown_machines() -> None:
    here = provenance()
    assert same_machine(here, {"provenance": dict(here)})
    other = {**here, **cpu_identity(INTEL)}
    third = {**here, **cpu_identity(AMD)}
    assert not same_machine(other, third)  # the flags tell them apart (AMX)
    assert not same_machine(third, {**third, "cpu_cores": third["cpu_cores"] + 1})
    unknown = {k: v for k, v in here.items() if k != "cpu_model"}
    assert not same_machine(here, unknown)  # no record of the machine: cannot be paired


STAT_BEFORE = "cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\n"
STAT_AFTER = "cpu  400 0 100 1300 10 0 0 190 0 0\ncpu0 200 0 50 650 5 0 0 95 0 0\n"


def test_host_cpu_shares_name_the_time_other_tenants_took() -> None:
    before, after = cpu_times(STAT_BEFORE), cpu_times(STAT_AFTER)
    assert before == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10,
                      "irq": 0, "softirq": 0, "steal": 40}
    # 1,000 ticks in all between the two: 350 busy, 500 idle, 150 stolen
    assert host_cpu_shares(before, after) == {"busy": 0.35, "idle": 0.5, "steal": 0.15}
    assert host_cpu_shares(None, after) is None
    assert host_cpu_shares(after, after) is None  # no time passed
    assert cpu_times("intr 0\n") is None
    shares = provenance()["host_cpu_since_start"]  # this host: the shares sum to one
    assert shares is None or abs(sum(shares.values()) - 1) < 1e-9
