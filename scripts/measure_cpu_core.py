"""The constants of ``apps.planning.CPU_CORE``, measured on this machine with one thread.

``gp.plan`` prices a layer on a device as ``ops * op_overhead + flops / (peak_flops *
achievable) + traffic / memory_bandwidth`` (``gpipe_core/devices.py``). The apps plan their
CPU runs on one core of this machine, so the three rates come from micro-benchmarks here, none
from the apps' own steps (which stay the out-of-sample check: ``scripts/selective_remat_apps.py``
sets the predicted step against the measured):

- *matmul*: ``torch.mm`` of fp32 squares (256, 512), FLOP/s; ``peak_flops`` is twice the
  median, so that ``achievable`` = 0.5 gives the measured rate on large work;
- *tiny operator*: ``torch.add`` of one-element tensors, seconds per call (``op_overhead``);
- *element-wise*: forward and backward of layers whose work the FLOP count leaves out (ReLU,
  BatchNorm2d in training, LayerNorm, 3x3 max and average pooling, GELU, an addition of two
  inputs) at activations of 1, 4 and 16 MB; each layer's bytes are what
  ``gp.layer_costs`` counts as its traffic (``forward_traffic_bytes``, ``backward_traffic_bytes``),
  so bytes / measured seconds is the bandwidth the planner's count needs; ``memory_bandwidth``
  is the median over layers, sizes and directions (the spread is in the JSON).

Every timing is the median of ``--repeats`` runs after a warm-up, with one thread.

    python scripts/measure_cpu_core.py           # ~1 min, writes docs/reproduction/cpu_core.json
    python scripts/measure_cpu_core.py --quick --out /tmp/cpu_core.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gpipe_core as gp
from scripts.harness import add_draft_argument, provenance, set_draft, write_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reproduction" / "cpu_core.json"
MB = 2**20


def median_seconds(fn: Callable[[], Any], repeats: int, calls: int = 1) -> float:
    """Median seconds of one of ``calls`` back-to-back calls of ``fn`` over ``repeats`` runs."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def matmul_flops(sizes: list[int], repeats: int) -> dict[int, float]:
    rates = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        rates[n] = 2 * n**3 / median_seconds(lambda a=a, b=b: torch.mm(a, b), repeats)
    return rates


def tiny_op_seconds(repeats: int) -> float:
    a, b = torch.ones(1), torch.ones(1)
    return median_seconds(lambda: torch.add(a, b), repeats, calls=1000)


class _Add(nn.Module):
    """A residual addition: two inputs in, one out (an AmoebaNet cell's combine)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.flip(0)


def _layers(channels: int) -> dict[str, Callable[[], nn.Module]]:
    return {
        "relu": nn.ReLU,
        "batchnorm2d": lambda: nn.BatchNorm2d(channels),
        "layernorm": lambda: nn.LayerNorm(16),
        "maxpool3x3": lambda: nn.MaxPool2d(3, 1, 1),
        "avgpool3x3": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
        "gelu": nn.GELU,
        "add": _Add,
    }


def elementwise(sizes_mb: list[float], repeats: int) -> list[dict[str, Any]]:
    """Counted traffic over measured seconds, forward and backward, per layer and size."""
    channels, width = 32, 16
    rows = []
    for size in sizes_mb:
        batch = max(2, round(size * MB / (4 * channels * width * width)))
        for name, make in _layers(channels).items():
            layer = make()
            x = torch.randn(batch, channels, width, width)
            counted = gp.layer_costs(nn.Sequential(layer), x)
            x.requires_grad_(True)
            forward = median_seconds(lambda layer=layer, x=x: layer(x), repeats)
            y = layer(x)
            grad = torch.randn_like(y)

            def backward(y: torch.Tensor = y, grad: torch.Tensor = grad,
                         x: torch.Tensor = x) -> None:
                torch.autograd.grad(y, x, grad, retain_graph=True)

            backward_s = median_seconds(backward, repeats)
            for direction, seconds, traffic in (
                    ("forward", forward, counted.forward_traffic_bytes[0]
                     + counted.forward_traffic_fixed_bytes[0]),
                    ("backward", backward_s, counted.backward_traffic_bytes[0]
                     + counted.backward_traffic_fixed_bytes[0])):
                rows.append({"layer": name, "activation_mb": x.numel() * 4 / MB,
                             "direction": direction, "seconds": seconds,
                             "traffic_bytes": traffic, "bytes_per_s": traffic / seconds})
    return rows


def measure(quick: bool, repeats: int) -> dict[str, Any]:
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    started = time.monotonic()
    matmul = matmul_flops([64, 128] if quick else [256, 512], repeats)
    tiny = tiny_op_seconds(repeats)
    rows = elementwise([0.25] if quick else [1, 4, 16], repeats)
    bandwidth = statistics.median(r["bytes_per_s"] for r in rows)
    rates = sorted(r["bytes_per_s"] for r in rows)
    return {
        "command": "python scripts/measure_cpu_core.py" + (" --quick" if quick else ""),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "matmul_flops_per_s": {str(n): r for n, r in matmul.items()},
        "tiny_op_seconds": tiny,
        "elementwise": rows,
        "elementwise_bytes_per_s": {"median": bandwidth, "min": rates[0], "max": rates[-1]},
        "constants": {"peak_flops": 2 * statistics.median(matmul.values()), "achievable": 0.5,
                      "op_overhead": tiny, "memory_bandwidth": bandwidth},
        "wall_seconds": time.monotonic() - started,
        "provenance": provenance(load_before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for the tests")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=OUT)
    add_draft_argument(parser)
    args = parser.parse_args()
    set_draft(args.draft)
    result = measure(args.quick, args.repeats)
    for r in result["elementwise"]:
        print(f"{r['layer']:<12}{r['activation_mb']:>7.2f} MB {r['direction']:<9}"
              f"{r['seconds'] * 1e3:>8.3f} ms {r['bytes_per_s'] / 1e9:>6.2f} GB/s")
    c = result["constants"]
    print(f"matmul {[f'{v / 1e9:.1f}' for v in result['matmul_flops_per_s'].values()]} GFLOP/s; "
          f"tiny op {c['op_overhead'] * 1e6:.2f} us; element-wise median "
          f"{c['memory_bandwidth'] / 1e9:.2f} GB/s")
    write_json(args.out, result)
    print(f"wrote {args.out} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
