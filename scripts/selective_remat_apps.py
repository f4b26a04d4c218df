"""Selective re-materialization chosen by ``gp.plan`` in both apps, measured (issue 42.2).

For the default CPU model of each app (``apps/nmt`` with its defaults, ``apps/amoebanet`` with
``cpu_fashion_mnist.yaml``) at K=2 over 2 gloo ranks, fill-drain (the apps' schedule), and each
M of ``--chunks``:

1. *Memory.* ``gp.plan`` on the app's costs counted on ``meta`` (``apps.planning.budget_plan``,
   what ``memory_budget_mb`` runs) predicts each rank's peak (parameters, gradients and Adam
   state at 16 bytes a parameter, plus kept activations) for ``never``, ``always`` and the
   selective plan it chooses at a budget ``--share`` of the way from ``always``'s peak to
   ``never``'s. Each configuration then runs on 2 ranks (``gp.DistributedGPipe``, the plan's
   balance and ``checkpoint=``, one warm step with the optimizer); the measured per-rank peak
   is the weights and optimizer state held (and the batch's inputs on the first rank, its
   targets on the last: the pipeline's micro-batches are views of them, held to their
   backward) plus the live-tensor peak of one more training step
   (``scripts.harness.LiveTensorBytes``: gradients, activations, recomputation, messages,
   temporaries). The optimizer's own step is outside (its temporaries are not in the plan).
2. *Time.* At ``--timing-chunks``, in the same two processes, ``always`` and the selective
   plan (the same balance) run in alternating paired rounds (the ranks set up as the apps'
   are: one core each, freed memory kept mapped; ``--pairs``, order swapped every pair,
   ``--steps`` steps a round; medians, rounds won, load average before and after); the
   measured margin ``1 - selective / always`` is set against the plan's predicted margin (goal:
   at least 80% of it). The plans' seconds (which layers to recompute, the balance, the
   predicted margin) come from ``--times``: ``measured`` (default), each layer's forward and
   backward profiled on this machine with one thread at each M (``gp.profile_stages``, one
   stage per layer, every micro-batch kept, then every one re-materialized, combined by
   ``gp.StageProfile.combined``: the forward with and without autograd, each in the memory
   pattern it runs in, what ``gp.plan(costs, profiles=...)`` takes), or ``counted``, the FLOPs,
   operator calls and element-wise bytes priced by ``apps.planning.CPU_CORE``; the bytes are
   counted either way. The counted prediction of the timed M is recorded beside the measured
   one, so that the time model's error stays visible. Each rank's timeline gives the busy seconds of F and B per step, so a
   miss can be traced to the recomputation the choice saved (B) or not.

The exhaustive check (the planner within 3% of every choice of kept layers on small models) is
``tests/test_plan_selective.py::test_the_planner_is_within_3_percent_of_an_exhaustive_search``;
``--exhaustive`` repeats it here on each app's costs where the stages are small enough.

    python scripts/selective_remat_apps.py            # ~10 min on 2 cores
    python scripts/selective_remat_apps.py --quick --out /tmp/sel.json   # tiny configs, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gpipe_core as gp
from apps.planning import AppModel, MiB, _counted, budget_batch, budget_plan
from apps.planning import measured_profile as app_profile
from gpipe_core.launch import spawn
from gpipe_core.microbatch import flatten
from gpipe_core.schedule import Action
from scripts.harness import LiveTensorBytes, provenance, setup_process, write_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reproduction" / "selective_remat_apps.json"


@dataclass
class App:
    name: str
    config: Any
    model: AppModel
    costs: gp.LayerCosts


def load_app(name: str, quick: bool) -> App:
    if name == "nmt":
        from apps.nmt.config import load_nmt_config
        from apps.nmt.plan import app_model as nmt_model

        config = load_nmt_config(["--config=tiny"] if quick else [])
        model = nmt_model(config)
    else:
        from apps.amoebanet.config import load_train_config
        from apps.amoebanet.plan import app_model as amoebanet_model

        config = load_train_config(["--config=tiny_test"] if quick else [])
        model = amoebanet_model(config)
    return App(name, config, model, _counted(model, model.depth, torch.float32))


def predicted(app: App, chunks: int, share: float,
              profiles: list[gp.StageProfile] | None = None) -> dict[str, Any]:
    """The plan's never, always and selective (at the budget ``share`` of the way from always to
    never) for K=2 and ``chunks``; each with its per-rank peaks (MiB) and step time (from
    ``profiles`` where given, else counted)."""
    plans = {mode: budget_plan(app.model, budget_mb=1e12, num_stages=2, chunks=chunks,
                               schedule="gpipe", checkpoints=[mode], costs=app.costs,
                               profiles=profiles)
             for mode in ("never", "always")}
    low, high = plans["always"].peak_bytes / MiB, plans["never"].peak_bytes / MiB
    budget = low + share * (high - low)
    plans["selective"] = budget_plan(app.model, budget_mb=budget, num_stages=2, chunks=chunks,
                                     schedule="gpipe", checkpoints=["selective"],
                                     balance=plans["always"].balance, costs=app.costs,
                                     profiles=profiles)
    return {"budget_mb": budget, "plans": {
        mode: {"checkpoint": p.checkpoint, "balance": p.balance, "step_time_s": p.step_time,
               "rank_peak_mb": [(a + b) / MiB for a, b in
                                zip(p.param_bytes, p.activation_bytes, strict=True)]}
        for mode, p in plans.items()}}


# --- the ranks --------------------------------------------------------------------------------


def _batch(app: App, chunks: int) -> tuple[Any, Any, float | None]:
    """A fixed batch of the shape the plan counted: (inputs, targets, loss normalizer)."""
    rows = budget_batch(app.model, chunks)
    generator = torch.Generator().manual_seed(0)
    config = app.config
    if app.name == "nmt":
        ids = torch.randint(4, config.vocab_size, (3, rows, config.max_len), generator=generator)
        return (ids[0], ids[1]), ids[2], float(ids[2].numel())
    side = config.image_size
    images = torch.randn(rows, config.in_chans, side, side, generator=generator)
    return images, torch.randint(0, config.num_classes, (rows,), generator=generator), None


def _model(app: App) -> nn.Sequential:  # on meta: each rank materializes its stage
    if app.name == "nmt":
        from apps.nmt.config import build_model as build_nmt

        return build_nmt(app.config, device="meta")
    from apps.amoebanet.config import build_model as build_amoebanet

    return build_amoebanet(app.config, device="meta")


def _loss(app: App) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The app's training loss on the last layer's output."""
    if app.name == "nmt":
        from apps.nmt.model import token_cross_entropy_sum

        config = app.config

        def nmt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return token_cross_entropy_sum(logits, target, pad_id=config.pad_id,
                                           label_smoothing=config.label_smoothing,
                                           z_loss=config.z_loss)

        return nmt_loss

    def amoebanet_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), target)

    return amoebanet_loss


def _pipe(app: App, balance: list[int], chunks: int, checkpoint: str,
          record: bool = False) -> gp.DistributedGPipe:
    if app.name == "nmt":
        return gp.DistributedGPipe(_model(app), balance, chunks=chunks,
                                   checkpoint=checkpoint, loss_fn=_loss(app),
                                   loss_reduction="sum", seed=0, record=record)
    return gp.DistributedGPipe(_model(app), balance, chunks=chunks,
                               checkpoint=checkpoint, loss_fn=_loss(app), seed=0,
                               deferred_batch_norm=True, record=record)


def measured_profile(app: App, chunks: int) -> gp.StageProfile:
    """Each layer's seconds at ``chunks`` on this machine with one thread, as the train
    scripts measure them with a budget (``apps.planning.measured_profile``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return app_profile(app.model, chunks, seed=0, device=torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def _step(pipe: gp.DistributedGPipe, batch: tuple[Any, Any, float | None]) -> None:
    inputs, targets, normalizer = batch
    pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None,
              normalizer=normalizer)


def _held_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    weights = sum(p.numel() * p.element_size() for p in params)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return weights + state


def measure_peak(app: App, balance: list[int], chunks: int, checkpoint: str) -> dict[str, Any]:
    """This rank's weights and optimizer state plus the live-tensor peak of one training step
    (after a warm one that allocated the optimizer state)."""
    pipe = _pipe(app, balance, chunks, checkpoint)
    params = list(pipe.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-4)
    batch = _batch(app, chunks)
    _step(pipe, batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    held = _held_bytes(params, optimizer)
    # the batch's parts this rank's stages hold (their micro-batches are views of them, kept
    # to each one's backward): the inputs on the first rank, the targets on the last
    held += sum(t.numel() * t.element_size() for part, mine in
                ((batch[0], pipe.is_first), (batch[1], pipe.is_last)) if mine
                for t in flatten(part)[0] if isinstance(t, torch.Tensor))
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    with LiveTensorBytes([params, state, list(pipe.buffers()), batch[0], batch[1]]) as live:
        _step(pipe, batch)
    result = {"held_mb": held / MiB, "live_step_peak_mb": live.peak / MiB,
              "peak_mb": (held + live.peak) / MiB}
    del pipe, optimizer, params, state
    return result


def _busy(timeline: list[Any], steps: int) -> dict[str, float]:
    """Seconds per step this rank computed (ready to end), by action kind (F, B)."""
    busy: dict[str, float] = {}
    for event in timeline:
        kind = Action.parse(event.action).kind
        start = event.ready if event.ready is not None else event.start
        busy[kind] = busy.get(kind, 0.0) + (event.end - start) / steps
    return busy


def time_pairs(app: App, balance: list[int], chunks: int, checkpoints: dict[str, str],
               pairs: int, steps: int) -> dict[str, Any]:
    """Alternating rounds of ``steps`` steps of each checkpoint; per round: the slowest rank's
    seconds per step and this rank's busy time by action kind."""
    pipes = {label: _pipe(app, balance, chunks, checkpoint, record=True)
             for label, checkpoint in checkpoints.items()}
    batch = _batch(app, chunks)
    for pipe in pipes.values():  # warm-up
        for _ in range(2):
            _step(pipe, batch)
            pipe.zero_grad(set_to_none=True)
    rounds: list[dict[str, Any]] = []
    labels = list(pipes)
    for i in range(pairs):
        order = labels if i % 2 == 0 else labels[::-1]
        for label in order:
            pipe = pipes[label]
            pipe.timeline.clear()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(pipe, batch)
                pipe.zero_grad(set_to_none=True)
            seconds = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            rounds.append({"pair": i, "checkpoint": label, "seconds": float(seconds),
                           "busy": _busy(pipe.timeline, steps)})
    return {"rounds": rounds}


def _worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    app = load_app(spec["app"], spec["quick"])
    memory = []
    for job in spec["memory"]:
        memory.append({**job, **measure_peak(app, job["balance"], job["chunks"],
                                             job["checkpoint"])})
        dist.barrier()
    timing = None
    if spec.get("timing"):
        job = spec["timing"]
        timing = time_pairs(app, job["balance"], job["chunks"], job["checkpoints"],
                            spec["pairs"], spec["steps"])
    return {"rank": rank, "memory": memory, "timing": timing}


# --- the report ---------------------------------------------------------------------------------


def exhaustive(app: App, chunks: int, budget_mb: float, balance: list[int],
               profiles: list[gp.StageProfile] | None = None, limit: int = 4096
               ) -> dict[str, Any] | None:
    """The selective plan against every choice of kept layers at the same budget and balance
    (None where the choices exceed ``limit``)."""
    choices = [[set(c) for r in range(n + 1) for c in itertools.combinations(range(n), r)]
               for n in balance]
    if len(choices[0]) * len(choices[1]) > limit:
        return None
    best, best_choice = float("inf"), None
    for keep in itertools.product(*choices):
        try:
            found = budget_plan(app.model, budget_mb=budget_mb, num_stages=2, chunks=chunks,
                                schedule="gpipe", checkpoints=[gp.Remat(list(keep))],
                                balance=balance, costs=app.costs, profiles=profiles)
        except Exception:  # noqa: BLE001 -- ConfigError: this choice does not fit
            continue
        if found.step_time < best:
            best, best_choice = found.step_time, str(gp.Remat(list(keep)))
    chosen = budget_plan(app.model, budget_mb=budget_mb, num_stages=2, chunks=chunks,
                         schedule="gpipe", checkpoints=["selective"], balance=balance,
                         costs=app.costs, profiles=profiles)
    return {"choices": len(choices[0]) * len(choices[1]), "best_s": best,
            "best_checkpoint": best_choice, "chosen_s": chosen.step_time,
            "chosen_checkpoint": chosen.checkpoint, "chosen_over_best": chosen.step_time / best - 1}


def run_app(name: str, args: argparse.Namespace) -> dict[str, Any]:
    app = load_app(name, args.quick)
    profiles = {m: [measured_profile(app, m)] if args.times == "measured" else None
                for m in args.chunks}
    by_m = {m: predicted(app, m, args.share, profiles[m]) for m in args.chunks}
    counted = by_m[args.timing_chunks] if args.times == "counted" else predicted(
        app, args.timing_chunks, args.share)
    jobs = [{"chunks": m, "mode": mode, "balance": p["plans"][mode]["balance"],
             "checkpoint": p["plans"][mode]["checkpoint"]}
            for m, p in by_m.items() for mode in ("never", "always", "selective")]
    timing_plans = by_m[args.timing_chunks]["plans"]
    spec = {"app": name, "quick": args.quick, "memory": jobs, "pairs": args.pairs,
            "steps": args.steps,
            "timing": {"chunks": args.timing_chunks, "balance": timing_plans["always"]["balance"],
                       "checkpoints": {"always": "always",
                                       "selective": timing_plans["selective"]["checkpoint"]}}}
    load_before = os.getloadavg()
    # the ranks run as the apps' ranks do: one core each, freed memory kept mapped
    ranks = spawn(_worker, 2, None, spec, timeout_s=None, pg_timeout_s=300.0,
                  setup=setup_process)
    load_after = os.getloadavg()
    rows = []
    for i, job in enumerate(jobs):
        plan = by_m[job["chunks"]]["plans"][job["mode"]]
        measured = [r["memory"][i] for r in ranks]
        predicted_peak = max(plan["rank_peak_mb"])
        measured_peak = max(m["peak_mb"] for m in measured)
        rows.append({
            "M": job["chunks"], "mode": job["mode"], "checkpoint": job["checkpoint"],
            "balance": job["balance"], "budget_mb": by_m[job["chunks"]]["budget_mb"],
            "predicted_rank_peak_mb": plan["rank_peak_mb"],
            "measured_rank_peak_mb": [m["peak_mb"] for m in measured],
            "measured_rank_held_mb": [m["held_mb"] for m in measured],
            "measured_rank_live_step_peak_mb": [m["live_step_peak_mb"] for m in measured],
            "rank_errors": [p / m["peak_mb"] - 1 for p, m in
                            zip(plan["rank_peak_mb"], measured, strict=True)],
            "error": predicted_peak / measured_peak - 1,
            "measured_fits_budget": (measured_peak <= by_m[job["chunks"]]["budget_mb"]
                                     if job["mode"] == "selective" else None),
        })
    rounds = ranks[0]["timing"]["rounds"]
    busy_1 = ranks[1]["timing"]["rounds"]
    seconds = {label: [r["seconds"] for r in rounds if r["checkpoint"] == label]
               for label in ("always", "selective")}
    wins = sum(s < a for a, s in zip(seconds["always"], seconds["selective"], strict=True))
    med = {label: statistics.median(v) for label, v in seconds.items()}
    predicted_margin = 1 - (timing_plans["selective"]["step_time_s"]
                            / timing_plans["always"]["step_time_s"])
    measured_margin = 1 - med["selective"] / med["always"]

    def busy(label: str) -> list[dict[str, float]]:
        out = []
        for rank_rounds in (rounds, busy_1):
            chosen = [r["busy"] for r in rank_rounds if r["checkpoint"] == label]
            out.append({k: statistics.median(b.get(k, 0.0) for b in chosen)
                        for k in sorted({k for b in chosen for k in b})})
        return out

    timing = {
        "M": args.timing_chunks, "budget_mb": by_m[args.timing_chunks]["budget_mb"],
        "checkpoints": spec["timing"]["checkpoints"], "pairs": args.pairs,
        "steps_per_round": args.steps, "seconds": seconds, "median_s": med,
        "selective_won": wins, "ratio_selective_over_always": med["selective"] / med["always"],
        "predicted_s": {k: timing_plans[k]["step_time_s"] for k in ("always", "selective")},
        "predicted_margin": predicted_margin, "measured_margin": measured_margin,
        "times": args.times,
        "counted_prediction": {
            "checkpoint": counted["plans"]["selective"]["checkpoint"],
            "balance": counted["plans"]["always"]["balance"],
            "predicted_s": {k: counted["plans"][k]["step_time_s"]
                            for k in ("always", "selective")}},
        "margin_achieved": measured_margin / predicted_margin if predicted_margin else None,
        "goal_met": bool(predicted_margin and measured_margin >= 0.8 * predicted_margin),
        "rank_busy_s_per_step": {label: busy(label) for label in ("always", "selective")},
        "load_before": load_before, "load_after": load_after,
    }
    search = [exhaustive(app, m, by_m[m]["budget_mb"], by_m[m]["plans"]["always"]["balance"],
                         profiles[m])
              if args.exhaustive else None for m in args.chunks]
    return {"app": name, "model": app.model.describe, "batch": budget_batch(app.model, 1),
            "memory": rows, "timing": timing,
            # the per-layer seconds each M's plans were chosen with (None: counted)
            "profiles": {str(m): None if profiles[m] is None else dataclasses.asdict(profiles[m][0])
                         for m in args.chunks},
            "exhaustive": [dict(e, M=m) for m, e in zip(args.chunks, search, strict=True)
                           if e is not None]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apps", nargs="+", default=["nmt", "amoebanet"],
                        choices=["nmt", "amoebanet"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--timing-chunks", type=int, default=4)
    parser.add_argument("--share", type=float, default=0.5,
                        help="the budget's place between always's peak (0) and never's (1)")
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-exhaustive", dest="exhaustive", action="store_false")
    parser.add_argument("--times", choices=["measured", "counted"], default="measured",
                        help="the plans' seconds: per-layer profiles on this machine, or "
                             "CPU_CORE's prices of the counted work")
    parser.add_argument("--quick", action="store_true", help="tiny configs: a smoke run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.timing_chunks not in args.chunks:
        parser.error(f"--timing-chunks={args.timing_chunks} must be one of --chunks {args.chunks}")
    command = "python scripts/selective_remat_apps.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    gp.hold_freed_memory()  # the profiles too, as an app's rank 0 measures them
    load_before = os.getloadavg()
    report: dict[str, Any] = {
        "command": command.strip(), "num_stages": 2, "schedule": "gpipe", "share": args.share,
        "peak_counts": "weights + Adam state held + the live-tensor peak of one training step "
                       "(LiveTensorBytes), against gp.plan's parameters x 16 bytes + kept "
                       "activations",
        "apps": [run_app(name, args) for name in args.apps]}
    report["provenance"] = provenance(load_before)
    for app in report["apps"]:
        print(f"{app['app']}: {app['model']}")
        for row in app["memory"]:
            print(f"  M={row['M']:>2} {row['mode']:<9} predicted "
                  f"{[round(x, 1) for x in row['predicted_rank_peak_mb']]} measured "
                  f"{[round(x, 1) for x in row['measured_rank_peak_mb']]} MiB: "
                  f"{row['error']:+.1%}" + (f", fits {row['budget_mb']:.1f}: "
                                            f"{row['measured_fits_budget']}"
                                            if row["mode"] == "selective" else ""))
        t = app["timing"]
        print(f"  M={t['M']} {t['checkpoints']['selective']}: median "
              f"{t['median_s']['selective']:.3f} vs always {t['median_s']['always']:.3f} s/step "
              f"(selective won {t['selective_won']}/{t['pairs']}); margin measured "
              f"{t['measured_margin']:.1%}, predicted {t['predicted_margin']:.1%}; load "
              f"{t['load_before'][0]:.1f}-{t['load_after'][0]:.1f}")
        for e in app["exhaustive"]:
            print(f"  exhaustive M={e['M']}: chosen {e['chosen_s']:.4f} s, best of "
                  f"{e['choices']} {e['best_s']:.4f} s ({e['chosen_over_best']:+.1%})")
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
