"""The two first commands, measured as a new user runs them: do they reach their goal in time?

    python scripts/reproduce_defaults.py --condition normal   # one after the other
    python scripts/reproduce_defaults.py --condition halved   # one after the other, each in a
                                                              # CPU cgroup of half the cores: a
                                                              # machine half as fast (root)
    python scripts/reproduce_defaults.py --condition slowed   # both at once (4 ranks and their
                                                              # loaders on 2 cores: slower than
                                                              # half as fast, 2-3x here)

runs ``make train-amoebanet`` and ``make train-nmt`` with their defaults (each into
``runs/<condition>/<app>``), samples the load average every 30 s while they run, and writes
``docs/reproduction/defaults_<condition>.json``: per app the budget it chose (apps/budget.py:
measured seconds per step, steps, epochs or tokens), its throughput, wall minutes (measured here,
around the whole ``make`` command), and the result against the README's promise: test top-1
>= 90% (AmoebaNet) and dev BLEU above copy-the-source in every resource bucket (NMT), all
within 30 minutes. ``--collect`` records runs already made into those folders instead (their
wall minutes then come from the runs' own summaries).

An informative outcome either way: the defaults fit their time by construction, so what this
measures is whether the quality they promise survives a slower machine (fewer steps of a
complete schedule), which a budget in steps or a clock alone cannot show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scripts.harness import ROOT, provenance

APPS = {"amoebanet": "train-amoebanet", "nmt": "train-nmt"}
LIMIT_MINUTES = 30.0
HOW = {
    "normal": "make train-amoebanet, then make train-nmt, each alone",
    "halved": "make train-amoebanet, then make train-nmt, each alone in a CPU cgroup whose "
              "quota is half the cores (a machine half as fast)",
    "slowed": "make train-amoebanet and make train-nmt at once, each with 2 ranks on the 2 cores",
}
TOP1_GOAL = 0.90


def sample_load(stop: threading.Event, samples: list[float], every_s: float = 30.0) -> None:
    while not stop.wait(every_s):
        samples.append(os.getloadavg()[0])


class HalfTheCores:
    """A CPU cgroup whose quota is half of the machine's cores (cgroup v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``, in 10 ms periods): everything started inside it (make, torchrun, the
    ranks, their loaders) shares that half, as on a machine with cores half as fast. Needs
    root; says so, and how to run without it, if the cgroup cannot be made.

    (Busy loops pinned beside the runs were the first way tried: a pipeline rank that waits
    for its peer gives its core to the loop and gets less than half back, so the runs went 3x
    slower, not 2x.)
    """

    PERIOD_US = 10_000

    def __init__(self, name: str = "gpipe_reproduce_defaults") -> None:
        cores = len(os.sched_getaffinity(0))
        quota = self.PERIOD_US * cores // 2
        v2, v1 = Path("/sys/fs/cgroup") / name, Path("/sys/fs/cgroup/cpu") / name
        try:
            if Path("/sys/fs/cgroup/cgroup.controllers").exists():
                v2.mkdir(exist_ok=True)
                (v2 / "cpu.max").write_text(f"{quota} {self.PERIOD_US}\n")
                self.path = v2
            else:
                v1.mkdir(exist_ok=True)
                (v1 / "cpu.cfs_period_us").write_text(f"{self.PERIOD_US}\n")
                (v1 / "cpu.cfs_quota_us").write_text(f"{quota}\n")
                self.path = v1
        except OSError as exn:
            raise SystemExit(f"error: --condition halved needs a CPU cgroup it can write "
                             f"(root, cgroup v1 or v2 with the cpu controller): {exn}; run "
                             f"--condition slowed instead, or as root") from exn
        self.quota = f"{quota} us per {self.PERIOD_US} us ({cores} cores)"

    def start(self, command: list[str], log: Path) -> subprocess.Popen[bytes]:
        # a shell joins the cgroup, then becomes the command: all it starts inherits the quota
        joined = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"),
                  *command]
        return subprocess.Popen(joined, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def remove(self) -> None:
        """Remove the cgroup once everything in it has ended (the kernel refuses it before)."""
        try:
            self.path.rmdir()
        except OSError as exn:
            print(f"warning: could not remove the cgroup {self.path}: {exn}", file=sys.stderr)


def run_app(app: str, out_dir: Path, log: Path,
            half: HalfTheCores | None = None) -> subprocess.Popen[bytes]:
    command = ["make", "-s", APPS[app], f"ARGS=--out_dir={out_dir}"]
    if half is not None:
        return half.start(command, log)
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def result_of(app: str, out_dir: Path, wall_minutes: float | None) -> dict[str, Any]:
    path = ROOT / out_dir / "summary.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist: the run in {out_dir} did not finish; "
                         f"run it (without --collect), or pass the --condition/--tag it used")
    summary = json.loads(path.read_text())
    minutes = wall_minutes if wall_minutes is not None else summary["total_minutes"]
    record: dict[str, Any] = {
        "out_dir": str(out_dir),
        "wall_minutes": round(minutes, 2),
        "within_limit": minutes <= LIMIT_MINUTES,
        "budget": summary.get("budget"),
        "steps": summary["steps"],
        "stopped_by": summary["stopped_by"],
        "train_minutes": summary["train_minutes"],
        "total_minutes_in_run": summary["total_minutes"],
    }
    if app == "amoebanet":
        record.update(epochs=summary["epochs"], images_per_second=summary["images_per_second"],
                      top1=summary["top1"], top5=summary["top5"])
        record["goal"] = f"test top-1 >= {TOP1_GOAL:.0%} within {LIMIT_MINUTES:g} minutes"
        record["goal_met"] = bool(summary["top1"] >= TOP1_GOAL and record["within_limit"])
    else:
        record.update(tokens=summary["tokens"], tokens_per_second=summary["tokens_per_second"],
                      dev_loss=summary["dev_loss"], dev=summary["dev"])
        above = {b: v["bleu"] > v["copy_bleu"] for b, v in summary["dev"].items()}
        record["goal"] = (f"dev BLEU above copy-the-source in every bucket within "
                          f"{LIMIT_MINUTES:g} minutes")
        record["above_copy"] = above
        record["goal_met"] = bool(all(above.values()) and record["within_limit"])
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--condition", choices=["normal", "halved", "slowed"], required=True)
    parser.add_argument("--apps", nargs="+", choices=list(APPS), default=list(APPS))
    parser.add_argument("--collect", action="store_true",
                        help="record the runs already in runs/<condition>/ instead of running")
    parser.add_argument("--note", default="", help="how the runs were made, if collected")
    parser.add_argument("--tag", default="", help="written to defaults_<condition>[_<tag>].json, "
                        "runs in runs/<condition>[_<tag>]/")
    args = parser.parse_args()

    name = args.condition + (f"_{args.tag}" if args.tag else "")
    out_dirs = {app: Path("runs") / name / app for app in args.apps}
    load_before = os.getloadavg()
    samples: list[float] = []
    walls: dict[str, float | None] = {app: None for app in args.apps}
    half: HalfTheCores | None = None
    if not args.collect:
        stop = threading.Event()
        sampler = threading.Thread(target=sample_load, args=(stop, samples), daemon=True)
        sampler.start()
        logs = {app: ROOT / out_dirs[app].with_suffix(".log") for app in args.apps}
        for log in logs.values():
            log.parent.mkdir(parents=True, exist_ok=True)
        if args.condition == "slowed":  # both at once
            begin = time.monotonic()
            procs = {app: run_app(app, out_dirs[app], logs[app]) for app in args.apps}
            while any(walls[app] is None for app in procs):  # each one's own end
                for app, proc in procs.items():
                    if walls[app] is None and proc.poll() is not None:
                        if proc.returncode != 0:
                            raise SystemExit(f"error: make {APPS[app]} failed; see {logs[app]}")
                        walls[app] = (time.monotonic() - begin) / 60
                time.sleep(1.0)
        else:  # one after the other, each alone on the machine (or on half of its cores)
            half = HalfTheCores() if args.condition == "halved" else None
            try:
                for app in args.apps:
                    begin = time.monotonic()
                    if run_app(app, out_dirs[app], logs[app], half).wait() != 0:
                        raise SystemExit(f"error: make {APPS[app]} failed; see {logs[app]}")
                    walls[app] = (time.monotonic() - begin) / 60
            finally:
                if half is not None:
                    half.remove()
        stop.set()
    results = {app: result_of(app, out_dirs[app], walls[app]) for app in args.apps}
    record = {
        "command": "python scripts/reproduce_defaults.py " + " ".join(sys.argv[1:]),
        "condition": args.condition,
        "how": HOW[args.condition] + (f"; quota {half.quota}" if half is not None else ""),
        "note": args.note,
        "load_average_1min_while_running": (
            {"min": min(samples), "median": statistics.median(samples), "max": max(samples),
             "samples": len(samples)} if samples else None),
        "results": results,
        **provenance(load_before),
    }
    path = ROOT / "docs" / "reproduction" / f"defaults_{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    for app, result in results.items():
        print(f"{app}: goal {'met' if result['goal_met'] else 'MISSED'} ({result['goal']}); "
              f"{result['wall_minutes']} min, budget {result['budget']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
