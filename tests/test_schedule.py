"""Schedules as data: exact fill-drain and 1F1B action lists, parsing, and the validator."""

from __future__ import annotations

import pytest

from gpipe_core.schedule import (
    Action,
    Schedule,
    ScheduleError,
    draw,
    get_schedule,
    gpipe,
    one_f_one_b,
    validate,
)


def test_action_prints_and_parses() -> None:
    action = Action(1, "F", 3)
    assert str(action) == "1F3"
    assert Action.parse("1F3") == action
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F13")


def test_gpipe_actions_k3_m4() -> None:
    schedule = gpipe(3, 4)
    assert str(schedule) == (
        "0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0\n"
        "1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0\n"
        "2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0"
    )
    assert Schedule.from_text(str(schedule), name="gpipe") == schedule


def test_gpipe_clock_picture() -> None:
    # The fill-drain picture: forwards fill the pipe diagonally, backwards drain it back.
    assert draw(gpipe(3, 4)) == "\n".join(
        [
            "step     0    1    2    3    4    5    6    7    8    9    10   11",
            "stage 0  0F0  0F1  0F2  0F3  .    .    .    .    0B3  0B2  0B1  0B0",
            "stage 1  .    1F0  1F1  1F2  1F3  .    .    1B3  1B2  1B1  1B0  .",
            "stage 2  .    .    2F0  2F1  2F2  2F3  2B3  2B2  2B1  2B0  .    .",
        ]
    )
    steps = gpipe(3, 4).clock()
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
    assert not schedule.forward_then_backward and gpipe(3, 4).forward_then_backward


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
    for schedule in (gpipe(k, m), one_f_one_b(k, m), one_f_one_b(k, m, slack=1)):
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
