"""Pipelined NMT decoding (``apps.nmt.pipelined_search``) against one-process decoding.

One run, one random-init Transformer from ``apps/nmt/config.py``, one batch of random token-id
sentences of varied lengths (no SentencePiece needed: the output need not mean anything; a
random model rarely says EOS, so most sentences run to ``--max-len``). Two gloo processes
(K=2, one torch thread each) measure round-robin, one decoding of each configuration per round
so that changes in machine load touch all alike: the plain model in rank 0 with 1 and with 2
threads (the other rank waits: 2 threads is the same total as the pipeline's), and the pipeline
with G = 1, 2, 4, 8 groups of sentences in flight; each for beam 4 and greedy. Reported per row:
median seconds and sentences per second, the ratio to the one-process rows measured beside it,
whether the hypotheses equal the one-process search on the same groups, and per rank the
parameter bytes held, the peak of tensor memory the decoding itself allocated
(``scripts.harness.LiveTensorBytes``: caches, activations, messages) and the peak resident
memory (rank 0's includes the whole model it keeps for the one-process rows). Writes JSON
(``--out``, default ``docs/reproduction/decoding.json``) with every round's samples and
``scripts.harness.provenance`` (commit, torch, UTC time, machine, load before and after).

    python scripts/bench_decoding.py [--sentences 64 --num-layers 6 --d-model 256 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import gpipe_core as gp
from apps.nmt.config import NMTConfig, build_model, replace
from apps.nmt.pipelined_search import pipelined_search_hypotheses
from apps.nmt.search import BeamSearch, GreedySearch, Hypothesis, search_hypotheses
from gpipe_core.launch import spawn
from gpipe_core.materialization import materialize
from gpipe_core.partition import optimal_balance
from scripts.harness import (
    LiveTensorBytes,
    provenance,
    reset_peak_rss,
    rss_mb,
    timed_step,
    write_json,
)

K = 2
SEED = 0


def model_config(args: argparse.Namespace) -> NMTConfig:
    return replace(NMTConfig(), num_layers=args.num_layers, d_model=args.d_model,
                   ffn_dim=args.ffn_dim, num_heads=args.num_heads, head_dim=args.head_dim,
                   vocab_size=args.vocab, dropout=0.0, max_positions=args.max_len + 64)


def sentences(args: argparse.Namespace, config: NMTConfig) -> Tensor:
    """Random token ids (no pad/BOS/EOS/UNK), lengths spread over [min_src, max_src]."""
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(4, config.vocab_size, (args.sentences, args.max_src),
                        generator=generator)
    lengths = torch.randint(args.min_src, args.max_src + 1, (args.sentences,),
                            generator=generator)
    src[torch.arange(args.max_src)[None, :] >= lengths[:, None]] = config.pad_id
    return src


def decoding_balance(model: nn.Sequential, src: Tensor, *, beam: int,
                     search_args: dict[str, Any]) -> list[int]:
    """Layers per stage for decoding ``src`` with beam ``beam``: each layer's time in the
    decoding steps of a one-process decoding in K groups, after a warm one (its decode steps,
    the target embedding or the projection; the search's steps counted with the projection,
    whose stage runs them), split by ``gpipe_core.partition.optimal_balance`` (contiguous, the
    slowest stage as fast as it can be). The encoding is left out: each group's encoding runs
    on the first stages in the group's first round, while the later stages wait for it however
    the layers are split (measured: greedy K=2 [9, 5] by all the time, [11, 3] by the steps'
    time, the latter faster)."""
    seconds = [0.0] * len(model)

    def timed_call(fn: Any, index: int) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[index] += time.perf_counter() - start
        return call

    patched: list[tuple[Any, str]] = []
    for index, layer in enumerate(model):
        for name in ("embed_target", "decode", "logits"):
            if hasattr(layer, name):
                setattr(layer, name, timed_call(getattr(layer, name), index))
                patched.append((layer, name))
    advances = {cls: cls.advance for cls in (GreedySearch, BeamSearch)}
    for cls, advance in advances.items():
        cls.advance = timed_call(advance, len(model) - 1)  # type: ignore[method-assign]
    try:
        for _ in range(2):  # the first warms the allocator and caches up
            seconds[:] = [0.0] * len(model)
            search_hypotheses(model, src, beam_size=beam, groups=K, **search_args)
    finally:
        for layer, name in patched:
            delattr(layer, name)  # the class's method again
        for cls, advance in advances.items():
            cls.advance = advance  # type: ignore[method-assign]
    return list(optimal_balance(seconds, K))


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def memory(fn: Any) -> tuple[int, float | None]:
    """Peak tensor bytes ``fn`` allocated, and peak resident MB while it ran (untimed)."""
    try:
        reset_peak_rss()
    except OSError:
        pass
    dist.barrier()
    with LiveTensorBytes() as live:
        fn()
    dist.barrier()
    return live.peak, rss_mb("VmHWM")


def worker(rank: int, world_size: int, args: argparse.Namespace) -> str | None:
    """One rank's measurements; rank 0 returns the report as JSON text."""
    config = model_config(args)
    src = sentences(args, config)
    search_args = dict(bos_id=config.bos_id, eos_id=config.eos_id, alpha=0.6,
                       max_len=args.max_len)
    plain = None
    if rank == 0:  # only rank 0 runs (and holds) the whole model
        plain = materialize(build_model(config, device="meta"), seed=SEED,
                            device=torch.device("cpu")).eval()
    # a balance per beam (rank 0 measures it), and a pipeline of each: the same weights as the
    # one-process model (per-layer seeds); a rank materializes only its own stage
    balances: list[Any] = [None]
    if plain is not None:
        balances = [{beam: args.balance or decoding_balance(plain, src, beam=beam,
                                                            search_args=search_args)
                     for beam in args.beams}]
    dist.broadcast_object_list(balances, src=0)
    balance_of: dict[int, list[int]] = balances[0]
    pipes = {beam: gp.DistributedGPipe(build_model(config, device="meta"), balance_of[beam],
                                       chunks=1, loss_fn=lambda out, target: out.sum(),
                                       seed=SEED, timeout_s=300)
             for beam in args.beams}

    results: dict[tuple[int, str], list[Hypothesis]] = {}

    def single(beam: int, threads: int) -> Any:
        def run() -> None:
            if plain is not None:  # rank 0
                torch.set_num_threads(threads)
                try:
                    results[(beam, f"single{threads}")] = search_hypotheses(
                        plain, src, beam_size=beam, **search_args)
                finally:
                    torch.set_num_threads(1)
        return run

    def piped(beam: int, groups: int) -> Any:
        def run() -> None:
            results[(beam, f"G{groups}")] = pipelined_search_hypotheses(
                pipes[beam], src, pad_id=config.pad_id, beam_size=beam, groups=groups, **search_args)
        return run

    configs: dict[tuple[int, str], Any] = {}
    for beam in args.beams:
        for threads in (1, 2):
            configs[(beam, f"single{threads}")] = single(beam, threads)
        for groups in args.groups:
            configs[(beam, f"G{groups}")] = piped(beam, groups)
    times: dict[tuple[int, str], list[float]] = {key: [] for key in configs}
    peaks: dict[tuple[int, str], tuple[int, float | None]] = {}
    for key, fn in configs.items():  # a warm run of each, untimed, measuring memory
        peaks[key] = memory(fn)
    exact: dict[tuple[int, str], bool | None] = {}
    for (beam, name) in configs:  # the pipeline's hypotheses = the one process's, same groups
        if plain is not None and name.startswith("G"):
            want = search_hypotheses(plain, src, beam_size=beam, groups=int(name[1:]),
                                     **search_args)
            exact[(beam, name)] = results[(beam, name)] == want
    for _ in range(args.rounds):
        for key, fn in configs.items():
            times[key].append(timed_step(fn))

    rows = []
    for (beam, name), samples in times.items():
        per_rank: list[Any] = [None] * K
        dist.all_gather_object(per_rank, peaks[(beam, name)])
        held = param_bytes(pipes[beam])
        held_per_rank: list[Any] = [None] * K
        dist.all_gather_object(held_per_rank, held)
        hypotheses = results[(beam, name)] if rank == 0 else []
        rows.append({
            "beam": beam, "config": name, "balance": balance_of[beam],
            "seconds": statistics.median(samples),
            "samples": samples,
            "generated_tokens": sum(len(h.tokens) for h in hypotheses),
            "exact_vs_one_process_same_groups": exact.get((beam, name)),
            "param_bytes_per_rank": (held_per_rank if name.startswith("G") else
                                     [param_bytes(plain) if plain is not None else None, 0]),
            "peak_tensor_bytes_per_rank": [p for p, _ in per_rank],
            "peak_rss_mb_per_rank": [r for _, r in per_rank],
        })
    if plain is not None:
        meta_info = {"balance_per_beam": {str(b): v for b, v in balance_of.items()},
                     "model_param_bytes": param_bytes(plain),
                     "model_parameters": sum(p.numel() for p in plain.parameters())}
        return json.dumps({"rows": rows, **meta_info})
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=6, help="encoder = decoder layers")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--ffn-dim", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--min-src", type=int, default=8)
    parser.add_argument("--max-src", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=24, help="most tokens decoded")
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 1], help="1 = greedy")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--balance", type=int, nargs=2, default=None,
                        help="layers per stage (default: measured, see decoding_balance)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after a warm one)")
    parser.add_argument("--out", default="docs/reproduction/decoding.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    load_before = os.getloadavg()
    report = json.loads(spawn(worker, K, None, args, pg_timeout_s=300, timeout_s=None)[0])
    rows = report["rows"]
    single = {(r["beam"], r["config"]): r["seconds"] for r in rows
              if r["config"].startswith("single")}
    for row in rows:
        row["sentences_per_s"] = args.sentences / row["seconds"]
        row["speedup_vs_single1"] = single[(row["beam"], "single1")] / row["seconds"]
        row["speedup_vs_single2"] = single[(row["beam"], "single2")] / row["seconds"]
    report.update(config=vars(args), K=K, provenance=provenance(load_before))
    out = write_json(args.out, report)

    mb = report["model_param_bytes"] / 2**20
    print(f"model: {report['model_parameters'] / 1e6:.1f}M parameters ({mb:.1f} MB), "
          f"{args.num_layers}+{args.num_layers} layers d={args.d_model} vocab {args.vocab}; "
          f"{args.sentences} sentences of {args.min_src}-{args.max_src} tokens, max_len "
          f"{args.max_len}; pipeline K={K}, balance per beam {report['balance_per_beam']}, "
          "1 thread per rank")
    print(f"{'beam':>4} {'config':<8}{'s':>8}{'sent/s':>9}{'vs 1thr':>9}{'vs 2thr':>9}"
          f"{'exact':>7}{'params MB/rank':>16}{'tensor MB/rank':>16}{'RSS MB/rank':>13}")
    for r in rows:
        def mbs(values: list[Any]) -> str:
            return "/".join("-" if v is None else f"{v / 2**20:.1f}" for v in values)
        rss = "/".join("-" if v is None else f"{v:.0f}" for v in r["peak_rss_mb_per_rank"])
        exact = {True: "yes", False: "NO", None: ""}[r["exact_vs_one_process_same_groups"]]
        print(f"{r['beam']:>4} {r['config']:<8}{r['seconds']:>8.3f}{r['sentences_per_s']:>9.1f}"
              f"{r['speedup_vs_single1']:>9.2f}{r['speedup_vs_single2']:>9.2f}{exact:>7}"
              f"{mbs(r['param_bytes_per_rank']):>16}{mbs(r['peak_tensor_bytes_per_rank']):>16}"
              f"{rss:>13}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
