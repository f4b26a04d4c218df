"""When a distributed stage posts its receives: plan_receives over whole schedules."""

from __future__ import annotations

import pytest

from gpipe_core.schedule import get_schedule
from gpipe_core.transport import plan_receives


def events_of(stage: int, num_stages: int, actions: tuple) -> list[tuple[str, int]]:
    events = []
    for action in actions:
        source, target = (stage - 1, stage + 1) if action.kind == "F" else (stage + 1, stage - 1)
        if 0 <= source < num_stages:
            events.append(("recv", source))
        if 0 <= target < num_stages:
            events.append(("send", target))
    return events


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_every_later_receive_is_posted_once_before_it_is_due(
    name: str, num_stages: int, num_microbatches: int
) -> None:
    schedule = get_schedule(name, num_stages, num_microbatches)
    for stage in range(num_stages):
        actions = schedule.actions[stage]
        post_now, post_after_send = plan_receives(stage, num_stages, actions)
        events = events_of(stage, num_stages, actions)
        for peer in {p for kind, p in events if kind == "recv"}:
            receives = [i for i, e in enumerate(events) if e == ("recv", peer)]
            for previous, due in zip(receives, receives[1:], strict=False):
                sends = [i for i in range(previous + 1, due) if events[i] == ("send", peer)]
                planned = [previous in post_now] + [peer in post_after_send.get(i, []) for i in sends]
                assert sum(planned) == 1, (name, stage, peer, previous, due)
                if sends:  # with a send to the peer in between, the post rides along with it
                    assert peer in post_after_send[sends[0]]
            assert receives[-1] not in post_now  # nothing comes after the last message
        planned_peers = [p for peers in post_after_send.values() for p in peers]
        assert len(post_now) + len(planned_peers) == sum(
            max(0, len([e for e in events if e == ("recv", p)]) - 1)
            for p in {p for kind, p in events if kind == "recv"}
        )


def test_fill_drain_posts_right_away_and_1f1b_alongside_sends() -> None:
    gpipe = get_schedule("gpipe", 2, 4)
    assert plan_receives(1, 2, gpipe.actions[1]) == ({0, 1, 2}, {})
    one_f_one_b = get_schedule("1f1b", 2, 4)
    # The last stage alternates F (receive) and B (send back): each send carries the next post.
    assert plan_receives(1, 2, one_f_one_b.actions[1]) == (set(), {1: [0], 3: [0], 5: [0]})
