"""Overhead of the single-process GPipe runtime, and the memory re-materialization saves.

Side by side in one run, on a Transformer-block stack and an AmoebaNet-like conv stack: the
plain module vs GPipe with K=1, 2, 4 partitions (all on CPU), chunks 1/4/8 and each checkpoint
mode. Reports the median seconds per training step (each row keeps its per-step samples) and
the peak bytes autograd keeps for backward (counted with
``torch.autograd.graph.saved_tensors_hooks``, plus the partition inputs the pipeline keeps
itself), prints a table and writes the rows to
``--out`` and, with ``scripts.harness.provenance`` (commit, torch, UTC time, machine, load
before and after), to ``--json`` (default ``docs/reproduction/bench_overhead.json``, the file
the pages cite).

    python scripts/bench_overhead.py [--repeats 7] [--out out/bench_overhead.json] [--quick]
                                     [--tiny]   # tiny models, for tests
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gpipe_core as gp
from scripts.harness import provenance, write_json


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class ConvCell(nn.Module):
    """A residual conv cell with BatchNorm, passing (x, skip) like AmoebaNet's cells."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
            nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
        )

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, skip = pair
        return self.body(x) + skip, x


class Stem(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.conv(x)
        return y, y


class Head(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, 10)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return self.fc(pair[0].mean((2, 3)))


def transformer_stack(layers: int = 8, d: int = 128, batch: int = 32, seq: int = 64
                      ) -> tuple[nn.Sequential, Tensor]:
    model = nn.Sequential(*[TransformerBlock(d, 4) for _ in range(layers)])
    return model, torch.randn(batch, seq, d)


def conv_stack(cells: int = 6, c: int = 32, batch: int = 32, size: int = 32
               ) -> tuple[nn.Sequential, Tensor]:
    model = nn.Sequential(Stem(c), *[ConvCell(c) for _ in range(cells)], Head(c))
    return model, torch.randn(batch, 3, size, size)


class SavedBytes:
    """Live and peak bytes of tensors autograd saved for backward, each storage counted once."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.refs: dict[int, list[int]] = {}

    def pack(self, tensor: Tensor) -> Any:
        key = tensor.untyped_storage().data_ptr()
        entry = self.refs.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(tensor, self, key)

    def unpack(self, held: _Held) -> Tensor:
        return held.tensor

    def release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


class _Held:
    def __init__(self, tensor: Tensor, counter: SavedBytes, key: int) -> None:
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self) -> None:
        self.counter.release(self.key)


def kept_input_bytes(pipe: gp.GPipe) -> int:
    total = 0
    for stage in pipe.stages:
        for saved in stage._saved.values():
            total += sum(x.numel() * x.element_size() for x in saved.inputs if isinstance(x, Tensor))
    return total


def train_step(model: nn.Module, x: Tensor, counter: SavedBytes | None = None) -> int:
    if counter is None:
        out = model(x)
        out.float().pow(2).mean().backward()
        return 0
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = model(x)
        kept = kept_input_bytes(model) if isinstance(model, gp.GPipe) else 0
        peak_forward = counter.peak
        out.float().pow(2).mean().backward()
    return max(peak_forward + kept, counter.peak)


def measure(model: nn.Module, x: Tensor, repeats: int) -> tuple[list[float], int]:
    """Seconds of each of ``repeats`` training steps (after a warm one), and the peak bytes
    saved for backward."""
    train_step(model, x)  # warm-up
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        train_step(model, x)
        times.append(time.perf_counter() - start)
    counter = SavedBytes()
    peak = train_step(model, x, counter)
    return times, peak


# --tiny: the same stacks at test size (seconds)
TINY: dict[str, dict[str, int]] = {"transformer": {"layers": 2, "d": 16, "batch": 8, "seq": 4},
                                   "conv": {"cells": 2, "c": 4, "batch": 8, "size": 8}}


def run(repeats: int, quick: bool, tiny: bool = False) -> list[dict[str, Any]]:
    rows = []
    for name, factory in (("transformer", transformer_stack), ("conv", conv_stack)):
        torch.manual_seed(0)
        model, x = factory(**TINY[name]) if tiny else factory()
        plain_samples, plain_peak = measure(model, x, repeats)
        plain_time = statistics.median(plain_samples)
        rows.append({"model": name, "variant": "plain", "partitions": 0, "chunks": 1,
                     "checkpoint": "-", "seconds": plain_time, "samples": plain_samples,
                     "peak_saved_bytes": plain_peak, "time_ratio": 1.0})
        ks = (1, 2) if quick else (1, 2, 4)
        chunk_list = (1, 8) if quick else (1, 4, 8)
        for k in ks:
            balance = gp.balance_by_params(model, k) if k > 1 else [len(model)]
            for chunks in chunk_list:
                for checkpoint in ("never", "except_last", "always"):
                    pipe = gp.GPipe(model, list(balance), chunks=chunks, checkpoint=checkpoint)
                    samples, peak = measure(pipe, x, repeats)
                    seconds = statistics.median(samples)
                    rows.append({"model": name, "variant": "gpipe", "partitions": k,
                                 "chunks": chunks, "checkpoint": checkpoint, "seconds": seconds,
                                 "samples": samples, "peak_saved_bytes": peak,
                                 "time_ratio": seconds / plain_time})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="out/bench_overhead.json")
    parser.add_argument("--json", default="docs/reproduction/bench_overhead.json",
                        help="the rows with their provenance, where the pages cite them")
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument("--tiny", action="store_true", help="tiny models (seconds, for tests)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = run(args.repeats, args.quick, args.tiny)
    report = {"provenance": provenance(load_before), "config": vars(args), "rows": rows}
    print(f"{'model':<12}{'variant':<8}{'K':>3}{'M':>4} {'checkpoint':<12}{'s/step':>9}"
          f"{'x plain':>9}{'saved MB':>10}")
    for r in rows:
        print(f"{r['model']:<12}{r['variant']:<8}{r['partitions']:>3}{r['chunks']:>4} "
              f"{r['checkpoint']:<12}{r['seconds']:>9.4f}{r['time_ratio']:>9.3f}"
              f"{r['peak_saved_bytes'] / 2**20:>10.1f}")
    for name in ("transformer", "conv"):
        sel = {(r["partitions"], r["chunks"], r["checkpoint"]): r for r in rows
               if r["model"] == name and r["variant"] == "gpipe"}
        plain = next(r for r in rows if r["model"] == name and r["variant"] == "plain")
        overhead = sel[(1, 1, "never")]["seconds"] / plain["seconds"] - 1
        never8, always8 = sel[(2, 8, "never")], sel[(2, 8, "always")]
        print(f"{name}: runtime overhead at K=1 chunks=1 never: {overhead:+.1%}; K=2 chunks=8: "
              f"always saves {never8['peak_saved_bytes'] / always8['peak_saved_bytes']:.2f}x "
              f"bytes for {always8['seconds'] / never8['seconds']:.2f}x time")
    out = Path(args.out)
    write_json(out, rows)
    write_json(args.json, report)
    print(f"wrote {out} and {args.json}")


if __name__ == "__main__":
    main()
