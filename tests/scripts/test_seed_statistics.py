"""Issue 39: t intervals over seeds (a made-up sample with a known answer) and the refusal to
compare runs whose machines differ or cannot be shown to be the same."""

from __future__ import annotations

import math

import pytest

from scripts.nmt_runs import comparable, machine_of, t_interval, t_quantile_975
from scripts.reproduce_stability import paired_differences

INTEL = {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_flags": ["avx512_bf16", "amx_bf16"],
         "cpu_cores": 2}
AMD = {"cpu_model": "AMD EPYC", "cpu_flags": ["avx512_bf16"], "cpu_cores": 2}


def test_t_interval_of_a_known_sample() -> None:
    # 1, 2, 3: mean 2, sd 1, half-width t_{0.975,2} / sqrt(3) = 4.303 / 1.7321 = 2.4843
    result = t_interval([1.0, 2.0, 3.0])
    assert result["mean"] == pytest.approx(2.0) and result["sd"] == pytest.approx(1.0)
    assert result["ci95"] == pytest.approx([2 - 2.48434, 2 + 2.48434], abs=1e-4)
    # two values: df 1, t = 12.706; the interval is 12.706 * |a - b| / 2 either side
    two = t_interval([0.0, 0.2])
    assert two["ci95"] == pytest.approx([0.1 - 1.2706, 0.1 + 1.2706], abs=1e-4)
    # wider than the range of the values, unlike a bootstrap over three seeds
    assert result["ci95"][0] < 1.0 and result["ci95"][1] > 3.0
    assert t_interval([5.0])["ci95"] is None and t_interval([])["mean"] is None


def test_t_quantiles_table_and_expansion() -> None:
    assert t_quantile_975(1) == 12.706 and t_quantile_975(30) == 2.042
    assert t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)  # the table's value at df 60
    assert t_quantile_975(120) == pytest.approx(1.980, abs=1e-3)
    assert t_quantile_975(10**6) == pytest.approx(1.96, abs=1e-3)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_comparable_needs_one_machine_shown() -> None:
    assert comparable(dict(AMD), {"provenance": dict(AMD)})
    assert not comparable(dict(INTEL), dict(AMD))
    # an old result records no cpu_model: it pairs with nothing, not even another old one...
    old_a, old_b = {"name": "x"}, {"name": "y"}
    assert machine_of(old_a) == {} and not comparable(old_a, old_b)
    # ...unless machines.json names a machine for both
    records = {"stability/x": {**AMD, "cpu_model": "unrecorded: machine B"},
               "stability/y": {**AMD, "cpu_model": "unrecorded: machine B"},
               "stability/z": {**AMD, "cpu_model": "unrecorded: machine A"}}
    assert comparable(old_a, old_b, keys=("stability/x", "stability/y"), records=records)
    assert not comparable(old_a, old_b, keys=("stability/x", "stability/z"), records=records)
    # a named-but-unidentified machine is never the same as an identified one
    assert not comparable(old_a, dict(AMD), keys=("stability/x", None), records=records)


def _run(arm: str, seed: int, loss: float) -> dict[str, object]:
    return {"name": f"pre_{arm}_lr0.3_s{seed}", "norm": "pre", "arm": arm, "lr": 0.3,
            "seed": seed, "final_loss": loss, "group": "main" if seed == 0 else "seeds"}


def test_paired_differences_leave_out_cross_machine_pairs() -> None:
    runs = [_run("neither", 0, 6.0), _run("both", 0, 5.6), _run("neither", 1, 5.7),
            _run("both", 1, 5.6), _run("neither", 2, 5.7), _run("both", 2, 5.7)]
    machine = {"A": {**AMD, "cpu_model": "unrecorded: A"}, "B": {**AMD, "cpu_model": "unrecorded: B"}}
    records = {f"stability/{r['name']}": machine["A" if r["name"] == "pre_neither_lr0.3_s0" else "B"]
               for r in runs}
    out = paired_differences(runs, records)["pre/both/0.3"]
    assert set(out["per_seed_same_machine"]) == {"1", "2"}
    assert out["left_out"]["0"]["difference"] == pytest.approx(-0.4)
    assert out["n"] == 2 and out["mean"] == pytest.approx(-0.05)
    half = 12.706 * math.sqrt(0.005) / math.sqrt(2)  # sd of (-0.1, 0.0) is sqrt(0.005)
    assert out["ci95"] == pytest.approx([-0.05 - half, -0.05 + half], abs=1e-6)
