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


def test_hand_computed_timeline_with_transfer_and_rematerialization() -> None:
    # gpipe(2, 2), except_last: micro-batch 0 is re-materialized, 1 is not. By hand:
    #   stage 0: F0 0-0.8 (no autograd), F1 0.8-1.8
    #   stage 1: F0 1.3-2.9 (0.8 + 0.5 transfer), F1 2.9-4.9, B1 4.9-7.9, B0 7.9-13.4 (3 + 2.5)
    #   stage 0: B1 8.4-10.4 (7.9 + 0.5), B0 13.9-17.4 (13.4 + 0.5; 2 + 1.5 recompute)
    sim = simulate(gp.gpipe(2, 2), [1.0, 2.0], [2.0, 3.0], transfer=[0.5],
                   checkpoint="except_last", recompute=[1.5, 2.5], forward_no_grad=[0.8, 1.6])
    spans = {e.action: (e.start, e.end) for e in sim.events}
    expected = {"0F0": (0.0, 0.8), "0F1": (0.8, 1.8), "1F0": (1.3, 2.9), "1F1": (2.9, 4.9),
                "1B1": (4.9, 7.9), "1B0": (7.9, 13.4), "0B1": (8.4, 10.4), "0B0": (13.9, 17.4)}
    for action, (start, end) in expected.items():
        assert spans[action] == (pytest.approx(start), pytest.approx(end)), action
    assert sim.step_time == pytest.approx(17.4)
    busy = 0.8 + 1.0 + 2.0 + 3.5 + 1.6 + 2.0 + 3.0 + 5.5
    assert sim.bubble_fraction == pytest.approx(1 - busy / (2 * 17.4))


def test_transfer_per_boundary() -> None:
    # gpipe(3, 1): F chain 1 + 0.25 + 1 + 0.75 + 1, then B chain back 1 + 0.75 + 1 + 0.25 + 1.
    sim = simulate(gp.gpipe(3, 1), [1.0] * 3, [1.0] * 3, transfer=[0.25, 0.75])
    assert sim.step_time == pytest.approx(6.0 + 2 * (0.25 + 0.75))
    with pytest.raises(ValueError, match="2 boundaries"):
        simulate(gp.gpipe(3, 1), [1.0] * 3, [1.0] * 3, transfer=[0.25])
    with pytest.raises(ValueError, match="recompute has 1 costs for 3 stages"):
        simulate(gp.gpipe(3, 1), [1.0] * 3, [1.0] * 3, recompute=[1.0])


def test_plan_uses_the_costs_measured_at_each_microbatch_count() -> None:
    # Whole batch: 1 s forward + 2 s backward per layer. Divided by M, four micro-batches on two
    # stages look fast; measured, a quarter of the batch costs as much as the whole (a device
    # far below its efficiency), so splitting cannot pay and one stage with M=1 wins.
    layers = 2
    common = dict(forward=[1.0] * layers, backward=[2.0] * layers,
                  activation_bytes=[0.0] * layers, input_bytes=[0.0] * layers,
                  param_bytes=[0.0] * layers, batch_size=4, max_stages=2, memory_budget=1.0)
    naive = gp.plan(**common)[0]
    assert naive.num_microbatches == 4 and naive.num_stages == 2
    measured = gp.plan(**common, microbatch_costs={
        2: ([1.0] * layers, [2.0] * layers), 4: ([1.0] * layers, [2.0] * layers)})[0]
    assert (measured.num_stages, measured.num_microbatches) == (1, 1)
    assert measured.step_time == pytest.approx(6.0)
    with pytest.raises(ValueError, match="microbatch_costs\\[4\\] has 1 forward"):
        gp.plan(**common, microbatch_costs={4: ([1.0], [2.0])})
