"""DistributedGPipe against the plain module and torch.distributed.pipelining, side by side.

One run, one model, one batch, one thread per process: two gloo processes (K=2), each pinned to
its own core (``gp.bind_cpus``; ``--no-pin`` leaves placement to the OS) and keeping freed
memory mapped (``gp.hold_freed_memory``; ``--no-hold-memory`` leaves glibc's defaults);
``--no-quiet-io`` lets gloo's I/O thread preempt our transport's calls. For each M in 1, 2,
4, 8, 16 they measure, round-robin (one step of each configuration per round, so that changes
in machine load touch all alike; in the order built, or with ``--order shuffled`` in an order
drawn per round, so that no configuration always runs after the same one): the plain module
in rank 0 on the whole batch and on the M micro-batches in a row, our ``DistributedGPipe`` (fill-drain, 1F1B, 1F1B with one forward
of slack, the zero-bubble ZB-H1 and ZB-H2, whose backward runs as I and W, and with two stages
per rank interleaved 1F1B, interleaved zero bubble, ZB-V and DualPipeV) and ``torch.distributed.pipelining`` (``ScheduleGPipe``,
``Schedule1F1B``, and with two stages per rank ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``). For
each row: median seconds per training step, speedup over the plain run, efficiency against
GPipe's ideal pipeline (the plain module run on the same M micro-batches, divided by
K*M/(M+K-1)) and against perfect parallelism (the same divided by K: zero-bubble schedules may
beat GPipe's ideal, never this one), and each rank's peak resident memory during a step, with
the part of it the step itself added, and the peak of the step's live tensors (exact, unlike
resident memory). Prints, for each of our schedules against its torch counterpart, in how
many of the paired rounds ours was faster.

Each of our steps is also held against its **bubble-free bound**, measured in the same step:
the busiest rank's own compute (the sum, over the actions it ran, of each action's time from
its input's arrival to its end: F, B or I and W, re-materialization inside B, and what an
action does to post its message), which is the step a pipeline with no bubble and no idle
time could take on these ranks. Per row: ``bound_seconds`` (median over the timed steps) and
``bound_efficiency`` (median of bound / step time, step by step), and per rank the compute,
the wait inside actions for a neighbour's message, and the rest of the step, outside any
action: before the first (the fill: a rank without the first stage learns the step from the
first activation), between actions (the transport's sends and receives, the loss, Python) and
after the last until the slowest rank ends (the drain). torch's steps get the same account
from the same rounds (:func:`time_torch_actions`): compute is its stages'
``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk`` and the schedule's
loss, wait its schedule's ``_wait_batch_p2p`` (which also waits for its sends to complete), so
where one library's step is slower the two accounts say in which part.

Writes the result (every row with its per-round samples, and ``scripts.harness.provenance``:
commit, torch, UTC time, machine, load before and after) to ``--json`` (default ``docs/reproduction/bench_pipeline.json``, the file the pages
cite) and to ``--out`` with a PNG of speedup against M.

    python scripts/bench_pipeline.py [--blocks 16 --width 256 --batch 64 --seq 16 --steps 15]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import gpipe_core as gp
from gpipe_core.launch import spawn
from gpipe_core.microbatch import scatter
from scripts.harness import (
    LiveTensorBytes,
    provenance,
    pyplot,
    save_figure,
    setup_process,
    step_memory_mb,
    timed_step,
    write_json,
)

K = 2
OURS = ("gpipe", "1f1b", "1f1b_slack1", "zb_h1", "zb_h2", "interleaved_1f1b", "interleaved_zb",
        "zb_v", "dualpipe_v")
THEIRS = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zb_v", "dualpipe_v")
# Our schedules and the torch.distributed.pipelining schedule each is compared with.
TORCH_COUNTERPART = {"gpipe": "gpipe", "1f1b": "1f1b", "1f1b_slack1": "1f1b", "zb_h1": "1f1b",
                     "zb_h2": "1f1b", "interleaved_1f1b": "interleaved_1f1b",
                     "interleaved_zb": "interleaved_zb", "zb_v": "zb_v",
                     "dualpipe_v": "dualpipe_v"}
# Schedules with two stages per rank: stage s on rank s mod K, or in a V (s and 2K-1-s).
VIRTUAL = {"interleaved_1f1b": "interleaved", "interleaved_zb": "interleaved", "zb_v": "v",
           "dualpipe_v": "v"}


class Block(nn.Module):
    """Pre-norm residual MLP block (the feed-forward half of a Transformer layer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(blocks: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


def data(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.width, generator=g)
    return x, torch.randn(args.batch, args.seq, args.width, generator=g)


# Model families beside the MLP blocks (issue 26: "faster" must hold on more than one):
# torch's nn.TransformerEncoderLayer, the NMT app's encoder and decoder layers and AmoebaNet-D
# cells, as scripts/reproduction.py builds them (the apps' current CPU defaults).
FAMILIES = ("mlp", "encoder", "nmt_app", "amoebanet_app", "amoebanet_56px")
# AmoebaNet-D(L, D) on 56x56 images, batch 32: the activation-heavy input of Table 1
# (scripts/reproduction.py), at a size whose step takes about a second on one core
AMOEBA_56PX_SIZE = {"L": 6, "D": 16}


@dataclass
class Workload:
    """What a run trains: a builder of the same seeded model each call, one batch, the loss."""

    build: Callable[[], nn.Sequential]
    inputs: Any
    targets: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]
    describe: str


def workload(args: argparse.Namespace) -> Workload:
    if args.family == "mlp":
        x, y = data(args)
        return Workload(lambda: build(args.blocks, args.width), x, y, loss_fn,
                        f"{args.blocks} MLP blocks, d={args.width}, batch {args.batch}x{args.seq}")
    from scripts import reproduction as r

    amoeba_56px = ((r.TINY_FAMILIES["amoebanet_56px"], {"L": 3, "D": 4}) if args.tiny
                   else (r.FAMILIES["amoebanet_56px"], AMOEBA_56PX_SIZE))
    family, size = {"encoder": (r.TINY_ENCODER if args.tiny else r.ENCODER,
                                {"L": 3 if args.tiny else 8}),
                    "amoebanet_56px": amoeba_56px, **r.APP_FAMILIES}[args.family]
    batch = args.batch or family.batch_size
    x, y = family.batch(batch)
    return Workload(lambda: gp.materialize(family.build(size), seed=0), x, y, family.loss_fn,
                    f"{args.family} {family.describe(size) or '(the app default)'}, batch {batch}")


def step_tensor_mb(fn: Any) -> float:
    """Peak bytes of tensors one step holds at once (``LiveTensorBytes``: what the step adds,
    activations kept for backward, gradients, messages; not the allocator's slack)."""
    meter = LiveTensorBytes()
    with meter:
        timed_step(fn)
    return meter.peak / 2**20


def plain_steps(model: nn.Sequential, x: Any, y: Tensor, m: int, rank: int,
                loss: Callable[[Any, Tensor], Tensor] = loss_fn) -> dict[str, Any]:
    """The plain module in one process (rank 0; the other ranks wait): whole batch, M chunks."""

    def whole() -> None:
        if rank == 0:
            model.zero_grad(set_to_none=True)
            loss(model(x), y).backward()

    def chunked() -> None:
        if rank == 0:
            model.zero_grad(set_to_none=True)
            for xm, ym in zip(scatter(x, m), scatter(y, m), strict=True):
                (loss(model(xm), ym) / m).backward()

    return {"whole": whole, "chunked": chunked}


def worker(rank: int, world_size: int, args: argparse.Namespace) -> str | None:
    """One rank's measurements; rank 0 returns every row as JSON text."""
    work = workload(args)
    x, y = work.inputs, work.targets
    plain_model = work.build() if args.plain else None  # --no-plain: not even held
    rows = []
    for m in args.microbatches:
        # Every configuration of this M, measured round-robin: one step of each per round, so
        # that drifts in machine load touch them all alike.
        configs: dict[tuple[str, str], Any] = {}
        balances: dict[tuple[str, str], list[int]] = {}
        if plain_model is not None:
            for schedule, fn in plain_steps(plain_model, x, y, m, rank, work.loss_fn).items():
                configs[("plain", schedule)] = fn
        counterparts = {TORCH_COUNTERPART[s] for s in args.schedules}
        for impl, schedule in ([("gpipe_core", s) for s in OURS if s in args.schedules]
                               + [("torch.pipelining", s) for s in THEIRS if s in counterparts]):
            model = work.build()
            balance = list(args.balance_of.get(schedule, equal_balance(len(model), schedule)))
            if len(model) < len(balance):  # a stage without layers: nothing to compare
                continue
            step = make_step(impl, schedule, model, balance, m, rank, x, y, args.checkpoint,
                             args.quiet_io, work.loss_fn)
            if step is not None:
                configs[(impl, schedule)] = step
                balances[(impl, schedule)] = balance
        times: dict[tuple[str, str], list[float]] = {key: [] for key in configs}
        peaks: dict[tuple[str, str], tuple[float | None, float | None, float]] = {}
        # this rank's (compute, wait, lead, between) of every timed step of both libraries'
        # pipelines
        spent: dict[tuple[str, str], list[tuple[float, ...]]] = {
            key: [] for key in configs if key[0] != "plain"}
        for round_ in range(args.warmup + args.steps):
            for key in round_order(list(configs), round_, args.order):
                fn = configs[key]
                if round_ == args.warmup - 1:  # warm steps, untimed: memory
                    peaks[key] = (*step_memory_mb(fn), step_tensor_mb(fn))
                    continue
                started: list[float] = []  # when this rank began the step
                if hasattr(fn, "pipe"):
                    fn.pipe.timeline.clear()  # this step's actions only
                _TORCH_CALLS.clear()
                seconds = timed_step(functools.partial(_started, fn, started))
                if round_ >= args.warmup:
                    times[key].append(seconds)
                    if hasattr(fn, "pipe"):
                        spent[key].append(action_time(fn.pipe.timeline, started[0]))
                    elif key in spent:
                        spent[key].append(torch_action_time(_TORCH_CALLS, started[0]))
        for (impl, schedule), samples in times.items():
            rank_peaks: list[Any] = [None] * K
            dist.all_gather_object(rank_peaks, peaks[(impl, schedule)])
            row = {"impl": impl, "schedule": schedule, "M": m,
                   "seconds": statistics.median(samples), "samples": samples,
                   "peak_rss_mb_per_rank": [p for p, _, _ in rank_peaks],
                   "step_memory_mb_per_rank": [d for _, d, _ in rank_peaks],
                   "peak_tensor_mb_per_rank": [t for _, _, t in rank_peaks]}
            if (impl, schedule) in balances:
                row["balance"] = balances[(impl, schedule)]
            if (impl, schedule) in spent:
                per_rank: list[Any] = [None] * K
                dist.all_gather_object(per_rank, spent[(impl, schedule)])
                row.update(bound(per_rank, samples))
            rows.append(row)
    return json.dumps(rows) if rank == 0 else None


# torch.distributed.pipelining's timed calls in this process: (compute?, start, end)
_TORCH_CALLS: list[tuple[bool, float, float]] = []


def _timed(fn: Callable[..., Any], compute: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TORCH_CALLS.append((compute, start, time.perf_counter()))

    return timed


def time_torch_actions() -> None:
    """Time torch.distributed.pipelining's actions in this process as our timeline times ours
    (once per process; a perf_counter pair around each call): its stages' forward, backward and
    weight-gradient calls and its schedule's loss as compute, its schedule's waits for a batch
    of messages as wait."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining import stage as stages

    if getattr(schedules, "_bench_pipeline_timed", False):
        return
    base = stages._PipelineStageBase
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(base, name, _timed(getattr(base, name), compute=True))
    schedules._PipelineSchedule._maybe_compute_loss = _timed(  # type: ignore[method-assign]
        schedules._PipelineSchedule._maybe_compute_loss, compute=True)
    schedules._wait_batch_p2p = _timed(schedules._wait_batch_p2p, compute=False)
    schedules._bench_pipeline_timed = True  # type: ignore[attr-defined]


def torch_action_time(calls: list[tuple[bool, float, float]], start: float
                      ) -> tuple[float, float, float, float]:
    """One torch step's account on this rank, as :func:`action_time` gives ours: (compute,
    wait, lead: from the step's start to its first call, between: the gaps between calls). A
    call inside another (none in torch 2.14's schedules) counts once, in the outer one."""
    outer: list[tuple[bool, float, float]] = []
    for call in sorted(calls, key=lambda c: c[1]):
        if not outer or call[1] >= outer[-1][2]:
            outer.append(call)
    compute = sum(end - begin for is_compute, begin, end in outer if is_compute)
    wait = sum(end - begin for is_compute, begin, end in outer if not is_compute)
    lead = outer[0][1] - start if outer else 0.0
    between = sum(max(0.0, b[1] - a[2]) for a, b in zip(outer, outer[1:], strict=False))
    return compute, wait, lead, between


def _started(fn: Callable[[], Any], started: list[float]) -> Any:
    started.append(time.perf_counter())
    return fn()


def equal_balance(layers: int, schedule: str) -> list[int]:
    """The layers in equal counts over the stages: one per rank, two with a virtual schedule."""
    parts = 2 * K if schedule in VIRTUAL else K
    return [layers // parts + (1 if i < layers % parts else 0) for i in range(parts)]


def action_time(events: list[gp.TimelineEvent], start: float) -> tuple[float, float, float, float]:
    """One step of this rank's actions, the step begun at ``start`` (perf_counter): (compute:
    each action from its input's arrival to its end; wait: inside actions, for a neighbour's
    message; lead: from the step's start to the first action (a rank without the first stage
    waits there for the pipeline's first message, which tells it the step: the fill); between:
    the gaps between its actions, where the transport posts and completes messages and Python
    runs)."""
    compute = sum(e.end - (e.ready if e.ready is not None else e.start) for e in events)
    wait = sum(e.ready - e.start for e in events if e.ready is not None)
    lead = events[0].start - start if events else 0.0
    between = sum(max(0.0, b.start - a.end) for a, b in zip(events, events[1:], strict=False))
    return compute, wait, lead, between


def bound(per_rank: list[list[tuple[float, ...]]], samples: list[float]) -> dict[str, Any]:
    """The bubble-free bound of every timed step (the busiest rank's compute) against the step's
    time, and each rank's time by cause (medians over the steps): compute; waits inside actions
    for a neighbour's message; outside its actions: before the first (the fill), between them
    (posts, receives, Python) and after the last until the slowest rank ends (the drain)."""
    steps = list(zip(*per_rank, strict=True))  # per step: every rank's (compute, wait, ...)
    bounds = [max(spent[0] for spent in ranks) for ranks in steps]

    def per_rank_median(cause: Callable[[tuple[float, ...], float], float]) -> list[float]:
        return [statistics.median(cause(spent, t) for spent, t in zip(rank, samples, strict=True))
                for rank in per_rank]

    return {
        "bound_seconds": statistics.median(bounds),
        "bound_samples": bounds,
        "bound_efficiency": statistics.median(b / t for b, t in zip(bounds, samples, strict=True)),
        "compute_per_rank": per_rank_median(lambda spent, _: spent[0]),
        "wait_per_rank": per_rank_median(lambda spent, _: spent[1]),
        # the step's time outside this rank's actions: before its first, between them (the
        # transport's posts and receives, the loss, Python) and after its last
        "outside_actions_per_rank": per_rank_median(lambda spent, t: t - spent[0] - spent[1]),
        "fill_per_rank": per_rank_median(lambda spent, _: spent[2]),
        "between_actions_per_rank": per_rank_median(lambda spent, _: spent[3]),
        "drain_per_rank": per_rank_median(
            lambda spent, t: t - spent[0] - spent[1] - spent[2] - spent[3]),
    }


class _TupleIn(nn.Module):
    """torch.distributed.pipelining hands a stage a tuple message as separate arguments; our
    layers take one tuple, as gpipe_core passes it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return self.inner(args[0] if len(args) == 1 else args)


def round_order(keys: list[Any], round_: int, order: str) -> list[Any]:
    """The configurations' order in one round. ``fixed``: as built, every round (each one always
    runs after the same other one); ``shuffled``: a permutation drawn from the round's number
    (the same on every rank), so that no configuration runs after the same one each round."""
    if order == "fixed":
        return keys
    shuffled = list(keys)
    random.Random(round_).shuffle(shuffled)
    return shuffled


def make_step(impl: str, schedule: str, model: nn.Sequential, balance: list[int], m: int,
              rank: int, x: Any, y: Tensor, checkpoint: str, quiet_io: bool = True,
              loss: Callable[[Any, Tensor], Tensor] = loss_fn) -> Any:
    if impl == "gpipe_core":
        try:
            # record: each action's timeline, for the bubble-free bound (perf_counter calls
            # around each action; torch.pipelining's steps have none)
            pipe = gp.DistributedGPipe(model, balance, chunks=m, schedule=schedule,
                                       checkpoint=checkpoint, loss_fn=loss, quiet_io=quiet_io,
                                       record=True)
        except ValueError:
            return None  # DualPipeV refusing fewer than 2K micro-batches

        def ours() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)

        ours.pipe = pipe  # type: ignore[attr-defined]
        return ours
    from torch.distributed import pipelining

    time_torch_actions()
    factory = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
               "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
               "interleaved_zb": pipelining.ScheduleInterleavedZeroBubble,
               "zb_v": pipelining.ScheduleZBVZeroBubble,
               "dualpipe_v": pipelining.ScheduleDualPipeV}[schedule]
    num_stages = len(balance)
    placement = VIRTUAL.get(schedule)
    indices = ([rank] if placement is None else [rank, rank + K] if placement == "interleaved"
               else [rank, num_stages - 1 - rank])
    layers = list(model)
    submodules = [_TupleIn(nn.Sequential(*layers[sum(balance[:i]) : sum(balance[: i + 1])]))
                  for i in indices]
    stages = [pipelining.PipelineStage(sub, i, num_stages, torch.device("cpu"))
              for sub, i in zip(submodules, indices, strict=True)]
    first, last = 0 in indices, num_stages - 1 in indices
    try:
        sched = factory(stages if placement else stages[0], n_microbatches=m, loss_fn=loss)
    except (ValueError, RuntimeError):
        return None  # e.g. 1F1B refusing fewer micro-batches than stages

    def theirs() -> None:
        for sub in submodules:
            sub.zero_grad(set_to_none=True)
        sched.step(*((tuple(x) if isinstance(x, tuple | list) else (x,)) if first else ()),
                   target=y if last else None,
                   losses=[] if last else None)

    return theirs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``argv``: default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="mlp",
                        help="mlp: --blocks pre-norm MLP blocks of --width; encoder: 8 "
                             "nn.TransformerEncoderLayer (d=192) and a head; nmt_app, "
                             "amoebanet_app: the apps' CPU default models")
    parser.add_argument("--tiny", action="store_true",
                        help="the encoder family at test size (the tests)")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=None,
                        help="mini-batch (default 64 for mlp, else the family's)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=15, help="timed rounds per M")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed rounds per M (>= 1: the last measures memory)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--balance", type=int, nargs="+", default=None,
                        help="layers per stage for the schedules with that many stages (both "
                             "libraries; the others keep equal counts); default equal counts")
    parser.add_argument("--balance-of", action="append", default=[], metavar="SCHEDULE=N,N,..",
                        help="one schedule's layers per stage (both libraries' schedule of that "
                             "name); repeatable; before --balance")
    parser.add_argument("--schedules", nargs="+", choices=OURS, default=list(OURS),
                        help="our schedules to run, each with its torch counterpart (default "
                             "all): fewer pipelines held in each rank's process")
    parser.add_argument("--checkpoint", default="never",
                        help="gpipe_core re-materialization (torch.pipelining has none)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin each rank to its own core (gp.bind_cpus)")
    parser.add_argument("--no-hold-memory", dest="hold_memory", action="store_false",
                        help="leave glibc's malloc thresholds alone (gp.hold_freed_memory)")
    parser.add_argument("--no-quiet-io", dest="quiet_io", action="store_false",
                        help="let gloo's I/O thread preempt our sends and posts "
                             "(gpipe_core.cpu.QuietIOThreads off)")
    parser.add_argument("--no-plain", dest="plain", action="store_false",
                        help="leave out the plain module's steps (and the speedups and "
                             "efficiencies against it): the pipelines alone in each round")
    parser.add_argument("--order", choices=["fixed", "shuffled"], default="fixed",
                        help="each round's order of the configurations: as built, or a "
                             "permutation drawn per round (no configuration always after the "
                             "same one)")
    parser.add_argument("--out", default="out/bench_pipeline", help="JSON and PNG")
    parser.add_argument("--json", default="docs/reproduction/bench_pipeline.json",
                        help="the result with its provenance, where the pages cite it")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup {args.warmup} and --steps {args.steps} must be at least 1")
    if args.batch is None and args.family == "mlp":
        args.batch = 64
    layers = len(workload(args).build()) if args.balance or args.balance_of else 0
    if args.balance and (sum(args.balance) != layers or min(args.balance) < 1):
        parser.error(f"--balance {args.balance} must be positive and sum to the model's "
                     f"{layers} layers")
    balances = {}
    for given in args.balance_of:
        schedule, _, counts = given.partition("=")
        try:
            balance = [int(c) for c in counts.split(",")]
        except ValueError:
            balance = []
        stages = len(equal_balance(layers, schedule)) if schedule in OURS else 0
        if (not stages or len(balance) != stages or sum(balance) != layers
                or min(balance, default=0) < 1):
            parser.error(f"--balance-of {given!r}: give SCHEDULE=N,N,... with one of "
                         f"{', '.join(OURS)} and its stages' counts (2, or 4 for "
                         f"{', '.join(VIRTUAL)}), positive, summing to the model's {layers} "
                         "layers")
        balances[schedule] = balance
    for schedule in OURS:  # --balance: every other schedule with that many stages
        if args.balance and len(equal_balance(layers, schedule)) == len(args.balance):
            balances.setdefault(schedule, list(args.balance))
    args.balance_of = balances  # per schedule (torch's of the same name too)
    return args


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    setup = functools.partial(setup_process, pin=args.pin, hold_memory=args.hold_memory)
    # no bound on the whole run (its length grows with the rows); a hang ends at the process
    # group's timeout, and a failed rank ends the other
    rows = json.loads(spawn(worker, K, None, args, setup=setup, pg_timeout_s=120,
                            timeout_s=None)[0])
    plain = {(r["M"], r["schedule"]): r["seconds"] for r in rows if r["impl"] == "plain"}
    for row in rows:
        if plain:
            m = row["M"]
            ideal = plain[(m, "chunked")] * (m + K - 1) / (K * m)
            row["speedup"] = plain[(m, "whole")] / row["seconds"]
            row["efficiency"] = ideal / row["seconds"]
            row["parallel_efficiency"] = plain[(m, "chunked")] / K / row["seconds"]
    out = Path(args.out)
    report = {"provenance": provenance(load_before), "config": vars(args), "rows": rows}
    write_json(out / "bench_pipeline.json", report)
    write_json(args.json, report)
    if plain:
        whole = statistics.median(s for (_, sched), s in plain.items() if sched == "whole")
        print(f"plain module, 1 thread: {whole:.4f} s/step", end="; ")
    print(f"{workload(args).describe}; cores pinned: {args.pin}; freed memory held: "
          f"{args.hold_memory}; gloo I/O thread quiet in our calls: {args.quiet_io}")
    if plain:
        print("eff.: against GPipe's ideal (plain on M micro-batches x (M+K-1)/(KM)); par.: "
              "against perfect parallelism (plain on M micro-batches / K)")
    print(f"{'impl':<18}{'schedule':<17}{'M':>3}{'s/step':>9}{'speedup':>9}{'eff.':>7}{'par.':>7}"
          f"{'peak RSS MB/rank':>18}{'step adds MB':>14}{'tensors MB':>12}")
    for r in rows:
        peaks = "/".join(f"{p:.0f}" if p is not None else "-" for p in r["peak_rss_mb_per_rank"])
        added = "/".join(f"{p:.0f}" if p is not None else "-" for p in r["step_memory_mb_per_rank"])
        tensors = "/".join(f"{p:.1f}" for p in r["peak_tensor_mb_per_rank"])
        against = (f"{r['speedup']:>9.2f}{r['efficiency']:>7.0%}{r['parallel_efficiency']:>7.0%}"
                   if plain else f"{'-':>9}{'-':>7}{'-':>7}")
        print(f"{r['impl']:<18}{r['schedule']:<17}{r['M']:>3}{r['seconds']:>9.4f}{against}"
              f"{peaks:>18}{added:>14}{tensors:>12}")
    for m in args.microbatches:
        ours = {r["schedule"]: r["seconds"] for r in rows if r["M"] == m and r["impl"] == "gpipe_core"}
        theirs = {r["schedule"]: r["seconds"] for r in rows
                  if r["M"] == m and r["impl"] == "torch.pipelining"}
        ratios = ", ".join(f"{s}: {theirs[TORCH_COUNTERPART[s]] / ours[s]:.2f}x" for s in ours
                           if TORCH_COUNTERPART[s] in theirs)
        print(f"M={m}: torch.pipelining time / gpipe_core time: {ratios}")
        if theirs:
            print(f"M={m}: rounds in which gpipe_core was faster than torch.pipelining: "
                  + ", ".join(f"{s} {won}/{rounds}"
                              for s, (won, rounds) in paired_wins(rows, m).items()))
        if ours and theirs:
            best_ours = min(ours, key=ours.__getitem__)
            best_theirs = min(theirs, key=theirs.__getitem__)
            print(f"M={m}: fastest gpipe_core {best_ours} {ours[best_ours]:.4f} s, fastest "
                  f"torch.pipelining {best_theirs} {theirs[best_theirs]:.4f} s: "
                  f"{theirs[best_theirs] / ours[best_ours]:.2f}x"
                  + ("; zero-bubble against our 1F1B: "
                     + ", ".join(f"{s} {ours['1f1b'] / ours[s]:.2f}x"
                                 for s in ("zb_h1", "zb_h2", "zb_v", "dualpipe_v",
                                           "interleaved_1f1b", "interleaved_zb")
                                 if s in ours) if "1f1b" in ours else ""))
    if plain:  # the speedup over the plain module against M
        plot(rows, out / "bench_pipeline.png")
    print(f"wrote {args.json} and {out}/bench_pipeline.json"
          + (" and bench_pipeline.png" if plain else ""))


def paired_wins(rows: list[dict[str, Any]], m: int) -> dict[str, tuple[int, int]]:
    """For each of our schedules at ``m`` micro-batches: in how many rounds its step was faster
    than its torch counterpart's in the same round (rounds are paired: one step of each per
    round), and of how many."""
    samples = {(r["impl"], r["schedule"]): r["samples"] for r in rows if r["M"] == m}
    wins = {}
    for (impl, schedule), ours in samples.items():
        theirs = samples.get(("torch.pipelining", TORCH_COUNTERPART.get(schedule, "")))
        if impl == "gpipe_core" and theirs is not None:
            wins[schedule] = (sum(a < b for a, b in zip(ours, theirs, strict=True)), len(ours))
    return wins


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for impl in ("gpipe_core", "torch.pipelining"):
        for schedule, style in (("gpipe", "-o"), ("1f1b", "--s"), ("1f1b_slack1", "-.^"),
                                ("zb_h1", ":v"), ("zb_h2", ":D"), ("interleaved_1f1b", "-x"),
                                ("interleaved_zb", "-+"), ("zb_v", "-*"), ("dualpipe_v", "-p")):
            sel = [r for r in rows if r["impl"] == impl and r["schedule"] == schedule]
            if sel:
                ax.plot([r["M"] for r in sel], [r["speedup"] for r in sel], style,
                        label=f"{impl} {schedule}")
    ms = sorted({r["M"] for r in rows})
    ax.plot(ms, [K * m / (m + K - 1) for m in ms], ":", color="gray", label="ideal K*M/(M+K-1)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("speedup over plain (1 thread)")
    ax.set_title(f"K={K} pipeline on CPU (gloo)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
