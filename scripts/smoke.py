"""Both apps end to end on tiny configs, 2 pipeline ranks on CPU, real data, a few minutes.

    python scripts/smoke.py            # what `make smoke` runs

1. NMT: a two-language slice of the real Debian gettext corpus (its own cache folder), the tiny
   T(2, 64, 2) on 2 pipeline stages for 30 steps under torchrun, then test BLEU and chrF with
   beam search through ``python -m apps.nmt.evaluate``.
2. AmoebaNet: real Fashion-MNIST from Debian, a tiny AmoebaNet-D on 2 pipeline stages for 30
   steps under torchrun, then test top-1/top-5 through ``python -m apps.amoebanet.evaluate``.

Each stage is a real command line, exactly as a user would type it; the script stops at the
first failure and prints how long each stage took.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpipe_core.launch import torchrun_command

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "smoke"


def torchrun(module: str, *args: str) -> list[str]:
    return torchrun_command(module, args, nproc=2)


def run(title: str, command: list[str], timeout_s: float) -> None:
    print(f"\n=== {title}\n$ {' '.join(command)}", flush=True)
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    subprocess.run(command, cwd=REPO, env=env, check=True, timeout=timeout_s)
    print(f"=== {title}: ok in {time.monotonic() - start:.0f} s", flush=True)


def main() -> None:
    start = time.monotonic()
    shutil.rmtree(OUT, ignore_errors=True)  # a smoke run always starts from scratch
    nmt_out, amoeba_out = OUT / "nmt", OUT / "amoebanet"
    run("NMT: train 30 steps on 2 pipeline stages", torchrun(
        "apps.nmt.train", "--config=tiny", "--data_dir=.cache/gettext_m2en_smoke",
        "--packages=quick", "--languages=fr,de", f"--out_dir={nmt_out}", "--max_steps=30",
        "--max_positions=512",  # dev/test sentences are not length-filtered
        "--wandb_mode=disabled", "--eval_every=0", "--ckpt_every=0", "--eval_max_sentences=20",
    ), timeout_s=900)
    run("NMT: test BLEU", [sys.executable, "-m", "apps.nmt.evaluate", f"--ckpt={nmt_out}",
                           "--split=test", "--max-per-lang=20"], timeout_s=300)
    run("AmoebaNet: train 30 steps on 2 pipeline stages", torchrun(
        "apps.amoebanet.train", "--config=apps/amoebanet/configs/cpu_fashion_mnist.yaml",
        "--num_normal_cells=3", "--filters=8", "--batch_size=32", "--chunks=2",
        f"--out_dir={amoeba_out}", "--stop_at_step=30", "--wandb_mode=disabled",
    ), timeout_s=900)
    run("AmoebaNet: test top-1", [sys.executable, "-m", "apps.amoebanet.evaluate",
                                  f"--ckpt={amoeba_out}", "--split=test"], timeout_s=300)
    print(f"\nsmoke: both apps end to end in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
