"""CPU per training image of the AmoebaNet input pipeline: PNG + per-image PIL/timm (before)
against decoded .npy shards + batched torch augmentation (after), on the CPU default's config.

Each round measures both pipelines, in alternating order (old first in even rounds), on the
default config (``cpu_fashion_mnist.yaml``: batch 128, hflip, no crops, shuffle buffer 5,000)
with the data directory the only difference:

- ``in_process``: the loader alone with ``num_workers=0``, in this process: CPU time
  (``time.process_time``, all threads) and wall time over ``--batches`` batches after the
  first (the first fills the shuffle buffer and starts the stream: reported separately as
  ``first_batch_cpu_s``).
- ``default_workers``: the loader as the default runs it (``num_workers`` of the config, 1):
  CPU of this process plus its exited children (``RUSAGE_CHILDREN``: the worker is joined
  before reading it) from building the loader to the end of ``--batches`` + 1 batches, worker
  start-up included; and its wall-clock images/s.

- ``training`` (with ``--train-rounds R``): the default's own images/s, ``make
  train-amoebanet`` (2 ranks under torchrun) for ``--train-steps`` steps on each data
  directory, old and new alternating, ``images_per_second`` of its summary.json (training
  only: start-up and the final evaluation excluded).

The result is the median over rounds of each number, per pipeline, and the per-round ratios.
CPU time is robust to other load on the machine; wall-clock images/s is not (the cores may be
shared with other jobs: the load averages are in the provenance). Writes the rounds, medians
and ``scripts.harness.provenance`` to ``--json`` (default
docs/reproduction/amoebanet_input.json).

    python scripts/bench_amoebanet_input.py [--rounds 7] [--batches 100]
        [--png-dir .cache/fashion_mnist_png] [--npy-dir .cache/fashion_mnist_npy]
        [--runs old=DIR ... new=DIR ...] [--train-rounds 0 --train-steps 60] [--draft]
        [--tiny]

Missing data directories are prepared (``python -m data.fashion_mnist.prepare
--image-format png|npy``). ``--runs`` adds finished training runs (their summary.json and
eval_test.json: steps, images/s, test top-1) under ``training_runs``, labelled old/new.
``--tiny`` measures synthetic 28x28 shards (for tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apps.amoebanet.config import AmoebaNetConfig, load_train_config
from apps.amoebanet.data import build_train_loader
from data.image_shards import Sample, encode_npy, encode_png, write_dataset_json, write_split
from scripts.harness import PUBLISHED, add_draft_argument, provenance, set_draft, write_json

PIPELINES = ("old", "new")  # PNG + PIL/timm per image; decoded .npy + BatchTransform


def _children_cpu_s() -> float:
    self_usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (self_usage.ru_utime + self_usage.ru_stime + children.ru_utime + children.ru_stime)


def measure_in_process(config: AmoebaNetConfig, batches: int, epoch: int) -> dict[str, float]:
    """The loader alone, ``num_workers=0``: CPU and wall per image after the first batch."""
    config = dataclasses.replace(config, num_workers=0)
    start_cpu = time.process_time()
    stream = iter(build_train_loader(config, epoch=epoch))
    next(stream)  # fills the shuffle buffer
    first_cpu = time.process_time() - start_cpu
    images = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        inputs, _targets = next(stream)
        images += inputs.shape[0]
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_ms_per_image": 1e3 * cpu / images, "images_per_second": images / wall,
            "images": images, "first_batch_cpu_s": first_cpu}


def measure_default_workers(config: AmoebaNetConfig, batches: int, epoch: int
                            ) -> dict[str, float]:
    """The loader with the config's workers: this process' and its workers' CPU per image."""
    cpu0, wall0 = _children_cpu_s(), time.perf_counter()
    loader = build_train_loader(config, epoch=epoch)
    stream = iter(loader)
    images = 0
    for _ in range(batches + 1):
        inputs, _targets = next(stream)
        images += inputs.shape[0]
    wall = time.perf_counter() - wall0
    stream._shutdown_workers()  # type: ignore[attr-defined]  # joins them: RUSAGE_CHILDREN counts
    del stream, loader
    cpu = _children_cpu_s() - cpu0
    return {"cpu_ms_per_image": 1e3 * cpu / images, "images_per_second": images / wall,
            "images": images, "num_workers": config.num_workers}


def measure_training(data_dir: Path, steps: int, out_dir: Path) -> dict[str, Any]:
    """The default config trained for ``steps`` on 2 ranks; its summary's images/s."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               "127.0.0.1:0", "-m", "apps.amoebanet.train", f"--data_dir={data_dir}",
               f"--out_dir={out_dir}", f"--train_steps={steps}", "--wandb_mode=disabled"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): "
                           f"{result.stderr[-2000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"images_per_second": summary["images_per_second"], "steps": summary["steps"],
            "train_minutes": summary["train_minutes"]}


def tiny_data(root: Path) -> dict[str, Path]:
    """Synthetic 28x28 grayscale shards, the same pixels as PNG and as .npy."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (600, 28, 28), dtype=np.uint8)
    dirs = {}
    for name, encode, ext in (("old", encode_png, "png"), ("new", encode_npy, "npy")):
        out = root / name
        samples = [Sample(f"train_{i:05d}", encode(image), ext, i % 10)
                   for i, image in enumerate(pixels)]
        split = write_split(samples, out, "train", num_classes=10, max_per_shard=200)
        write_dataset_json(out, name="tiny", classes=[str(c) for c in range(10)], image_mode="L",
                           splits={"train": split})
        dirs[name] = out
    return dirs


def prepared(data_dir: str, image_format: str) -> Path:
    from data.fashion_mnist.prepare import prepare

    path = Path(data_dir)
    info_path = path / "dataset.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if info.get("image_format", "png" if info else None) != image_format:
        prepare(path, image_format=image_format)
    return path


def read_runs(specs: list[str]) -> list[dict[str, Any]]:
    """``old=DIR`` / ``new=DIR``: a finished run's steps, images/s and test top-1."""
    runs = []
    for spec in specs:
        label, _, directory = spec.partition("=")
        if label not in PIPELINES or not directory:
            raise SystemExit(f"--runs {spec!r}: expected old=DIR or new=DIR")
        summary = json.loads((Path(directory) / "summary.json").read_text())
        final = json.loads((Path(directory) / "eval_test.json").read_text())
        config = (Path(directory) / "config.yaml")
        runs.append({"pipeline": label, "dir": directory, "steps": summary.get("steps"),
                     "seed": _yaml_value(config, "seed"),
                     "images_per_second": summary.get("images_per_second"),
                     "test_top1": final.get("top1"), "test_images": final.get("images")})
    return runs


def _yaml_value(path: Path, key: str) -> str | None:
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        if line.startswith(f"{key}:"):
            return line.split(":", 1)[1].split("#")[0].strip()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7,
                        help="paired rounds of loader measurements (0 = none: only --runs or "
                             "--train-rounds)")
    parser.add_argument("--batches", type=int, default=100, help="timed batches per measurement")
    parser.add_argument("--png-dir", default=".cache/fashion_mnist_png")
    parser.add_argument("--npy-dir", default=".cache/fashion_mnist_npy")
    parser.add_argument("--runs", nargs="*", default=[], help="old=DIR / new=DIR finished runs")
    parser.add_argument("--runs-note", default="",
                        help="how the --runs were made (command, commit): kept in the JSON")
    parser.add_argument("--json", default=str(PUBLISHED / "amoebanet_input.json"))
    parser.add_argument("--train-rounds", type=int, default=0,
                        help="paired rounds of short default training runs (0 = none)")
    parser.add_argument("--train-steps", type=int, default=60, help="steps per training run")
    parser.add_argument("--tiny", action="store_true", help="synthetic shards (for tests)")
    add_draft_argument(parser)
    args = parser.parse_args(argv)
    set_draft(args.draft)
    torch.set_num_threads(1)  # as each training rank and loader worker runs
    load_before = os.getloadavg()

    base = load_train_config([])
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            dirs = tiny_data(Path(tmp))
            base = dataclasses.replace(base, shuffle_buffer=256)
        else:
            dirs = {"old": prepared(args.png_dir, "png"), "new": prepared(args.npy_dir, "npy")}
        configs = {name: dataclasses.replace(base, dataset="shards", data_dir=str(path))
                   for name, path in dirs.items()}
        rounds = []
        for index in range(args.rounds):
            order = PIPELINES if index % 2 == 0 else PIPELINES[::-1]
            record: dict[str, Any] = {"order": list(order)}
            for name in order:
                record[name] = {
                    "in_process": measure_in_process(configs[name], args.batches, epoch=index),
                    "default_workers": measure_default_workers(configs[name], args.batches,
                                                               epoch=index),
                }
            rounds.append(record)
            print(f"round {index}: " + ", ".join(
                f"{name} {record[name]['in_process']['cpu_ms_per_image']:.3f} ms/image "
                f"({record[name]['default_workers']['cpu_ms_per_image']:.3f} with workers)"
                for name in PIPELINES), flush=True)
        training = []
        for index in range(args.train_rounds):
            order = PIPELINES if index % 2 == 0 else PIPELINES[::-1]
            record = {"order": list(order)}
            for name in order:
                record[name] = measure_training(dirs[name], args.train_steps,
                                                Path(tmp) / f"run-{index}-{name}")
            training.append(record)
            print(f"training round {index}: " + ", ".join(
                f"{name} {record[name]['images_per_second']:.1f} images/s" for name in PIPELINES),
                flush=True)

    def median(name: str, mode: str, key: str) -> float:
        return statistics.median(r[name][mode][key] for r in rounds)

    medians = {name: {mode: {key: median(name, mode, key) if rounds else None
                             for key in ("cpu_ms_per_image", "images_per_second")}
                      for mode in ("in_process", "default_workers")} for name in PIPELINES}
    ratios = [r["old"]["in_process"]["cpu_ms_per_image"] / r["new"]["in_process"]
              ["cpu_ms_per_image"] for r in rounds]
    result = {
        "what": "CPU per training image of the AmoebaNet input pipeline on the CPU default "
                "(cpu_fashion_mnist.yaml): old = PNG shards, per-image PIL decode + timm "
                "transforms; new = decoded .npy shards, BatchTransform on whole batches",
        "command": "python scripts/bench_amoebanet_input.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "data": {name: str(path) for name, path in dirs.items()} if not args.tiny else "tiny",
        "config": {"batch_size": base.batch_size, "num_workers": base.num_workers,
                   "shuffle_buffer": base.shuffle_buffer, "hflip": base.hflip,
                   "crop_scale_min": base.crop_scale_min, "color_jitter": base.color_jitter,
                   "mixup": base.mixup, "image_size": base.image_size},
        "rounds_count": args.rounds,
        "batches_per_measurement": args.batches,
        "target_cpu_ms_per_image": 0.3,
        "median": medians,
        "median_cpu_ratio_old_over_new": statistics.median(ratios) if ratios else None,
        "note": "CPU time (process time; with workers: RUSAGE_SELF + RUSAGE_CHILDREN after the "
                "worker is joined) does not depend on other load; wall-clock images/s does, and "
                "the cores were shared with other engineers' jobs (load averages in "
                "provenance): old and new alternate within each round",
        "training": {
            "steps_per_run": args.train_steps,
            "median_images_per_second": {
                name: statistics.median(r[name]["images_per_second"] for r in training)
                for name in PIPELINES} if training else None,
            "median_ratio_new_over_old": statistics.median(
                r["new"]["images_per_second"] / r["old"]["images_per_second"]
                for r in training) if training else None,
            "rounds": training,
        },
        "training_runs": read_runs(args.runs),
        "training_runs_note": args.runs_note,
        "rounds": rounds,
        "provenance": provenance(load_before),
    }
    path = write_json(args.json, result)
    for name in PIPELINES if rounds else ():
        print(f"{name}: {medians[name]['in_process']['cpu_ms_per_image']:.3f} ms CPU/image "
              f"(loader alone), {medians[name]['default_workers']['cpu_ms_per_image']:.3f} with "
              f"its worker; {medians[name]['default_workers']['images_per_second']:.0f} images/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
