"""Schedules as data: exact fill-drain, 1F1B and zero-bubble action lists, parsing, and the
validator."""

from __future__ import annotations

import pytest

import gpipe_core as gp
from gpipe_core import schedule as gp_schedule
from gpipe_core.schedule import (
    Action,
    Schedule,
    ScheduleError,
    draw,
    fill_drain,
    get_schedule,
    one_f_one_b,
    validate,
    zb_h1,
    zb_h2,
)


def test_action_prints_and_parses() -> None:
    action = Action(1, "F", 3)
    assert str(action) == "1F3"
    assert Action.parse("1F3") == action
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F13")
    assert [str(Action.parse(t)) for t in ("1I3", "1W3", "0B2")] == ["1I3", "1W3", "0B2"]
    assert Action.parse("1W3") == Action(1, "W", 3)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("1X3")


def test_gpipe_actions_k3_m4() -> None:
    schedule = fill_drain(3, 4)
    assert str(schedule) == (
        "0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0\n"
        "1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0\n"
        "2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0"
    )
    assert Schedule.from_text(str(schedule), name="gpipe") == schedule


def test_gpipe_is_the_deprecated_name_of_fill_drain() -> None:
    with pytest.warns(DeprecationWarning, match=r"gp\.fill_drain"):
        old = gp.gpipe(3, 4)
    assert old == fill_drain(3, 4) == get_schedule("gpipe", 3, 4)
    with pytest.warns(DeprecationWarning):
        assert gp_schedule.gpipe(2, 2) == fill_drain(2, 2)


def test_gpipe_clock_picture() -> None:
    # The fill-drain picture: forwards fill the pipe diagonally, backwards drain it back.
    assert draw(fill_drain(3, 4)) == "\n".join(
        [
            "step     0    1    2    3    4    5    6    7    8    9    10   11",
            "stage 0  0F0  0F1  0F2  0F3  .    .    .    .    0B3  0B2  0B1  0B0",
            "stage 1  .    1F0  1F1  1F2  1F3  .    .    1B3  1B2  1B1  1B0  .",
            "stage 2  .    .    2F0  2F1  2F2  2F3  2B3  2B2  2B1  2B0  .    .",
        ]
    )
    steps = fill_drain(3, 4).clock()
    # 2 * (M + K - 1) steps; the bubble is (K-1)/(M+K-1) of each stage's time.
    assert len(steps) == 2 * (4 + 3 - 1)


def test_one_f_one_b_k3_m4() -> None:
    schedule = one_f_one_b(3, 4)
    assert str(schedule) == (
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )
    validate(schedule)
    assert not schedule.forward_then_backward and fill_drain(3, 4).forward_then_backward


def test_one_f_one_b_with_slack_runs_one_more_forward_ahead() -> None:
    schedule = one_f_one_b(3, 5, slack=1)
    assert str(schedule) == (
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0B2 0B3 0B4\n"
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1B3 1B4\n"
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4"
    )
    assert schedule.name == "1f1b_slack1"
    assert get_schedule("1f1b_slack1", 3, 5) == schedule
    assert get_schedule("1f1b", 3, 5) == one_f_one_b(3, 5, slack=0)
    # More slack than micro-batches degenerates to fill-drain's forwards first, still valid.
    validate(one_f_one_b(2, 2, slack=4))
    with pytest.raises(ValueError, match="slack=-1 must be >= 0"):
        one_f_one_b(2, 4, slack=-1)
    with pytest.raises(ValueError, match="1f1b_slackN"):
        get_schedule("1f1b_slack", 2, 4)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_builtin_schedules_validate(k: int, m: int) -> None:
    for schedule in (fill_drain(k, m), one_f_one_b(k, m), one_f_one_b(k, m, slack=1)):
        validate(schedule)
        actions = [a for tick in schedule.clock() for a in tick]
        assert len(actions) == 2 * k * m


def test_validator_catches_missing_action() -> None:
    broken = Schedule.from_text("0F0 0F1 0B1 0B0\n1F0 1F1 1B1")
    with pytest.raises(ScheduleError, match=r"missing \['1B0'\]"):
        validate(broken)


def test_validator_catches_duplicate_action() -> None:
    broken = Schedule.from_text("0F0 0F0 0B0\n1F0 1B0")
    with pytest.raises(ScheduleError, match=r"duplicated \['0F0'\]"):
        validate(broken)


def test_validator_catches_deadlock_and_draws_the_grid() -> None:
    # Stage 0 wants 0B0 before sending 0F1; stage 1 waits for 1F1 before running 1B0.
    broken = Schedule.from_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "deadlocks at step 2" in message
    assert "0B0!" in message and "1F1!" in message


def test_validator_catches_mismatched_message_order() -> None:
    broken = Schedule.from_text("0F0 0F1 0B1 0B0\n1F1 1F0 1B1 1B0")
    with pytest.raises(ScheduleError, match="different orders"):
        validate(broken)


def test_validator_catches_backward_before_forward() -> None:
    broken = Schedule.from_text("0B0 0F0")
    with pytest.raises(ScheduleError, match="0B0 before 0F0"):
        validate(broken)


# -- zero-bubble schedules: the backward split into I (input gradient) and W (weights) -------


def test_zb_h1_actions_written_out_by_hand() -> None:
    # Stage s: 1F1B's K-1-s warm-up forwards, then rounds F I W whose first s rounds leave W
    # out (deferred), then the drain I W, then the deferred W's.
    assert str(zb_h1(2, 4)) == (
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3\n"
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3"
    )
    assert str(zb_h1(3, 4)) == (
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3\n"
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3\n"
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"
    )
    # The picture of the paper's Figure 3 (top): one bubble of K-1 units per stage, at the
    # start (stage 0 waits for its first gradient) or split between start and middle.
    assert draw(zb_h1(3, 4)) == "\n".join(
        [
            "step     0    1    2    3    4    5    6    7    8    9    10   11   12   13",
            "stage 0  0F0  0F1  0F2  .    .    0I0  0W0  0F3  0I1  0W1  0I2  0W2  0I3  0W3",
            "stage 1  .    1F0  1F1  .    1I0  1F2  1I1  1W0  1F3  1I2  1W1  1I3  1W2  1W3",
            "stage 2  .    .    2F0  2I0  2F1  2I1  2F2  2I2  2W0  2F3  2I3  2W1  2W2  2W3",
        ]
    )
    assert Schedule.from_text(str(zb_h1(3, 4)), name="zb_h1") == zb_h1(3, 4)


def test_zb_h2_actions_written_out_by_hand() -> None:
    # K=2: stage 0 warms up with 2K-1 = 3 forwards (the most it may hold), which fill the
    # wait for its first gradient; the last stage runs I as soon as it can and defers W.
    # Derived step by step with the rule I > F (while fewer than 2K-1 held) > W in unit time.
    assert str(zb_h2(2, 4)) == (
        "0F0 0F1 0F2 0I0 0W0 0I1 0F3 0I2 0W1 0W2 0I3 0W3\n"
        "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1F3 1I3 1W1 1W2 1W3"
    )
    assert draw(zb_h2(2, 4)) == "\n".join(
        [
            "step     0    1    2    3    4    5    6    7    8    9    10   11   12",
            "stage 0  0F0  0F1  0F2  0I0  0W0  0I1  0F3  0I2  0W1  0W2  0I3  0W3  .",
            "stage 1  .    1F0  1I0  1F1  1I1  1F2  1I2  1W0  1F3  1I3  1W1  1W2  1W3",
        ]
    )
    # K=3: 5, 3 and 1 warm-up forwards on stages 0, 1, 2.
    assert str(zb_h2(3, 6)) == (
        "0F0 0F1 0F2 0F3 0F4 0I0 0W0 0I1 0F5 0I2 0W1 0I3 0W2 0I4 0W3 0W4 0I5 0W5\n"
        "1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1I3 1F5 1I4 1W1 1W2 1I5 1W3 1W4 1W5\n"
        "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2F5 2I5 2W1 2W2 2W3 2W4 2W5"
    )


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_zero_bubble_schedules_validate_and_run_every_action(k: int, m: int) -> None:
    for schedule in (zb_h1(k, m), zb_h2(k, m)):
        validate(schedule)
        assert schedule.splits_backward
        assert schedule.forward_then_backward == (m == 1)
        actions = [a for tick in schedule.clock() for a in tick]
        assert sorted(actions) == sorted(a for row in schedule.actions for a in row)
        assert len(actions) == 3 * k * m
        draw(schedule)  # draws without error


@pytest.mark.parametrize(("k", "m"), [(2, 4), (3, 6), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_unit_time(k: int, m: int) -> None:
    # With F = I = W = 1 unit, 1F1B idles 3(K-1) units per stage; ZB-H1 a third of that.
    h1 = zb_h1(k, m).clock()
    assert len(h1) == 3 * m + k - 1
    h2 = zb_h2(k, m).clock()
    assert len(h2) == 3 * m + k - 1
    # ZB-H2 is a parallelogram: stage s works without a gap from step s to 3M + s.
    for s in range(k):
        busy = [t for t, tick in enumerate(h2) if any(a.stage == s for a in tick)]
        assert busy == list(range(s, 3 * m + s)), s


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_peak_microbatches_held_match_each_schedules_bound(k: int, m: int) -> None:
    # Held: between F and B (or W, which needs the forward's state too).
    assert fill_drain(k, m).peak_held() == [m] * k
    assert one_f_one_b(k, m).peak_held() == [min(k - s, m) for s in range(k)]
    assert zb_h1(k, m).peak_held() == [min(k, m)] * k  # 1F1B's peak (its first stage's)
    assert zb_h2(k, m).peak_held() == [min(2 * k - 1, m)] * k  # about twice


def test_get_schedule_knows_the_zero_bubble_schedules() -> None:
    assert get_schedule("zb_h1", 3, 5) == zb_h1(3, 5)
    assert get_schedule("zb_h2", 3, 5) == zb_h2(3, 5)
    assert get_schedule(zb_h1(3, 5), 3, 5) == zb_h1(3, 5)
    with pytest.raises(ValueError, match="zb_h1"):
        get_schedule("zb_h3", 3, 5)


def test_validator_catches_weight_gradient_before_input_gradient() -> None:
    broken = Schedule.from_text("0F0 0W0 0I0\n1F0 1I0 1W0")
    with pytest.raises(ScheduleError, match="0W0 before 0I0"):
        validate(broken)


def test_validator_catches_input_gradient_before_forward() -> None:
    broken = Schedule.from_text("0F0 0I0 0W0\n1I0 1F0 1W0")
    with pytest.raises(ScheduleError, match="1I0 before 1F0"):
        validate(broken)


def test_validator_catches_missing_weight_gradient() -> None:
    broken = Schedule.from_text("0F0 0F1 0I0 0W0 0I1 0W1\n1F0 1I0 1W0 1F1 1I1")
    with pytest.raises(ScheduleError, match=r"missing \['1W1'\]"):
        validate(broken)


def test_validator_catches_both_b_and_split_backward() -> None:
    broken = Schedule.from_text("0F0 0B0 0I0 0W0")
    with pytest.raises(ScheduleError, match=r"both B and I/W \['0B0'\]"):
        validate(broken)


def test_validator_catches_split_backward_deadlock_and_draws_the_grid() -> None:
    # Stage 0 holds 0F1 back until its I0, which needs 1I0; stage 1 runs 1F1 before 1I0.
    broken = Schedule.from_text("0F0 0I0 0F1 0W0 0I1 0W1\n1F0 1F1 1I0 1W0 1I1 1W1")
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "deadlocks at step 2" in message
    assert "0I0!" in message and "1F1!" in message


def test_validator_catches_mismatched_gradient_order_across_b_and_i() -> None:
    # Stage 1 sends gradients (I) for 1 then 0; stage 0 receives (B) in the order 0, 1.
    broken = Schedule.from_text("0F0 0F1 0B0 0B1\n1F0 1F1 1I1 1I0 1W0 1W1")
    with pytest.raises(ScheduleError, match=r"gradient sends \(B or I\)"):
        validate(broken)


def test_w_waits_only_for_its_own_stage() -> None:
    # A W needs nothing from other stages: the last stage's W0 runs in the same step as 0I0.
    steps = zb_h1(2, 1).clock()
    assert [sorted(str(a) for a in tick) for tick in steps] == [
        ["0F0"], ["1F0"], ["1I0"], ["0I0", "1W0"], ["0W0"]
    ]


# -- virtual stages: several stages per rank ------------------------------------------------


def test_interleaved_1f1b_actions_derived_by_hand() -> None:
    # K=2 ranks, V=2 (stage s on rank s mod 2), M=4 in rounds of 2: rank 0 runs forwards
    # 0F0 0F1 2F0 2F1 | 0F2 0F3 2F2 2F3 and backwards in reverse chunk order; it warms up with
    # 2(K-1-r) + (V-1)P = 4 forwards, then alternates F and B.
    schedule = gp_schedule.interleaved_1f1b(4, 4, num_ranks=2)
    assert str(schedule) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
    assert schedule.placement == (0, 1, 0, 1) and schedule.virtual
    assert schedule.stages_on(1) == [1, 3]
    assert Schedule.from_text(str(schedule), name="interleaved_1f1b") == schedule
    assert draw(schedule).splitlines()[1].startswith("rank  0  0F0  0F1  2F0  2F1")


def test_zb_v_actions_on_one_rank_follow_the_stated_rule() -> None:
    # One rank holding both stages (0 and 1), M = 2R: one forward of the first chunk (2(R-r)-1),
    # no pairs (r = 0), one block F I W of the second chunk (R - r), then F I W of the first
    # and of the second in turn, each W right after its I; then the drain, earlier chunk first.
    schedule = gp_schedule.zb_v(2, 2)
    assert str(schedule) == "0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0I1 0W1"
    # M < 2R keeps the greedy rule: I first (the later stage's first), W when nothing else is
    # ready, at most 2R = 4 chunk micro-batches held
    assert str(gp_schedule.zb_v(4, 2)).splitlines()[0] == (
        "0F0 0F1 3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 0W0 0W1")
    assert gp_schedule.zb_v(4, 3).placement == (0, 1, 1, 0)  # a V: the turn on rank 1


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16])
def test_interleaved_1f1b_validates_with_its_memory_bound(k: int, v: int, m: int) -> None:
    schedule = gp_schedule.interleaved_1f1b(k * v, m, num_ranks=k)
    steps = schedule.clock()
    assert sum(len(t) for t in steps) == 2 * k * v * m
    rounds = max(1, m // k)
    first_round = m // rounds + (1 if m % rounds else 0)
    assert schedule.peak_held() == [min(2 * (k - 1 - r) + (v - 1) * first_round + 1, m * v)
                                    for r in range(k)]
    assert not schedule.splits_backward


@pytest.mark.parametrize(("k", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_interleaving_shrinks_the_bubble(k: int, m: int) -> None:
    # Unit time, a chunk's F = B = 1: 1F1B on K stages of V chunks each idles 2V(K-1) units per
    # rank; interleaved 1F1B about 2(K-1) (plus a little where rounds do not fill the pipe).
    for v in (2, 4):
        steps = len(gp_schedule.interleaved_1f1b(k * v, m, num_ranks=k).clock())
        plain = v * len(one_f_one_b(k, m).clock())
        assert steps < plain
        assert steps - 2 * m * v <= 2 * (k - 1) + 2, (v, steps)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
def test_zb_v_validates_with_1f1b_memory_and_almost_no_bubble(k: int, m: int) -> None:
    schedule = gp_schedule.zb_v(2 * k, m)
    steps = schedule.clock()
    assert sum(len(t) for t in steps) == 6 * k * m
    assert schedule.splits_backward
    # At most 2K chunk micro-batches (K whole ones: 1F1B's first stage), 2M when M < K.
    assert schedule.peak_held() == [min(2 * k, 2 * m)] * k
    if m >= 2 * k:  # 6M units of work per rank; 1F1B over the same layers idles 6(K-1)
        assert len(steps) - 6 * m in (k - 1, k), len(steps)


@pytest.mark.parametrize(("k", "m"), [(2, 4), (2, 8), (3, 6), (3, 8), (4, 8), (4, 16)])
def test_zb_v_takes_as_long_as_torchs_zb_v(k: int, m: int) -> None:
    """Our ZB-V against torch.distributed.pipelining's (``ScheduleZBVZeroBubble``, its order
    read from the schedule torch builds for each rank) in the simulator: the same step time
    for unit costs and for a first stage whose I is almost free and a loss stage twice as
    heavy (where the greedy rule's order was 3-9% slower); the same order at R = 2."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    from gpipe_core.simulator import simulate

    n = 2 * k
    stub = SimpleNamespace(pp_group_size=k, _n_microbatches=m, num_stages=n)
    rows = []
    for r in range(k):
        ops = ScheduleZBVZeroBubble._calculate_single_rank_operations(stub, r)  # type: ignore[arg-type]
        rows.append(" ".join(f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}"
                             for a in ops if a is not None))
    theirs = Schedule.from_text("\n".join(rows), name="torch_zb_v")
    ours = gp_schedule.zb_v(n, m)
    if k == 2:
        assert str(ours) == str(theirs)
    forward = [1.0] + [1.2] * (n - 2) + [2.0]
    total = [2.4 * f for f in forward]  # I + W = 1.2 x B, B = 2 F
    backward_input = [0.02] + [0.6 * t for t in total[1:]]
    costs = [dict(backward_input=[1.0] * n, backward_weight=[1.0] * n, forward=[1.0] * n),
             dict(backward_input=backward_input, forward=forward,
                  backward_weight=[t - i for t, i in zip(total, backward_input, strict=True)])]
    for cost in costs:
        step = [simulate(s, cost["forward"], backward_input=cost["backward_input"],
                         backward_weight=cost["backward_weight"], transfer=0.1).step_time
                for s in (ours, theirs)]
        assert step[0] == pytest.approx(step[1], rel=1e-9), cost


def test_get_schedule_places_virtual_stages() -> None:
    assert get_schedule("interleaved_1f1b", 6, 4, num_ranks=3).placement == (0, 1, 2, 0, 1, 2)
    assert get_schedule("zb_v", 6, 4, num_ranks=3).placement == (0, 1, 2, 2, 1, 0)
    with pytest.raises(ValueError, match="runs one stage per rank.*interleaved_1f1b"):
        get_schedule("1f1b", 4, 4, num_ranks=2)
    with pytest.raises(ValueError, match="two stages per rank"):
        get_schedule("zb_v", 6, 4, num_ranks=2)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        get_schedule("interleaved_1f1b", 5, 4, num_ranks=2)
    with pytest.raises(ScheduleError, match="on 2 ranks"):
        get_schedule(gp_schedule.zb_v(4, 4), 4, 4)


def test_validator_catches_an_action_on_the_wrong_rank() -> None:
    good = gp_schedule.interleaved_1f1b(4, 2, num_ranks=2)
    rows = [list(row) for row in good.actions]
    rows[0][0], rows[1][0] = rows[1][0], rows[0][0]  # 1F0 now on rank 0's row, 0F0 on rank 1's
    broken = Schedule("broken", 4, 2, tuple(map(tuple, rows)), good.placement)
    with pytest.raises(ScheduleError, match="does not run"):
        validate(broken)
    with pytest.raises(ScheduleError, match="more than one rank"):
        Schedule.from_text("0F0 1F0 1B0 0B0\n1F1 0F1 1B1 0B1")


def test_validator_catches_a_cross_rank_deadlock_with_virtual_stages() -> None:
    # Rank 1 (stages 1, 3) runs 1B0 before 3F0: 1B0 needs 2B0 on rank 0, which needs 3B0.
    broken = Schedule.from_text("0F0 2F0 2B0 0B0\n1F0 1B0 3F0 3B0")
    assert broken.placement == (0, 1, 0, 1)
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "deadlocks at step 3" in message and "every rank waits" in message
    assert "2B0!" in message and "1B0!" in message


def test_in_order_matching_is_checked_for_backends_without_tags() -> None:
    # One stage per rank: each boundary has its own pair of ranks, always in order.
    for k, m in ((2, 4), (4, 8)):
        gp_schedule.check_in_order_matching(one_f_one_b(k, m))
        gp_schedule.check_in_order_matching(zb_h2(k, m))
    gp_schedule.check_in_order_matching(gp_schedule.interleaved_1f1b(8, 8, num_ranks=4))
    # ZB-V at M=4 on 2 ranks: rank 0 sends 0's activations and 3's gradients to rank 1 in
    # another order than rank 1's actions need them (fine with gloo's tags, not with NCCL).
    with pytest.raises(ScheduleError, match=r"rank 0 sends rank 1 message \d+ as .*NCCL"):
        gp_schedule.check_in_order_matching(gp_schedule.zb_v(4, 4))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_dualpipe_v_validates_and_runs_every_action(k: int) -> None:
    for m in (2 * k, 2 * k + 1, 4 * k, 8 * k):
        schedule = gp_schedule.dualpipe_v(2 * k, m)
        steps = schedule.clock()
        assert schedule.placement == gp_schedule.zb_v(2 * k, m).placement
        actions = [a for tick in steps for a in tick]
        assert len(actions) == len({(a.stage, a.kind, a.mb) for a in actions})
        # Every micro-batch's backward on every stage: a B, or an I and a W.
        backward = {(a.stage, a.mb) for a in actions if a.kind in "BI"}
        assert len(backward) == 2 * k * m
        assert schedule.peak_held() == [2 * k + 1] * k
    with pytest.raises(ValueError, match="at least 2 x ranks"):
        gp_schedule.dualpipe_v(2 * k, 2 * k - 1)


def test_dualpipe_v_rank_rows_follow_its_phases() -> None:
    # Two ranks, M=4. Rank 1 (chunks 1 and 2, the turn of the V): no lone warm-up forwards;
    # two pairs F1 F2; no I1 W1 F1 round; M-2R+r+1 = 2 main rounds F0 B1 F1 B0 (here 1F 2B 2F
    # 1B); then r+1 = 2 rounds B1 B0, the second split into I (odd rank: from chunk 1's turn);
    # their W's come last, oldest first.
    schedule = gp_schedule.dualpipe_v(4, 4)
    assert " ".join(str(a) for a in schedule.actions[1]) == (
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3")
    # Rank 0 (chunks 0 and 3): 2 lone F0 | a pair | I1 W1 F1 | one main round | B1 F1 B0 | B1
    # and a split B0 (even rank: from chunk 0's turn) | W I0 | W.
    assert " ".join(str(a) for a in schedule.actions[0]) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3")


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_interleaved_zb_within_interleaved_memory_and_no_slower(k: int, v: int,
                                                                       m: int) -> None:
    schedule = gp_schedule.interleaved_zb(k * v, m, num_ranks=k)
    steps = schedule.clock()
    assert sum(len(t) for t in steps) == 3 * k * v * m and schedule.splits_backward
    plain = gp_schedule.interleaved_1f1b(k * v, m, num_ranks=k)
    assert schedule.placement == plain.placement
    # Never more than interleaved 1F1B holds (the limit; less where the bubble caps it).
    assert all(a <= b for a, b in zip(schedule.peak_held(), plain.peak_held(), strict=True))
    n = k * v
    costs = dict(backward_input=[1.0] * n, backward_weight=[1.0] * n)
    from gpipe_core.simulator import simulate
    assert (simulate(schedule, [1.0] * n, **costs).step_time
            <= simulate(plain, [1.0] * n, [2.0] * n).step_time)
