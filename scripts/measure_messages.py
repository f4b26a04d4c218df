"""What one pipeline message costs on this machine: the CPU time of each end, and its wall time.

On a CPU host the pipeline's transport (gloo over the loopback interface) copies every message
through the kernel's socket buffers: the sending rank's core writes it, the receiving rank's
core reads it (gloo's I/O thread runs on the rank's own core, ``gp.bind_cpus``). That work is
taken from the stage's compute, so it is a cost of the ranks, not only of the link: a schedule
with more boundaries between ranks (interleaved stages) computes more per step than one with
fewer, although each stage's layers cost the same. ``gp.plan`` charges it through
``Device.message_overhead`` and ``Device.message_bandwidth`` (``gp.simulate``'s
``message_cpu``); this script measures them.

Two ranks as the pipelines run them (``scripts.harness.setup_process``: one core each, freed
memory kept mapped), messages through the runtime's own ``gpipe_core.channel.Channel`` with
gloo's policy (receives posted early, the I/O thread kept quiet in our calls):

- *stream*: one rank sends ``--messages`` fp32 messages of each size back to back, the other
  posts each receive as the previous one arrives; each rank's process CPU time (every thread:
  the caller's and gloo's I/O thread, user and system) per message, and the wall time per
  message; both directions, ``--rounds`` times;
- *ping-pong*: one message there and one back, the one-way wall time.

Fits, by least squares over the sizes (median over rounds and directions): each end's CPU
seconds per message = ``message_overhead + bytes / message_bandwidth`` (the mean of the sending
and the receiving end: the simulation charges each end alike), and the one-way ping-pong time
= ``latency + bytes / bandwidth``.

    python scripts/measure_messages.py          # ~1 min, writes docs/reproduction/cpu_messages.json
    python scripts/measure_messages.py --quick --out /tmp/cpu_messages.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpipe_core.channel import Channel, policy_for
from gpipe_core.launch import spawn
from scripts.harness import add_draft_argument, provenance, set_draft, setup_process, write_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reproduction" / "cpu_messages.json"
KIB = 2**10
SIZES_KIB = (32, 128, 512, 2048)  # the apps' boundaries carry 0.1-0.6 MiB per micro-batch


def _stream(channel: Channel, sender: int, size: int, messages: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of this rank per message, ``sender`` sending to the other."""
    me = dist.get_rank()
    other = 1 - me
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    if me == sender:
        payload = torch.ones(size // 4)
        for tag in range(messages):
            channel.send(payload, other, tag)
        channel.finish()
    else:
        buffers = [torch.empty(size // 4) for _ in range(2)]
        posted = channel.post(buffers[0], other, 0)
        for tag in range(messages):
            arrived = posted
            if tag + 1 < messages:  # the next receive is posted as this one is taken
                posted = channel.post(buffers[(tag + 1) % 2], other, tag + 1)
            channel.wait(arrived)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    dist.barrier()
    return cpu / messages, wall / messages


def _ping_pong(channel: Channel, size: int, exchanges: int) -> float:
    """One-way wall seconds of a message: rank 0 sends, rank 1 answers, ``exchanges`` times."""
    me = dist.get_rank()
    other = 1 - me
    payload, buffer = torch.ones(size // 4), torch.empty(size // 4)
    dist.barrier()
    start = time.perf_counter()
    for tag in range(exchanges):
        if me == 0:
            channel.send(payload, other, tag)
            channel.recv(buffer, other, tag)
        else:
            channel.recv(buffer, other, tag)
            channel.send(payload, other, tag)
    channel.finish()
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed / (2 * exchanges)


def _worker(rank: int, world_size: int, sizes: list[int], messages: int, rounds: int
            ) -> dict[str, Any]:
    torch.set_num_threads(1)
    channel = Channel(rank, [0, 1], policy=policy_for("gloo"), timeout_s=60.0,
                      what="measure_messages")
    channel.refresh()
    rows: dict[str, Any] = {}
    for size in sizes:
        _stream(channel, 0, size, 4)  # warm-up: connections, buffers
        stream = [(sender, *_stream(channel, sender, size, messages))
                  for _ in range(rounds) for sender in (0, 1)]
        rows[str(size)] = {
            "send_cpu_s": [cpu for sender, cpu, _ in stream if sender == rank],
            "receive_cpu_s": [cpu for sender, cpu, _ in stream if sender != rank],
            "stream_wall_s": [wall for _, _, wall in stream],
            "ping_pong_one_way_s": [_ping_pong(channel, size, max(4, messages // 4))
                                    for _ in range(rounds)],
        }
    return rows


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + x * b`` over ``(x, y)`` points: ``(a, b)``."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope


def measure(sizes_kib: list[int], messages: int, rounds: int, quick: bool) -> dict[str, Any]:
    load_before = os.getloadavg()
    started = time.monotonic()
    sizes = [k * KIB for k in sizes_kib]
    ranks = spawn(_worker, 2, None, sizes, messages, rounds, timeout_s=600.0,
                  setup=setup_process)
    rows = []
    for size in sizes:
        per_rank = [r[str(size)] for r in ranks]
        send = statistics.median(v for r in per_rank for v in r["send_cpu_s"])
        receive = statistics.median(v for r in per_rank for v in r["receive_cpu_s"])
        rows.append({
            "bytes": size, "send_cpu_s": send, "receive_cpu_s": receive,
            "end_cpu_s": (send + receive) / 2,
            "stream_wall_s": statistics.median(v for r in per_rank for v in r["stream_wall_s"]),
            "ping_pong_one_way_s": statistics.median(
                v for r in per_rank for v in r["ping_pong_one_way_s"]),
            "samples": per_rank})
    overhead, per_byte = fit_line([(r["bytes"], r["end_cpu_s"]) for r in rows])
    latency, link_per_byte = fit_line([(r["bytes"], r["ping_pong_one_way_s"]) for r in rows])
    if per_byte <= 0 or link_per_byte <= 0:
        raise RuntimeError(f"a larger message measured no more time than a smaller one (seconds "
                           f"per byte: CPU {per_byte:.3g}, one way {link_per_byte:.3g}); the "
                           "host was too noisy: run again with more --rounds")
    return {
        "command": "python scripts/measure_messages.py" + (" --quick" if quick else ""),
        "transport": "gloo over 127.0.0.1, gpipe_core.channel.Channel with gloo's policy; "
                     "2 ranks, one core each (scripts.harness.setup_process)",
        "messages": messages, "rounds": rounds,
        "rows": rows,
        "constants": {"message_overhead": max(overhead, 0.0),
                      "message_bandwidth": 1 / per_byte},
        "link_fit": {"latency_s": latency, "bandwidth_bytes_per_s": 1 / link_per_byte},
        "wall_seconds": time.monotonic() - started,
        "provenance": provenance(load_before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="two sizes, few messages (sizes far apart, 32 KiB and 4 MiB: the "
                             "larger's extra time, milliseconds, stands above a busy host's noise)")
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=OUT)
    add_draft_argument(parser)
    args = parser.parse_args()
    set_draft(args.draft)
    sizes = [32, 4096] if args.quick else list(SIZES_KIB)
    result = measure(sizes, 8 if args.quick else args.messages,
                     2 if args.quick else args.rounds, args.quick)
    for r in result["rows"]:
        print(f"{r['bytes'] / KIB:>7.0f} KiB: CPU per message send {r['send_cpu_s'] * 1e6:7.1f} "
              f"us, receive {r['receive_cpu_s'] * 1e6:7.1f} us; stream wall "
              f"{r['stream_wall_s'] * 1e6:7.1f} us; ping-pong one way "
              f"{r['ping_pong_one_way_s'] * 1e6:7.1f} us")
    c, link = result["constants"], result["link_fit"]
    print(f"each end: {c['message_overhead'] * 1e6:.1f} us + bytes / "
          f"{c['message_bandwidth'] / 1e9:.2f} GB/s; link (one way): "
          f"{link['latency_s'] * 1e6:.1f} us + bytes / "
          f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    write_json(args.out, result)
    print(f"wrote {args.out} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
