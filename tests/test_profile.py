"""gp.profile_stages: replaying each rank's actions to measure what gp.simulate and gp.plan take."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import Tensor, nn

import gpipe_core as gp

SLEEP_F = 0.02  # seconds a Sleep layer's forward takes, at least
SLEEP_B = 0.03  # and its backward


class _SleepyIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[no-untyped-def,override]
        time.sleep(SLEEP_F)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[no-untyped-def,override]
        time.sleep(SLEEP_B)
        return grad


class Sleep(nn.Module):
    """An identity with a known least cost: a forward of SLEEP_F, a backward of SLEEP_B."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return _SleepyIdentity.apply(x)  # type: ignore[no-any-return]
        time.sleep(SLEEP_F)
        return x.clone()


def model_and_batch() -> tuple[nn.Sequential, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                          Sleep(), nn.Linear(16, 3))
    return model, torch.randn(16, 8), torch.randint(0, 3, (16,))


def test_every_stage_gets_a_cost_at_least_its_known_work() -> None:
    model, x, y = model_and_batch()
    profile = gp.profile_stages(model, [3, 3], x, y, loss_fn=nn.functional.cross_entropy,
                                schedule="1f1b", chunks=4, rounds=2)
    assert (profile.schedule, profile.num_microbatches, profile.num_stages) == ("1f1b", 4, 2)
    assert all(0 < c < math.inf for c in profile.forward + profile.backward)
    # Stage 1 holds the Sleep layer: each of its forwards and backwards takes at least that.
    assert profile.forward[1] >= SLEEP_F and profile.backward[1] >= SLEEP_B
    assert profile.backward_input is None and profile.backward_weight is None
    assert profile.transfer == [0.0] and profile.rounds == 2
    assert all(len(profile.samples[s]["F"]) == 2 for s in range(2))


def test_profiling_leaves_parameters_gradients_and_running_statistics_as_they_were() -> None:
    model, x, y = model_and_batch()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    gp.profile_stages(model, [2, 4], x, y, loss_fn=nn.functional.cross_entropy,
                      schedule="zb_h1", chunks=4, checkpoint="except_last", rounds=1)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


def test_rematerialized_microbatches_recompute_in_backward() -> None:
    model, x, y = model_and_batch()
    always = gp.profile_stages(model, [4, 2], x, y, loss_fn=nn.functional.cross_entropy,
                               chunks=2, checkpoint="always", rounds=1, warmup=0)
    # Stage 1 (Sleep first): no forward with autograd runs; its backward reruns the forward.
    assert always.forward_no_grad[1] >= SLEEP_F and always.forward[1] == always.forward_no_grad[1]
    assert always.backward[1] >= SLEEP_F + SLEEP_B and always.recompute == [0.0, 0.0]
    mixed = gp.profile_stages(model, [4, 2], x, y, loss_fn=nn.functional.cross_entropy,
                              chunks=2, checkpoint="except_last", rounds=1, warmup=0)
    assert set(mixed.samples[1]) == {"F", "F_remat", "B", "B_remat"}
    assert mixed.recompute[1] == pytest.approx(
        mixed.samples[1]["B_remat"][0] - mixed.samples[1]["B"][0])


def test_a_kept_and_a_rematerialized_profile_combine_into_one() -> None:
    model, x, y = model_and_batch()
    kept, remat = (gp.profile_stages(model, [4, 2], x, y, loss_fn=nn.functional.cross_entropy,
                                     chunks=2, checkpoint=mode, rounds=2, warmup=0)
                   for mode in ("never", "always"))
    both = gp.StageProfile.combined(kept, remat)
    # each kind from the run where every micro-batch ran that way
    assert both.checkpoint == "except_last" and both.rounds == 2
    assert both.forward == kept.forward and both.backward == kept.backward
    assert both.forward_no_grad == remat.forward_no_grad
    assert both.recompute == [max(r - k, 0.0) for r, k in zip(remat.backward, kept.backward,
                                                               strict=True)]
    assert both.forward_no_grad[1] >= SLEEP_F and both.backward[1] >= SLEEP_B
    assert all(set(stage) == {"F", "F_remat", "B", "B_remat"} for stage in both.samples)
    with pytest.raises(ValueError, match="checkpoint='never' and one with 'always'"):
        gp.StageProfile.combined(remat, kept)
    other = gp.profile_stages(model, [4, 2], x, y, loss_fn=nn.functional.cross_entropy,
                              chunks=3, checkpoint="always", rounds=2, warmup=0)
    with pytest.raises(ValueError, match="profile the same stages twice"):
        gp.StageProfile.combined(kept, other)


def test_a_split_schedule_measures_both_halves() -> None:
    model, x, y = model_and_batch()
    profile = gp.profile_stages(model, [3, 3], x, y, loss_fn=nn.functional.cross_entropy,
                                schedule="zb_h1", chunks=4, rounds=1)
    assert profile.backward_input is not None and profile.backward_weight is not None
    assert profile.backward_input[1] >= SLEEP_B  # Sleep's backward is on the input path
    assert profile.backward == [i + w for i, w in zip(profile.backward_input,
                                                      profile.backward_weight, strict=True)]


def test_simulate_takes_a_profile_as_its_costs() -> None:
    model, x, y = model_and_batch()
    profile = gp.profile_stages(model, [3, 3], x, y, loss_fn=nn.functional.cross_entropy,
                                schedule="zb_h1", chunks=4, checkpoint="except_last",
                                rounds=1, transfer=0.001)
    schedule = gp.get_schedule("zb_h1", 2, 4)
    direct = gp.simulate(schedule, profile)
    spelled = gp.simulate(schedule, profile.forward, profile.backward,
                          backward_input=profile.backward_input,
                          backward_weight=profile.backward_weight, transfer=[0.001],
                          checkpoint="except_last", recompute=profile.recompute,
                          forward_no_grad=profile.forward_no_grad)
    assert direct.step_time == spelled.step_time and direct.events == spelled.events
    # An argument beside the profile replaces the profile's.
    never = gp.simulate(schedule, profile, checkpoint="never")
    assert never.step_time == gp.simulate(schedule, profile.forward, profile.backward,
                                          backward_input=profile.backward_input,
                                          backward_weight=profile.backward_weight,
                                          transfer=[0.001]).step_time


def test_without_a_loss_the_last_stage_backpropagates_ones_and_ranks_can_be_chosen() -> None:
    model, x, _ = model_and_batch()
    profile = gp.profile_stages(model, [3, 3], x, schedule="1f1b", chunks=4, rounds=1,
                                ranks=[1])
    assert math.isnan(profile.forward[0]) and profile.forward[1] >= SLEEP_F
    assert profile.backward[1] >= SLEEP_B


def test_bad_arguments_say_what_to_change() -> None:
    model, x, y = model_and_batch()
    with pytest.raises(ValueError, match="schedule is for 2 stages and 8 micro-batches; the "
                                         "profile has 2 stages .* and 4 micro-batches"):
        gp.profile_stages(model, [3, 3], x, y, schedule=gp.fill_drain(2, 8), chunks=4)
    with pytest.raises(ValueError, match="rounds=0"):
        gp.profile_stages(model, [3, 3], x, y, rounds=0)
    with pytest.raises(ValueError, match=r"ranks \[2\] are not ranks of the schedule \(0..1\)"):
        gp.profile_stages(model, [3, 3], x, y, ranks=[2])
    with pytest.raises(ValueError, match="transfer has 2 values for 1 boundaries"):
        gp.profile_stages(model, [3, 3], x, y, transfer=[0.1, 0.2])


def test_per_layer_profiles_plan_and_a_costly_split_is_not_chosen() -> None:
    model, x, y = model_and_batch()
    layers = len(model)
    profiles = [gp.profile_stages(model, [1] * layers, x, y, loss_fn=nn.functional.cross_entropy,
                                  schedule=name, chunks=m, rounds=1)
                for m in (2, 4) for name in ("gpipe", "zb_h1")]
    plans = gp.plan(profiles=profiles, batch_size=16, stages=[2], schedule=["1f1b", "zb_h1"],
                    checkpoints=["never"])
    assert {p.num_microbatches for p in plans} == {2, 4}  # the profiled M only
    assert all(p.num_stages == 2 and p.peak_bytes == 0 for p in plans)


def split_costs(split_overhead: float) -> dict[str, object]:
    """Eight equal layers whose I + W costs ``split_overhead`` times their fused B."""
    layers = 8
    return dict(forward=[1.0] * layers, backward=[2.0] * layers,
                backward_input=[1.0 * split_overhead] * layers,
                backward_weight=[1.0 * split_overhead] * layers,
                activation_bytes=[1.0] * layers, input_bytes=[1.0] * layers,
                param_bytes=[1.0] * layers, batch_size=8, stages=[2], microbatches=[8],
                checkpoints=["never"], memory_budget=1e9, schedule=["1f1b", "zb_h1"])


def test_the_planner_chooses_a_split_schedule_only_where_its_measured_halves_pay() -> None:
    # At K=2, M=8 ZB-H1 saves at most a unit-time bubble of about 1/(M+1) of the step; I + W
    # costing 1.5x B loses far more than that, and costing B exactly loses nothing.
    assert gp.plan(**split_costs(1.0))[0].schedule == "zb_h1"  # type: ignore[arg-type]
    assert gp.plan(**split_costs(1.5))[0].schedule == "1f1b"  # type: ignore[arg-type]


def test_virtual_stages_pass_messages_within_a_rank_unpacked() -> None:
    model, x, y = model_and_batch()
    profile = gp.profile_stages(model, [2, 1, 1, 2], x, y, loss_fn=nn.functional.cross_entropy,
                                schedule="interleaved_1f1b", chunks=4, num_ranks=2, rounds=1)
    assert all(0 < c < math.inf for c in profile.forward + profile.backward)
    schedule = gp.get_schedule("interleaved_1f1b", 4, 4, num_ranks=2)
    assert gp.simulate(schedule, profile).step_time > SLEEP_F + SLEEP_B


def test_a_per_layer_profile_for_the_planner_can_leave_every_message_unpacked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A per-layer profile puts each layer on its own rank, so by default every layer packs its
    # output and unpacks its input (what a real boundary's ends copy); the planner prices the
    # boundaries a plan cuts itself, so ``pack_messages=False`` leaves every message as a
    # stage of the same rank passes it.
    from gpipe_core import wire
    packed: list[int] = []
    pack = wire.pack
    monkeypatch.setattr(wire, "pack", lambda *a, **k: packed.append(1) or pack(*a, **k))
    model, x, y = model_and_batch()
    n, m = len(model), 2
    kwargs = dict(loss_fn=nn.functional.cross_entropy, chunks=m, rounds=1, warmup=0)
    gp.profile_stages(model, [1] * n, x, y, **kwargs)  # type: ignore[arg-type]
    # captured messages packed once, then every replayed send: n - 1 boundaries, both ways
    assert len(packed) == 2 * (2 * (n - 1) * m)
    packed.clear()
    loose = gp.profile_stages(model, [1] * n, x, y, pack_messages=False,
                              **kwargs)  # type: ignore[arg-type]
    assert packed == []
    assert all(0 < c < math.inf for c in loose.forward + loose.backward)


def _events(schedule: gp.Schedule, cost: dict[str, float], steps: int, wait: float = 0.5,
            ) -> list[gp.TimelineEvent]:
    """A made-up timeline of ``steps`` steps: every action waits ``wait`` s for its input, then
    runs ``cost[kind]`` s plus 0.01 s per (step, stage): costs the profile must read exactly."""
    events = []
    clock = 0.0
    for step in range(steps):
        for row in schedule.actions:
            for action in row:
                start = clock
                ready = start + wait
                end = ready + cost[action.kind] + 0.01 * (step + action.stage)
                events.append(gp.TimelineEvent(action.stage, str(action), start, end, ready))
                clock = end
    return events[::-1]  # any order: the profile sorts each stage's events by start


def test_a_timeline_gives_each_actions_cost_without_its_wait() -> None:
    schedule = gp.get_schedule("gpipe", 2, 4)
    profile = gp.profile_timeline(_events(schedule, {"F": 1.0, "B": 2.0}, steps=3), schedule,
                                  checkpoint="never", transfer=0.25)
    assert profile.rounds == 3 and profile.num_microbatches == 4
    # Per stage: the median over the 3 steps of 1.0 + 0.01 * (step + stage) is step 1's.
    assert profile.forward == pytest.approx([1.01, 1.02])
    assert profile.backward == pytest.approx([2.01, 2.02])
    assert profile.transfer == [0.25] and profile.backward_input is None
    assert profile.samples[0]["F"] == pytest.approx([1.0, 1.01, 1.02])


def test_a_timeline_of_rematerialized_and_split_steps() -> None:
    remat = gp.get_schedule("gpipe", 2, 4)
    # except_last: micro-batches 0-2 re-materialized, each B then includes the recomputation.
    events = _events(remat, {"F": 1.0, "B": 2.0}, steps=1)
    for i, e in enumerate(events):
        action = gp.Action.parse(e.action)
        if action.mb < 3:  # the re-materialized ones: a cheaper forward, a dearer backward
            extra = -0.5 if action.kind == "F" else 0.75
            events[i] = gp.TimelineEvent(e.stage, e.action, e.start, e.end + extra, e.ready)
    profile = gp.profile_timeline(events, remat, checkpoint="except_last")
    assert profile.forward == pytest.approx([1.0, 1.01])
    assert profile.forward_no_grad == pytest.approx([0.5, 0.51])
    assert profile.recompute == pytest.approx([0.75, 0.75])
    split = gp.get_schedule("zb_h1", 2, 4)
    profile = gp.profile_timeline(_events(split, {"F": 1.0, "I": 0.5, "W": 0.25}, steps=1),
                                  split, checkpoint="never")
    assert profile.backward_input == pytest.approx([0.5, 0.51])
    assert profile.backward_weight == pytest.approx([0.25, 0.26])
    assert profile.backward == pytest.approx([0.75, 0.77])


def test_a_partial_or_foreign_timeline_is_refused() -> None:
    schedule = gp.get_schedule("gpipe", 2, 4)
    events = _events(schedule, {"F": 1.0, "B": 2.0}, steps=2)
    with pytest.raises(ValueError, match="whole steps"):
        gp.profile_timeline(events[1:], schedule, checkpoint="never")
    with pytest.raises(ValueError, match=r"micro-batch [23]; the schedule has 2"):
        gp.profile_timeline(events, gp.get_schedule("gpipe", 2, 2), checkpoint="never")
    with pytest.raises(ValueError, match="empty"):
        gp.profile_timeline([], schedule, checkpoint="never")


def test_a_round_of_a_profile_holds_that_rounds_costs() -> None:
    schedule = gp.get_schedule("gpipe", 2, 4)
    profile = gp.profile_timeline(_events(schedule, {"F": 1.0, "B": 2.0}, steps=3), schedule,
                                  checkpoint="never", transfer=0.25)
    assert profile.num_rounds == 3
    last = profile.round(2)  # step 2: 0.02 s more than step 0 on stage 0, 0.03 on stage 1
    assert last.forward == pytest.approx([1.02, 1.03])
    assert last.backward == pytest.approx([2.02, 2.03])
    assert last.transfer == [0.25] and last.rounds == 1 and last.checkpoint == "never"
    with pytest.raises(ValueError, match=r"round 3 of a profile with 3 timed rounds"):
        profile.round(3)


def _made_up(forward: list[list[float]], backward: list[list[float]]) -> gp.StageProfile:
    """A fill-drain profile (K=2, M=1) with the given per-round costs of each stage."""
    samples = [{"F": f, "B": b} for f, b in zip(forward, backward, strict=True)]
    median = [sorted(v)[len(v) // 2] for v in forward]
    return gp.StageProfile(schedule="gpipe", num_microbatches=1, checkpoint="never",
                           forward=median, backward=[sorted(v)[len(v) // 2] for v in backward],
                           forward_no_grad=median, recompute=median, samples=samples)


def test_per_round_simulation_predicts_the_median_step_not_the_step_of_median_costs() -> None:
    # At K=2, M=1 a step is F0 + F1 + B1 + B0. Round 0: stage 0 slow (6 s), round 1: stage 1
    # slow (6 s), round 2: both fast (4 s); every median cost is the fast one (4 s).
    profile = _made_up(forward=[[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]],
                       backward=[[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]])
    schedule = gp.get_schedule("gpipe", 2, 1)
    assert gp.simulate(schedule, profile).step_time == pytest.approx(4.0)
    assert gp.simulate(schedule, profile, per_round=True).step_time == pytest.approx(6.0)
    # An argument beside the profile still replaces its costs in every round (two crossings).
    assert gp.simulate(schedule, profile, transfer=0.5,
                       per_round=True).step_time == pytest.approx(7.0)


def test_per_round_simulation_needs_aligned_rounds() -> None:
    schedule = gp.get_schedule("gpipe", 2, 1)
    with pytest.raises(ValueError, match="give a StageProfile"):
        gp.simulate(schedule, [1.0, 1.0], [1.0, 1.0], per_round=True)
    uneven = _made_up(forward=[[1.0, 1.0, 1.0], [1.0, 1.0]], backward=[[1.0] * 3, [1.0] * 2])
    with pytest.raises(ValueError, match=r"\[2, 3\] rounds"):
        gp.simulate(schedule, uneven, per_round=True)
    bare = gp.StageProfile(schedule="gpipe", num_microbatches=1, checkpoint="never",
                           forward=[1.0, 1.0], backward=[1.0, 1.0],
                           forward_no_grad=[1.0, 1.0], recompute=[1.0, 1.0])
    with pytest.raises(ValueError, match="no per-round samples"):
        gp.simulate(schedule, bare, per_round=True)


def test_counted_bytes_and_measured_seconds_plan_together() -> None:
    """``costs`` with ``profiles``: each plan's memory is what the counted costs give alone,
    and its step time what the profiles give alone (the device's link made free, so that the
    transfers the costs add are nothing)."""
    model, x, y = model_and_batch()
    layers = len(model)
    profiles = [gp.profile_stages(model, [1] * layers, x, y, loss_fn=nn.functional.cross_entropy,
                                  chunks=m, rounds=1) for m in (2, 4)]
    costs = gp.layer_costs(model, x)
    device = gp.Device("core", memory_bytes=2**30, peak_flops=1e12, link_bandwidth=1e30,
                       link_latency=0.0)
    common = dict(batch_size=16, stages=[2], balance=[3, 3], checkpoints=["never", "always"])

    def by_key(plans: list[gp.Plan]) -> dict[tuple[int, str], gp.Plan]:
        return {(p.num_microbatches, p.checkpoint): p for p in plans}

    both = by_key(gp.plan(costs, device=device, optimizer="sgd", profiles=profiles,
                          **common))  # type: ignore[arg-type]
    counted = by_key(gp.plan(costs, device=device, optimizer="sgd", microbatches=[2, 4],
                             **common))  # type: ignore[arg-type]
    measured = by_key(gp.plan(profiles=profiles, **common))  # type: ignore[arg-type]
    assert set(both) == set(measured) == {(m, c) for m in (2, 4) for c in ("never", "always")}
    for key, plan in both.items():
        assert plan.peak_bytes == counted[key].peak_bytes > 0
        assert plan.step_time == pytest.approx(measured[key].step_time, rel=1e-12)
        assert plan.step_time != pytest.approx(counted[key].step_time, rel=1e-3)
    with pytest.raises(ValueError, match="profiles have 6 layers and costs 5"):
        gp.plan(gp.layer_costs(model[:5], x), device=device, profiles=profiles, batch_size=16)
