"""The machine in a result's provenance: CPU model, flags and cores, and the refusal to call
two records the same machine when they do not show it."""

from __future__ import annotations

from scripts.harness import cpu_identity, provenance, same_machine

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
