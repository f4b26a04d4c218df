"""The library's one point-to-point primitive between ranks: send, post, wait, finish.

A :class:`Channel` carries tensors of sizes both sides know between this rank's stage and any
other stage of a pipeline, with the backend's policy (gloo: tagged messages, its I/O thread
kept quiet; NCCL: in-order matching, tags ignored), a timeout and its failure naming::

    channel = pipe.channel("pipelined decoding")
    channel.send(tensor, stage=1, tag=7)             # asynchronous; the buffer is kept alive
    posted = channel.post(buffer, stage=0, tag=7)    # a receive, posted as soon as its size
    ...                                              # is known (gloo writes into it then)
    tensor = channel.wait(posted)                    # at most the pipeline's timeout_s
    channel.finish()                                 # every send has left

Everything that moves between ranks goes through a Channel: a step's activations and gradients
(:class:`~gpipe_core.transport.DistributedTransport` frames them, one Channel per neighbour),
the tied weight's copies and gradients (:mod:`gpipe_core.tied`), and work between steps
(``pipe.channel()``: pipelined decoding).

Tags (gloo) are one space per pipeline: ``TAG_CONTROL`` (0) for the tied weight,
``TAG_BOUNDARY + s`` for the boundary between stages s and s+1, and the tags of
``pipe.channel()``'s callers (``0 <= tag``), offset by ``TAG_OFFSET`` above those of the
pipeline's own messages so they never match a step's. A channel adds ``tag_base`` to every tag
it is given: ``TAG_OFFSET`` by default, 0 for the library's own channels.

A neighbour that stops answering, closes its connection or raised turns every call into
:class:`~gpipe_core.failure.PipelineFailure` naming this rank and stage, what it was doing, the
peer's rank and stage, and either the run's first recorded failure or the timeout
(:func:`~gpipe_core.failure.peer_failure`)::

    rank 0 (stage 0) in step 7, waiting for peer rank 1 (stage 1), stops: ... (no answer
    within 300 s or connection closed; that rank failed or hangs)

Nothing hangs: every wait lasts at most ``timeout_s``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from .cpu import QuietIOThreads
from .failure import PipelineFailure, peer_failure

__all__ = ["Channel", "Posted", "P2PPolicy", "GlooPolicy", "policy_for", "TAG_CONTROL",
           "TAG_BOUNDARY", "TAG_OFFSET"]

TAG_CONTROL = 0  # the tied weight's copy and gradients, between the first and the last stage
TAG_BOUNDARY = 1  # activations and gradients across the boundary of stages s, s+1: 1 + s
TAG_OFFSET = 1 << 10  # pipe.channel()'s tags: above every boundary's


class P2PPolicy:
    """How point-to-point messages behave on a backend; this base is NCCL's.

    NCCL ignores tags and matches messages in order, so a receive is posted when it is needed.
    """

    tags = False  # whether messages are matched by tag
    post_early = False  # post a link's next receive as soon as the current one arrives

    def refresh(self) -> None:
        """Called at the start of every step (the process's threads may have changed)."""

    def call(self, op: Callable[..., Any], tensor: Tensor, rank: int, tag: int) -> Any:
        """Run ``dist.isend`` or ``dist.irecv``."""
        return op(tensor, rank, tag=0)


class GlooPolicy(P2PPolicy):
    """gloo: tagged messages, receives posted early, and an I/O thread kept quiet in our calls.

    gloo's I/O thread must not preempt our sends and posts (see
    :class:`~gpipe_core.cpu.QuietIOThreads`); ``quiet_io = None`` lets it.
    """

    tags = True
    post_early = True

    def __init__(self, quiet_io: bool = True) -> None:
        self.quiet_io: QuietIOThreads | None = QuietIOThreads() if quiet_io else None
        if self.quiet_io is not None:
            self.quiet_io.refresh()

    def refresh(self) -> None:
        if self.quiet_io is not None:
            self.quiet_io.refresh()

    def call(self, op: Callable[..., Any], tensor: Tensor, rank: int, tag: int) -> Any:
        quiet = self.quiet_io
        if quiet is None:
            return op(tensor, rank, tag=tag)
        quiet.enter()
        try:
            return op(tensor, rank, tag=tag)
        finally:
            quiet.leave()


def policy_for(backend: str, *, quiet_io: bool = True) -> P2PPolicy:
    """The policy of a ``torch.distributed`` backend: gloo's (``quiet_io``: keep its I/O thread
    from preempting our calls), or in-order matching (NCCL)."""
    return GlooPolicy(quiet_io) if backend == "gloo" else P2PPolicy()


class Posted:
    """A message in flight: a receive posted with :meth:`Channel.post` (:meth:`Channel.wait`
    returns its buffer), or a send whose buffer the channel keeps alive until it has left."""

    __slots__ = ("work", "buffer", "stage")

    def __init__(self, work: Any, buffer: Tensor, stage: int) -> None:
        self.work, self.buffer, self.stage = work, buffer, stage


class Channel:
    """Messages between this rank's ``stage`` and the other stages of one pipeline.

    ``stage_ranks[s]``: the global rank of stage s; ``policy``: the backend's
    :class:`P2PPolicy`; ``timeout_s``: how long a wait lasts before the peer is declared failed;
    ``what``: the work, for error messages (``"rank 0 (stage 0) in pipelined decoding, waiting
    for peer rank 1 (stage 1), stops: ..."``; the owner may change it, e.g. per step);
    ``tag_base``: added to every tag (see the module's docstring).
    ``DistributedGPipe.channel(what)`` builds one with the pipeline's own.
    """

    def __init__(self, stage: int, stage_ranks: Sequence[int], *, policy: P2PPolicy,
                 timeout_s: float, what: str = "messages outside steps",
                 tag_base: int = TAG_OFFSET) -> None:
        self.stage = stage
        self.stage_ranks = list(stage_ranks)
        self.policy = policy
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.what = what
        self.tag_base = tag_base
        self._sends: list[Posted] = []  # in flight; each buffer kept alive until it has left

    @property
    def where(self) -> str:
        """This end, for error messages: ``"rank 0 (stage 0) in pipelined decoding"``."""
        return f"rank {self.stage_ranks[self.stage]} (stage {self.stage}) in {self.what}"

    def refresh(self) -> None:
        """Call before a burst of messages (gloo: finds the process's I/O threads anew)."""
        self.policy.refresh()

    def send(self, tensor: Tensor, stage: int, tag: int) -> Posted:
        """Send ``tensor`` (contiguous) to ``stage``; returns at once (:meth:`finish` waits).

        Sends known to have left by now free their buffers (else a step would hold every
        message it sent until :meth:`finish`); one that failed raises here as it would there.
        A backend that learns of a send's end only by waiting for it (gloo) frees it at
        :meth:`release`, which the owner calls once the peer has surely taken the message."""
        try:
            work = self.policy.call(dist.isend, tensor, self.stage_ranks[stage],
                                    self.tag_base + tag)
        except RuntimeError as exc:
            raise self._failure("sending to", stage, exc) from exc
        still = []
        for sent in self._sends:
            if sent.work.is_completed():
                self._wait(sent, "sending to")
            else:
                still.append(sent)
        posted = Posted(work, tensor, stage)
        still.append(posted)
        self._sends = still
        return posted

    def release(self, sends: Sequence[Posted]) -> None:
        """Free these sends' buffers: the peer has taken them (a message it sent depends on
        them), so each wait returns at once (at most ``timeout_s``)."""
        done = {id(sent) for sent in sends}
        still = []
        for sent in self._sends:
            if id(sent) in done:
                self._wait(sent, "sending to")
            else:
                still.append(sent)
        self._sends = still

    def post(self, buffer: Tensor, stage: int, tag: int) -> Posted:
        """Post the receive into ``buffer`` (the message's exact size) of ``stage``'s message
        ``tag``; :meth:`wait` takes it."""
        try:
            work = self.policy.call(dist.irecv, buffer, self.stage_ranks[stage],
                                    self.tag_base + tag)
        except RuntimeError as exc:
            raise self._failure("posting a receive from", stage, exc) from exc
        return Posted(work, buffer, stage)

    def wait(self, posted: Posted) -> Tensor:
        """The posted receive's buffer once the message is in (at most ``timeout_s``)."""
        self._wait(posted, "waiting for")
        return posted.buffer

    def recv(self, buffer: Tensor, stage: int, tag: int) -> Tensor:
        """:meth:`post` and :meth:`wait` at once."""
        return self.wait(self.post(buffer, stage, tag))

    def finish(self) -> None:
        """Wait until every message sent has left (each at most ``timeout_s``)."""
        sends, self._sends = self._sends, []
        for sent in sends:
            self._wait(sent, "sending to")

    def _wait(self, posted: Posted, doing: str) -> None:
        """Wait for one message (at most ``timeout_s``), naming the peer if it does not come."""
        try:
            posted.work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._failure(doing, posted.stage, exc) from exc

    def _failure(self, doing: str, stage: int, exc: BaseException) -> PipelineFailure:
        peer = f"peer rank {self.stage_ranks[stage]} (stage {stage})"
        return peer_failure(f"{self.where}, {doing} {peer},", exc, self.timeout_s)
