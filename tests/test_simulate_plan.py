"""The simulator reproduces the bubble formula; the planner respects the memory budget."""

from __future__ import annotations

import pytest

import gpipe_core as gp
from gpipe_core.plan import plan
from gpipe_core.simulate import simulate


@pytest.mark.parametrize(("k", "m"), [(2, 1), (2, 4), (4, 8), (4, 16), (3, 5)])
def test_fill_drain_bubble_is_the_formula(k: int, m: int) -> None:
    sim = simulate(gp.gpipe(k, m), [1.0] * k, [2.0] * k)
    assert sim.step_time == pytest.approx((m + k - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))
    assert sim.peak_inflight == [m] * k


def test_one_f_one_b_keeps_fewer_microbatches_in_flight() -> None:
    k, m = 4, 8
    sim = simulate(gp.one_f_one_b(k, m), [1.0] * k, [2.0] * k)
    assert sim.step_time == pytest.approx((m + k - 1) * 3.0)
    assert sim.peak_inflight == [k - s for s in range(k)]


@pytest.mark.parametrize(("k", "m"), [(2, 8), (2, 16), (4, 16)])
def test_one_f_one_b_pays_latency_per_microbatch_unless_given_slack(k: int, m: int) -> None:
    # In 1F1B's steady state a stage's next backward waits on the message the next stage sends
    # at the end of its own backward, so every transfer's latency lands on the critical path.
    forward, backward, transfer = [1.0] * k, [2.0] * k, 0.1
    fill_drain = simulate(gp.gpipe(k, m), forward, backward, transfer=transfer)
    classic = simulate(gp.one_f_one_b(k, m), forward, backward, transfer=transfer)
    slack = simulate(gp.one_f_one_b(k, m, slack=1), forward, backward, transfer=transfer)
    # Fill-drain pays the latency only while filling and draining: 2(K-1) transfers.
    assert fill_drain.step_time == pytest.approx((m + k - 1) * 3.0 + 2 * (k - 1) * transfer)
    assert classic.step_time >= fill_drain.step_time + (m - k) * transfer - 1e-9
    # One forward of slack hides it again, for one more micro-batch in flight per stage.
    assert slack.step_time == pytest.approx(fill_drain.step_time)
    assert slack.peak_inflight == [k - s + 1 for s in range(k - 1)] + [1]
    assert classic.peak_inflight == [k - s for s in range(k)]


def test_rematerialization_costs_a_forward_and_saves_memory() -> None:
    never = simulate(gp.gpipe(2, 4), [1.0, 1.0], [2.0, 2.0], activation_bytes=[100, 100],
                     input_bytes=[10, 10])
    always = simulate(gp.gpipe(2, 4), [1.0, 1.0], [2.0, 2.0], checkpoint="always",
                      activation_bytes=[100, 100], input_bytes=[10, 10])
    # Every backward now also pays its forward: (M+K-1) * (f + b + f).
    assert always.step_time == pytest.approx((4 + 2 - 1) * (1.0 + 2.0 + 1.0))
    assert never.peak_bytes == [400, 400] and always.peak_bytes == [40, 40]


def test_transfer_time_delays_dependent_actions() -> None:
    sim = simulate(gp.gpipe(2, 1), [1.0, 1.0], [1.0, 1.0], transfer=0.5)
    assert sim.step_time == pytest.approx(4.0 + 2 * 0.5)


def test_events_draw_like_a_measured_timeline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gpipe_core.trace import write_chrome_trace, write_timeline_png

    sim = simulate(gp.gpipe(3, 4), [1.0] * 3, [2.0] * 3)
    write_chrome_trace(sim.events, tmp_path / "t.json")
    write_timeline_png(sim.events, tmp_path / "t.png", num_stages=3)
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_plan_prefers_more_stages_and_respects_the_budget() -> None:
    layers = 8
    kwargs = dict(forward=[1.0] * layers, backward=[2.0] * layers,
                  activation_bytes=[100.0] * layers, input_bytes=[10.0] * layers,
                  param_bytes=[50.0] * layers, batch_size=16, max_stages=4)
    best = plan(memory_budget=1e9, **kwargs)[0]  # type: ignore[arg-type]
    assert best.num_stages == 4 and best.num_microbatches == 16 and best.checkpoint == "never"
    tight = plan(memory_budget=250.0, **kwargs)  # type: ignore[arg-type]
    assert all(p.peak_bytes <= 250.0 for p in tight)
    assert tight[0].checkpoint != "never"  # only re-materialization fits
    with pytest.raises(ValueError, match="no plan fits"):
        plan(memory_budget=10.0, **kwargs)  # type: ignore[arg-type]
