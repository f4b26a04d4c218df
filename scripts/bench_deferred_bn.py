"""What micro-batch BatchNorm costs: the AmoebaNet default's training step with
``DeferredBatchNorm`` (GPipe's rule: each micro-batch normalized by its own statistics, the
running statistics those of the whole mini-batch) against the same model with plain
``nn.BatchNorm2d``, on one CPU thread, in alternating rounds.

Each round times ``--steps`` forward + backward passes of one micro-batch (the default batch
over ``--chunks``) of each model, one after the other (the order alternates by round); the
report is the median seconds per pass of each and the median of the per-round ratios,
deferred / plain, with the rounds the deferred one was within 5% of the plain one. Both models
have the same weights and see the same images.

    python scripts/bench_deferred_bn.py [--rounds 9] [--steps 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gpipe_core as gp  # noqa: E402
from apps.amoebanet.config import load_train_config  # noqa: E402
from apps.amoebanet.plan import app_model  # noqa: E402
from scripts.harness import provenance, write_json  # noqa: E402

OUT = ROOT / "docs" / "reproduction" / "deferred_bn.json"


def _seconds(model: torch.nn.Module, images: torch.Tensor,
             loss_fn: Callable[[torch.Tensor], torch.Tensor], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        loss_fn(model(images)).backward()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10, help="timed passes per model per round")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--config", default=None, help="an AmoebaNet config (default: default)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    config = load_train_config([f"--config={args.config}"] if args.config else [])
    model = app_model(config)
    plain = gp.materialize(model.build(model.depth), seed=0, device=torch.device("cpu"))
    deferred = gp.DeferredBatchNorm.convert(copy.deepcopy(plain))
    assert model.example is not None and model.loss is not None
    images = model.example(config.batch_size // args.chunks)
    models = {"plain": plain, "deferred": deferred}
    for m in models.values():  # warm-up
        _seconds(m, images, model.loss, 2)
    rounds = []
    for i in range(args.rounds):
        order = ["plain", "deferred"] if i % 2 == 0 else ["deferred", "plain"]
        seconds = {name: _seconds(models[name], images, model.loss, args.steps) for name in order}
        rounds.append(seconds)
    ratios = [r["deferred"] / r["plain"] for r in rounds]
    result = {
        "command": "python scripts/bench_deferred_bn.py " + " ".join(argv or sys.argv[1:]),
        "model": model.describe, "micro_batch": int(images.shape[0]), "threads": 1,
        "rounds": rounds,
        "median_s": {name: statistics.median(r[name] for r in rounds) for name in models},
        "median_ratio_deferred_over_plain": statistics.median(ratios),
        "rounds_within_5_percent": sum(r <= 1.05 for r in ratios),
        "provenance": provenance(load_before),
    }
    print(f"{model.describe}, micro-batch {images.shape[0]}, 1 thread: forward + backward "
          f"plain {1e3 * result['median_s']['plain']:.1f} ms, deferred "
          f"{1e3 * result['median_s']['deferred']:.1f} ms; deferred / plain "
          f"{result['median_ratio_deferred_over_plain']:.3f} (median of {len(ratios)} rounds, "
          f"{result['rounds_within_5_percent']} within 5%)")
    print(f"wrote {write_json(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
