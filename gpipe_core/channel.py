"""Point-to-point messages between a pipeline's stages outside ``step()``: send, post, wait.

A :class:`Channel` carries tensors of sizes both sides know between this rank's stage and any
other stage of a pipeline, with the pipeline's backend policy (gloo: tagged messages, its I/O
thread kept quiet; NCCL: in-order matching, tags ignored), its timeout and its failure naming::

    channel = pipe.channel("pipelined decoding")
    channel.send(tensor, stage=1, tag=7)             # asynchronous; the buffer is kept alive
    posted = channel.post(buffer, stage=0, tag=7)    # a receive, posted as soon as its size
    ...                                              # is known (gloo writes into it then)
    tensor = channel.wait(posted)                    # at most the pipeline's timeout_s
    channel.finish()                                 # every send has left

Tags are the caller's (``0 <= tag``); they are offset above the tags of the pipeline's own
transport (:mod:`gpipe_core.transport`), so they never match a step's messages. A neighbour that
stops answering, closes its connection or raised turns every call into
:class:`~gpipe_core.failure.PipelineFailure` naming this rank and stage, the peer, and the run's
first recorded failure (:func:`~gpipe_core.failure.peer_failure`): nothing hangs.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from .failure import peer_failure
from .transport import P2PPolicy

__all__ = ["Channel", "Posted", "TAG_OFFSET"]

TAG_OFFSET = 1 << 10  # above the transport's tags (control 0, stage boundaries 1 + s)


class Posted:
    """A receive posted with :meth:`Channel.post`; :meth:`Channel.wait` returns its buffer."""

    __slots__ = ("work", "buffer", "stage")

    def __init__(self, work: Any, buffer: Tensor, stage: int) -> None:
        self.work, self.buffer, self.stage = work, buffer, stage


class Channel:
    """Messages between this rank's ``stage`` and the other stages of one pipeline.

    ``stage_ranks[s]``: the global rank of stage s; ``policy``: the backend's
    :class:`~gpipe_core.transport.P2PPolicy`; ``timeout_s``: how long a wait lasts before the
    peer is declared failed; ``what``: the work, for error messages (``"rank 0 (stage 0) in
    pipelined decoding stops: ..."``). ``DistributedGPipe.channel(what)`` builds one with the
    pipeline's own.
    """

    def __init__(self, stage: int, stage_ranks: Sequence[int], *, policy: P2PPolicy,
                 timeout_s: float, what: str = "messages outside steps") -> None:
        self.stage = stage
        self.stage_ranks = list(stage_ranks)
        self.policy = policy
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.where = f"rank {self.stage_ranks[stage]} (stage {stage}) in {what}"
        self._sends: list[Posted] = []  # in flight; each buffer kept alive until it has left

    def refresh(self) -> None:
        """Call before a burst of messages (gloo: finds the process's I/O threads anew)."""
        self.policy.refresh()

    def send(self, tensor: Tensor, stage: int, tag: int) -> None:
        """Send ``tensor`` (contiguous) to ``stage``; returns at once (:meth:`finish` waits)."""
        try:
            work = self.policy.call(dist.isend, tensor, self.stage_ranks[stage],
                                    TAG_OFFSET + tag)
        except RuntimeError as exc:
            raise peer_failure(self.where, exc, self.timeout_s) from exc
        still = []
        for sent in self._sends:  # free the buffers of sends that have left
            if sent.work.is_completed():
                self._wait_sent(sent)
            else:
                still.append(sent)
        self._sends = [*still, Posted(work, tensor, stage)]

    def post(self, buffer: Tensor, stage: int, tag: int) -> Posted:
        """Post the receive into ``buffer`` (the message's exact size) of ``stage``'s message
        ``tag``; :meth:`wait` takes it."""
        try:
            work = self.policy.call(dist.irecv, buffer, self.stage_ranks[stage], TAG_OFFSET + tag)
        except RuntimeError as exc:
            raise peer_failure(self.where, exc, self.timeout_s) from exc
        return Posted(work, buffer, stage)

    def wait(self, posted: Posted) -> Tensor:
        """The posted receive's buffer once the message is in (at most ``timeout_s``)."""
        self._wait(posted, "waiting for")
        return posted.buffer

    def recv(self, buffer: Tensor, stage: int, tag: int) -> Tensor:
        """:meth:`post` and :meth:`wait` at once."""
        return self.wait(self.post(buffer, stage, tag))

    def finish(self) -> None:
        """Wait until every message sent has left."""
        sends, self._sends = self._sends, []
        for sent in sends:
            self._wait_sent(sent)

    def _wait_sent(self, sent: Posted) -> None:
        self._wait(sent, "sending to")

    def _wait(self, posted: Posted, doing: str) -> None:
        """Wait for one message (at most ``timeout_s``), naming the peer if it does not come."""
        try:
            posted.work.wait(self.timeout)
        except RuntimeError as exc:
            raise peer_failure(f"{self.where}, {doing} stage {posted.stage},", exc,
                               self.timeout_s) from exc
