"""The bytes on the wire: every ``isend`` / ``irecv`` that a fixed set of pipelines makes, in
order, per rank (peer, tag, dtype, element count), equals a reference recorded with the code
before point-to-point messages went through one :class:`~gpipe_core.Channel` (issue 41); the
buffers themselves come from :mod:`gpipe_core.wire`, which that change left alone (their
alignment padding is uninitialized memory, so their hashes vary from run to run). It covers a step's activations and gradients with
sizes that change (RESIZE messages), evaluation, tied weights (their first copy and the
gradient exchange), virtual stages and ``pipe.channel()``'s tagged messages.

Regenerate the reference (only for a deliberate change of the wire)::

    .venv/bin/python -m tests.distributed.test_channel_wire
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gpipe_core as gp
from gpipe_core import transport as transport_module
from tests.distributed.launch import spawn
from tests.distributed.test_pipeline import build, build_tied, loss_fn, loss_fn_tied, make_batch

pytestmark = pytest.mark.distributed

REFERENCE = Path(__file__).with_name("data") / "channel_wire_reference.json"
Record = list[list[Any]]  # [op ("isend" / "irecv"), peer rank, tag, dtype, numel]


def _record_calls() -> Record:
    """Wrap the gloo policy's one entry point for ``dist.isend`` / ``dist.irecv``."""
    calls: Record = []
    original = transport_module.GlooPolicy.call

    def call(self: Any, op: Any, tensor: torch.Tensor, rank: int, tag: int) -> Any:
        calls.append([op.__name__, rank, tag, str(tensor.dtype), tensor.numel()])
        return original(self, op, tensor, rank, tag)

    transport_module.GlooPolicy.call = call  # type: ignore[method-assign]
    return calls


def run_pipelines(rank: int, world: int) -> dict[str, Record]:
    calls = _record_calls()
    recorded: dict[str, Record] = {}

    # activations with a sequence length that changes, gradients, evaluation, pipe.channel()
    torch.manual_seed(0)
    pipe = gp.DistributedGPipe(build(), [4, 4], chunks=3, loss_fn=loss_fn, schedule="1f1b")
    for step in range(2):
        (x, mask), y = make_batch(step)
        pipe.step((x, mask), y)
    pipe.evaluate(*make_batch(2))
    channel = pipe.channel("the wire test")
    other = 1 - pipe.stage_index
    channel.send(torch.arange(5, dtype=torch.long) + rank, other, tag=3)
    channel.recv(torch.empty(5, dtype=torch.long), other, tag=3)
    channel.finish()
    recorded["1f1b"], calls[:] = list(calls), []

    # tied weights: the first copy at construction, the gradients after each step
    for name, schedule, balance in (("tied", "1f1b", [2, 3]),
                                    ("tied virtual", "interleaved_1f1b", [1, 1, 2, 1])):
        torch.manual_seed(0)
        pipe = gp.DistributedGPipe(build_tied(), balance, chunks=2, loss_fn=loss_fn_tied,
                                   tied=("0.weight", "4.weight"), schedule=schedule, seed=3)
        for step in range(2):
            x = torch.randn(6 + 2 * step, 4, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(step))
            pipe.step(x, x)
        recorded[name], calls[:] = list(calls), []
    return recorded


def record() -> list[dict[str, Record]]:
    return spawn(run_pipelines, 2, None, timeout_s=180)


def test_the_wire_is_the_recorded_one() -> None:
    reference = json.loads(REFERENCE.read_text())
    for rank, (now, then) in enumerate(zip(record(), reference["ranks"], strict=True)):
        assert sorted(now) == sorted(then)
        for name in then:
            assert now[name] == then[name], f"rank {rank}, {name}: other messages on the wire"


if __name__ == "__main__":
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    REFERENCE.parent.mkdir(exist_ok=True)
    ranks = [{name: "[\n" + ",\n".join(json.dumps(call) for call in calls) + "\n]"
              for name, calls in recorded.items()} for recorded in record()]
    text = ",\n".join("{" + ",\n".join(f"{json.dumps(name)}: {calls}"
                                        for name, calls in recorded.items()) + "}"
                      for recorded in ranks)  # one message a line: the diff of a change reads
    REFERENCE.write_text(f'{{"commit": "{commit}", "torch": "{torch.__version__}",\n'
                         f'"ranks": [\n{text}\n]}}\n')
    print(f"wrote {REFERENCE}", file=sys.stderr)
