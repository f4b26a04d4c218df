"""Giving each local rank its own share of the CPU cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpipe_core.cpu import cpu_share


def test_equal_contiguous_shares() -> None:
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    shares = [cpu_share(cores, r, 4) for r in range(4)]
    assert shares == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_shares_are_disjoint_and_leftover_cores_unused() -> None:
    cores = [3, 1, 9, 5, 7]  # unsorted, 5 cores for 2 ranks: one core stays free
    shares = [cpu_share(cores, r, 2) for r in range(2)]
    assert shares == [[1, 3], [5, 7]]


def test_fewer_cores_than_ranks_round_robin() -> None:
    assert [cpu_share([0, 1], r, 3) for r in range(3)] == [[0], [1], [0]]


def test_bad_rank_is_named() -> None:
    with pytest.raises(ValueError, match="local_rank=2 must be in"):
        cpu_share([0, 1], 2, 2)
    with pytest.raises(ValueError, match="no CPU cores"):
        cpu_share([], 0, 1)


def run_in_child(code: str) -> str:
    """Run ``code`` in a fresh Python (process-wide settings stay out of the test runner)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_bind_cpus_pins_the_process_and_its_threads() -> None:
    # In a child process, so the test runner itself stays unpinned.
    code = (
        "import os, threading, torch, gpipe_core as gp\n"
        "cores = sorted(os.sched_getaffinity(0))\n"
        "share = gp.bind_cpus(local_rank=1, local_world_size=2)\n"
        "assert share == cores[len(cores) // 2 : 2 * (len(cores) // 2)] or len(cores) < 2, share\n"
        "assert sorted(os.sched_getaffinity(0)) == share\n"
        "assert torch.get_num_threads() == len(share)\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "assert seen == [share], seen\n"
        "print('ok')\n"
    )
    assert run_in_child(code) == "ok"


def test_hold_freed_memory_stops_fresh_page_faults() -> None:
    # In a child process: the setting is process-wide. glibc's thresholds start at 128 KiB
    # and then adapt to what the program frees, so the child pins them at that start first:
    # then 4 MiB blocks come from fresh mappings and fault in anew after every free (what
    # a step's activations did); once held, they are reused without a fault.
    code = (
        "import ctypes, ctypes.util, resource, sys, torch, gpipe_core as gp\n"
        "libc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
        "if not hasattr(libc, 'gnu_get_libc_version'):\n"
        "    print('not glibc'); sys.exit(0)\n"
        "libc.mallopt(-3, 128 << 10); libc.mallopt(-1, 128 << 10)  # mmap, trim thresholds\n"
        "def faults(rounds=10):\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(rounds):\n"
        "        blocks = [torch.ones(1 << 20) for _ in range(8)]\n"
        "        del blocks\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "faults(2)\n"
        "default = faults()\n"
        "assert gp.hold_freed_memory()\n"
        "faults(2)\n"
        "held = faults()\n"
        "assert default > 10 * 8 * 900 and held < default / 10, (default, held)\n"
        "print('ok')\n"
    )
    outcome = run_in_child(code)
    if outcome == "not glibc":
        pytest.skip("the C library is not glibc")
    assert outcome == "ok"


def test_hold_freed_memory_rejects_a_bad_threshold() -> None:
    import gpipe_core as gp

    with pytest.raises(ValueError, match="threshold_bytes=0 must be positive"):
        gp.hold_freed_memory(0)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")
def test_quiet_io_threads_finds_gloo_loop_and_toggles_its_policy() -> None:
    # gloo's I/O thread is named gloo_tcp_loop; if a torch upgrade renames it, this fails.
    code = (
        "import os, datetime, tempfile, torch.distributed as dist\n"
        "from gpipe_core.cpu import QuietIOThreads\n"
        "root = tempfile.mkdtemp()\n"
        "dist.init_process_group('gloo', init_method=f'file://{root}/rv', rank=0, world_size=1,\n"
        "                        timeout=datetime.timedelta(seconds=30))\n"
        "import time\n"
        "quiet = QuietIOThreads()\n"
        "deadline = time.monotonic() + 10  # the thread names itself after it starts\n"
        "while not quiet.refresh() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "threads = quiet.refresh()\n"
        "assert threads, 'no gloo_tcp_loop thread found'\n"
        "assert os.getpid() not in threads\n"
        "policy = lambda: {os.sched_getscheduler(t) for t in threads}\n"
        "assert policy() == {os.SCHED_OTHER}\n"
        "quiet.enter()\n"
        "assert policy() == {os.SCHED_BATCH}\n"
        "quiet.leave()\n"
        "assert policy() == {os.SCHED_OTHER}\n"
        "assert QuietIOThreads('no_such_thread').refresh() == []\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n"
    )
    assert run_in_child(code) == "ok"
