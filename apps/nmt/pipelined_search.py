"""Greedy decoding and beam search through a ``DistributedGPipe`` of the NMT model, each rank
running only its own stage's layers, with a key/value cache per decoder layer on its stage, and
groups of sentences in flight so that all stages work at once.

Every rank of the pipeline calls :func:`pipelined_beam_search` with the same source batch. The
batch is split into G groups of consecutive sentences (``groups=``; default one per stage, at
most one per sentence), each with its own search state and caches; or
:func:`pipelined_search_batches` takes several batches, each its own group, ``in_flight`` at a
time. A group goes round a ring of the stages, one decoding step per round, and the groups
follow each other round it, so while stage s+1 computes group g, stage s computes group g+1::

    step t of group g:
      stage 0: embed the newest tokens, decoder layers (cache)
        --[rows, parents, tokens | decoder states]--> stage 1: reorder its caches by the
        parents, decoder layers --> ... --> stage K-1: decoder layers, project, log_softmax,
        the search's step --[rows, parents, tokens]--> stage 0: step t+1 of group g

    turns of G=2 groups (group.step) on K=2 stages:
      stage 0 | 0.0 1.0 0.1 1.1 0.2 1.2 ...
      stage 1 |     0.0 1.0 0.1 1.1 0.2 ...

Only the last stage holds the log-probabilities [rows, vocab]; it runs each group's search
(``apps.nmt.search.GreedySearch`` / ``BeamSearch``, the one-process code) and sends back just
its decisions, the surviving rows' parent rows and newest tokens, which then travel down the
stages with the decoder states (each stage reorders its caches by them, stage 0 embeds the
tokens). A group's first round also carries its encoder states down the stages. A finished
group is sent round once more as zero rows and leaves every stage's rotation at the same point
(its place goes to the next waiting batch). At the end the last stage sends the hypotheses to
every rank. Messages go over the pipe's point-to-point channel (``pipe.channel()``,
``gpipe_core.Channel``: one tag per group and kind), each receive posted as soon as its size is
known, every wait bounded by the pipe's ``timeout_s``: a stage that fails or hangs is named
(``gpipe_core.failure``), nothing hangs.

The layers and the search are the plain model's, so the hypotheses and scores equal the
one-process search on the same groups bit for bit: ``search_hypotheses(model, src_ids,
groups=G)`` (the tests check it; ``groups=1`` is ``beam_search`` on the whole batch). A
matrix product's last bits can depend on its number of rows (MKL's GEMM does, for fewer than 4
rows in float32 and for row counts not a multiple of 4 in float64), so a batch decoded in groups
may differ from the whole batch in the scores' last bits and, on a near tie, in a token.
``apps.nmt.decoding.translate`` (translate and evaluate under torchrun) therefore hands every
batch at once to :meth:`PipelineSearch.batches`, each batch its own group: the output is the
one-process output, and the stages overlap whenever there are several batches. The messages
are outside ``pipe.step``: call these between steps, on every rank of the pipeline group; they
run the pipe in eval mode (and restore it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

import gpipe_core as gp
from apps.nmt.model import DecoderLayer, Embed, EncoderLayer, LayerCache, Project
from apps.nmt.search import Hypothesis, Search, new_search, split_groups
from gpipe_core.channel import Posted
from gpipe_core.failure import PipelineFailure, report_failure

if TYPE_CHECKING:
    from apps.nmt.config import NMTConfig

__all__ = ["PipelineSearch", "default_groups", "default_in_flight", "pipeline_search",
           "pipelined_beam_search", "pipelined_search_batches", "pipelined_search_hypotheses"]

# Message kinds; a message's tag on the channel is 4 * group + kind, so messages of different
# groups can never be taken for each other.
_ENCODED, _DECODED, _DECIDED, _RESULT = range(4)


def _tag(group: int, kind: int) -> int:
    return 4 * group + kind


def default_groups(num_stages: int, batch_size: int) -> int:
    """Groups a batch is split into when none are given: one per stage (every stage busy), at
    most one per sentence. More groups hide more message latency but make smaller matrix
    products and more turns: at K=2, 2 groups were fastest (``make bench-decoding``)."""
    return max(1, min(num_stages, batch_size))


def default_in_flight(num_stages: int, num_batches: int) -> int:
    """Whole batches decoded at a time when none is given: two per stage (one on every stage
    and as many on their way; a batch is not made smaller by it), at most all of them."""
    return max(1, min(2 * num_stages, num_batches))


@dataclass
class _Group:
    """One group of sentences as one stage sees it."""

    index: int
    src_ids: Tensor  # [Bg, S], the batch's columns
    search: Search  # the same start on every rank; only the last stage advances it
    caches: list[LayerCache]  # this stage's decoder layers'
    rows: int  # rows of the step this stage computed last (before the first: of the first)
    step: int = 0  # decoding steps this stage has computed
    memory: Tensor | None = None  # [Bg, S, D] until the first step has filled the caches
    src_pad: Tensor | None = None  # [Bg, S], then per row [rows, S]
    decided: tuple[int, Tensor, Tensor] | None = None  # one stage only: the last decisions
    posted: Posted | None = None  # the receive of its next decoding message
    posted_memory: Posted | None = None  # the receive of its encoder states
    finished: bool = False  # the last stage: its search is done


class _StageDecoder:
    """This rank's stage in the decoding ring: its layers, its neighbours, the search's turns
    (its messages go over the pipe's ``gpipe_core.Channel``)."""

    def __init__(self, pipe: gp.DistributedGPipe, *, pad_id: int) -> None:
        layers = list(pipe)
        self.embed = next((layer for layer in layers if isinstance(layer, Embed)), None)
        self.encoders = [layer for layer in layers if isinstance(layer, EncoderLayer)]
        self.decoders = [layer for layer in layers if isinstance(layer, DecoderLayer)]
        self.project = next((layer for layer in layers if isinstance(layer, Project)), None)
        if pipe.is_first != (self.embed is not None) or pipe.is_last != (
                self.project is not None):
            raise TypeError("expected a pipeline of an apps.nmt transformer() model (embed on "
                            "the first stage, project on the last)")
        # the first decoder layer normalises the encoder's output: stages before it pass
        # enc_state on, stages from it on pass the memory
        self.first_decoder_here = bool(self.decoders) and (
            self.decoders[0].memory_norm is not None)
        self.pad_id = pad_id
        self.stage, self.num_stages = pipe.stage_index, pipe.num_stages
        self.is_first, self.is_last = pipe.is_first, pipe.is_last
        self.following = self.stage + 1 if not self.is_last else None
        last = self.num_stages - 1
        # whose messages this stage takes: the previous stage's, or (stage 0) the last one's
        self.source = (self.stage - 1 if self.stage > 0 else last) if last > 0 else None
        self.device = pipe.device
        self.dtype = next(pipe.parameters()).dtype
        self.width = _model_width(layers)
        self.channel = pipe.channel("pipelined decoding")
        self.no_memory = torch.empty(0, dtype=self.dtype, device=self.device)

    # -- messages (over the pipe's channel) ------------------------------------------------

    def _wait(self, posted: Posted | None) -> Tensor:
        assert posted is not None, "a message was taken before its receive was posted"
        return self.channel.wait(posted)

    # Decisions: int64 [1 + 2 * capacity]: rows, then the rows' parents and newest tokens,
    # padded to ``capacity`` (the rows of the step before, which both sides know). A decoding
    # message is the decisions' bytes followed by the rows' decoder states [capacity, 1, D].

    def _decoded_bytes(self, capacity: int) -> int:
        return 8 * (1 + 2 * capacity) + capacity * self.width * self.dtype.itemsize

    def _post_next(self, group: _Group) -> None:
        """Post the receive of ``group``'s next message to this stage, of the size it will
        have (decisions to stage 0, decoder states to the others)."""
        if self.source is None:
            return
        if self.is_first:
            buffer = torch.empty(1 + 2 * group.rows, dtype=torch.long, device=self.device)
            group.posted = self.channel.post(buffer, self.source, _tag(group.index, _DECIDED))
        else:
            buffer = torch.empty(self._decoded_bytes(group.rows), dtype=torch.uint8,
                                 device=self.device)
            group.posted = self.channel.post(buffer, self.source, _tag(group.index, _DECODED))

    @staticmethod
    def _decisions(rows: int, parent: Tensor | None, tokens: Tensor, capacity: int) -> Tensor:
        header = torch.zeros(1 + 2 * capacity, dtype=torch.long, device=tokens.device)
        header[0] = rows
        if parent is not None:
            header[1 : 1 + rows] = parent
        header[1 + capacity : 1 + capacity + rows] = tokens
        return header

    @staticmethod
    def _read_decisions(header: Tensor, capacity: int) -> tuple[int, Tensor, Tensor]:
        rows = int(header[0])
        return rows, header[1 : 1 + rows], header[1 + capacity : 1 + capacity + rows]

    # -- one group's turn ------------------------------------------------------------------

    def start(self, group: _Group) -> None:
        """Post the receives of the group's first round (encoder states, first step)."""
        if self.source is not None and not self.is_first:
            batch, src_len = group.src_ids.shape
            buffer = torch.empty(batch, src_len, self.width, dtype=self.dtype,
                                 device=self.device)
            group.posted_memory = self.channel.post(buffer, self.source,
                                                    _tag(group.index, _ENCODED))
        if not self.is_first:
            self._post_next(group)

    def _encode(self, group: _Group) -> None:
        if self.embed is not None:
            state, src_pad = self.embed.embed_source(group.src_ids)
        else:
            state = self._wait(group.posted_memory)
            group.posted_memory = None
            src_pad = group.src_ids.eq(self.pad_id)
        for encoder in self.encoders:
            state = encoder.encode(state, src_pad)
        if self.first_decoder_here:
            state = self.decoders[0].prepare_memory(state)
        if self.following is not None:
            self.channel.send(state.contiguous(), self.following, _tag(group.index, _ENCODED))
        # kept only by stages with decoder layers (all after prepare_memory)
        group.memory = state if self.decoders else None
        group.src_pad = src_pad

    def turn(self, group: _Group) -> bool:
        """The group's next decoding step on this stage; whether the group goes on.

        A finished group leaves every stage's rotation at the same place: the turn after its
        last step, where the other stages get the message of zero rows and the last stage,
        which knew it first, nothing.
        """
        if group.finished:
            return False
        first_step = group.step == 0
        if first_step:
            self._encode(group)
        state: Tensor | None = None
        parent: Tensor | None
        capacity = group.rows
        if self.is_first and first_step:
            rows, parent, tokens = capacity, None, group.search.new_tokens.to(self.device)
        elif self.is_first and self.is_last:
            assert group.decided is not None
            rows, parent, tokens = group.decided
        elif self.is_first:
            header = self._wait(group.posted)
            rows, parent, tokens = self._read_decisions(header, capacity)
        else:
            buffer = self._wait(group.posted)
            split = 8 * (1 + 2 * capacity)
            rows, parent, tokens = self._read_decisions(buffer[:split].view(torch.long),
                                                        capacity)
            state = buffer[split:].view(self.dtype)[: rows * self.width].view(
                rows, 1, self.width)
        group.posted = None
        if first_step:
            parent = None
        if rows == 0:  # the group is finished: tell the stages up to the last one's
            if self.following is not None and self.following < self.num_stages - 1:
                header = self._decisions(0, None, tokens, capacity)
                self._send_decoded(group, header, None, capacity)
            group.caches = []
            return False

        # reorder the caches as the search did the hypotheses, then this stage's layers
        assert group.src_pad is not None
        if parent is not None:
            for cache in group.caches:
                cache.select(parent)
            group.src_pad = group.src_pad.index_select(0, parent)
        memory = self.no_memory  # the caches hold the memory's keys and values
        if first_step:
            source = group.search.source_rows.to(self.device)
            group.src_pad = group.src_pad[source]
            if group.memory is not None:
                memory = group.memory[source]
            group.memory = None
        group.rows = rows
        tgt_pad = tokens.eq(self.pad_id)[:, None]
        if self.embed is not None:
            state, tgt_pad = self.embed.embed_target(tokens[:, None], group.step)
        assert state is not None
        for decoder, cache in zip(self.decoders, group.caches, strict=True):
            state = decoder.decode(state, memory, group.src_pad, tgt_pad, cache)
        group.step += 1
        if not self.is_last:
            self._send_decoded(group, self._decisions(rows, parent, tokens, capacity), state,
                               capacity)
            self._post_next(group)
            return True

        # the last stage: the search's step, and its decisions back to stage 0
        assert self.project is not None
        log_probs = self.project.logits(state[:, -1]).float().log_softmax(dim=-1)
        search = group.search
        search.advance(log_probs)
        decided_rows = 0 if search.done else search.source_rows.numel()
        new_parent = search.parent if search.parent is not None else tokens[:0]
        new_tokens = search.new_tokens if decided_rows else tokens[:0]
        if self.is_first:
            group.decided = (decided_rows, new_parent, new_tokens)
        else:
            header = self._decisions(decided_rows, new_parent[:decided_rows], new_tokens, rows)
            self.channel.send(header, 0, _tag(group.index, _DECIDED))
        if search.done:
            group.caches = []
            group.finished = True  # leaves at its next turn, as on the other stages
            return True
        self._post_next(group)
        return True

    def _send_decoded(self, group: _Group, header: Tensor, state: Tensor | None,
                      capacity: int) -> None:
        assert self.following is not None
        buffer = torch.zeros(self._decoded_bytes(capacity), dtype=torch.uint8,
                             device=self.device)
        split = 8 * (1 + 2 * capacity)
        buffer[:split] = header.view(torch.uint8)
        if state is not None:
            flat = state.contiguous().view(-1).view(torch.uint8)
            buffer[split : split + flat.numel()] = flat
        self.channel.send(buffer, self.following, _tag(group.index, _DECODED))

    # -- the hypotheses, from the last stage to every rank -----------------------------------

    def share(self, hypotheses: list[Hypothesis] | None, batch_size: int) -> list[Hypothesis]:
        if batch_size == 0:
            return []
        last = self.num_stages - 1
        tag = _tag(0, _RESULT)
        if self.is_last:
            assert hypotheses is not None
            lengths = torch.tensor([len(h.tokens) for h in hypotheses], dtype=torch.long)
            scores = torch.tensor([h.score for h in hypotheses], dtype=torch.float64)
            tokens = torch.tensor([t for h in hypotheses for t in h.tokens], dtype=torch.long)
            for stage in range(last):
                for tensor in (lengths, scores, tokens):
                    if tensor.numel():
                        self.channel.send(tensor.to(self.device), stage, tag)
            self.channel.finish()
            return hypotheses
        lengths = self._wait(self.channel.post(torch.empty(batch_size, dtype=torch.long,
                                                   device=self.device), last, tag))
        scores = self._wait(self.channel.post(torch.empty(batch_size, dtype=torch.float64,
                                                  device=self.device), last, tag))
        total = int(lengths.sum())
        tokens = torch.empty(0, dtype=torch.long)
        if total:
            tokens = self._wait(self.channel.post(torch.empty(total, dtype=torch.long,
                                                      device=self.device), last, tag))
        pieces = tokens.cpu().split(lengths.cpu().tolist())
        return [Hypothesis(piece.tolist(), float(score))
                for piece, score in zip(pieces, scores.cpu().tolist(), strict=True)]


def _model_width(layers: list[torch.nn.Module]) -> int:
    """d_model, from any layer of the stage (every stage holds at least one)."""
    for layer in layers:
        if isinstance(layer, Embed):
            return int(layer.d_model)
        if isinstance(layer, EncoderLayer | DecoderLayer):
            return int(layer.ffn_norm.normalized_shape[0])
        if isinstance(layer, Project):
            return int(layer.norm.normalized_shape[0])
    raise TypeError("a stage without NMT layers")


@torch.no_grad()
def pipelined_search_batches(
    pipe: gp.DistributedGPipe,
    batches: Sequence[tuple[Tensor, int]],
    *,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    in_flight: int | None = None,
) -> list[list[Hypothesis]]:
    """Decode several padded batches ``(src_ids [B,S], max_len)`` through the pipeline, each
    batch its own group, ``in_flight`` of them at a time (default :func:`default_in_flight`): a finished batch's place in the rotation goes to the next one. Each batch's
    hypotheses equal the one-process search of that batch (``search_hypotheses``) bit for bit.
    Collective over the pipeline group; every rank passes the same arguments and gets the same
    hypotheses (per batch, per sentence).
    """
    in_flight = (default_in_flight(pipe.num_stages, len(batches)) if in_flight is None
                 else in_flight)
    if in_flight < 1:
        raise ValueError(f"in_flight={in_flight} must be >= 1")
    was_training = pipe.training
    pipe.eval()
    try:
        ring = _StageDecoder(pipe, pad_id=pad_id)
        searches = [new_search(batch_size=src_ids.shape[0], beam_size=beam_size, bos_id=bos_id,
                               eos_id=eos_id, max_len=max_len, alpha=alpha, device=ring.device)
                    for src_ids, max_len in batches]  # on every rank: the first step's rows
        waiting = deque(index for index, search in enumerate(searches) if not search.done)
        rotation: deque[_Group] = deque()

        def admit() -> None:
            index = waiting.popleft()
            search = searches[index]
            group = _Group(index, batches[index][0].to(ring.device), search,
                           [LayerCache() for _ in ring.decoders],
                           rows=search.source_rows.numel())
            ring.start(group)
            rotation.append(group)

        ring.channel.refresh()
        try:
            while waiting and len(rotation) < in_flight:
                admit()
            while rotation:  # round-robin: each group's next step, in the same order everywhere
                group = rotation.popleft()
                if ring.turn(group):
                    rotation.append(group)
                elif waiting:  # its place goes to the next batch, on every stage alike
                    admit()
            ring.channel.finish()
            flat = None
            if ring.is_last:
                flat = [h for search in searches for h in search.hypotheses()]
            flat = ring.share(flat, sum(src_ids.shape[0] for src_ids, _ in batches))
        except PipelineFailure:
            raise
        except Exception as exc:
            report_failure(exc, where=ring.channel.where)  # the other ranks name this one
            raise
    finally:
        pipe.train(was_training)
    hypotheses, start = [], 0
    for src_ids, _ in batches:
        hypotheses.append(flat[start : start + src_ids.shape[0]])
        start += src_ids.shape[0]
    return hypotheses


def pipelined_search_hypotheses(
    pipe: gp.DistributedGPipe,
    src_ids: Tensor,
    *,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int = 64,
    groups: int | None = None,
) -> list[Hypothesis]:
    """Each sentence's hypothesis (tokens and score, ``apps.nmt.search.Hypothesis``) of the
    padded batch ``src_ids`` [B,S] (no BOS/EOS), the same on every rank, decoded through the
    pipeline as ``groups`` groups of consecutive sentences, all in flight (default
    :func:`default_groups`). Equals ``search_hypotheses(model, src_ids, groups=groups)`` bit for
    bit. Collective over the pipeline group; every rank passes the same arguments.
    """
    groups = default_groups(pipe.num_stages, src_ids.shape[0]) if groups is None else groups
    parts = split_groups(src_ids.shape[0], groups)  # also refuses groups < 1
    if src_ids.shape[0] == 0:
        return []
    batches = [(src_ids[rows.to(src_ids.device)], max_len) for rows in parts]
    per_batch = pipelined_search_batches(pipe, batches, pad_id=pad_id, bos_id=bos_id,
                                         eos_id=eos_id, beam_size=beam_size, alpha=alpha,
                                         in_flight=len(batches))
    return [hypothesis for hypotheses in per_batch for hypothesis in hypotheses]


def pipelined_beam_search(
    pipe: gp.DistributedGPipe,
    src_ids: Tensor,
    *,
    vocab_size: int,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int = 64,
    groups: int | None = None,
) -> list[list[int]]:
    """``apps.nmt.search.beam_search`` through the pipeline: token ids per sentence of the
    padded batch ``src_ids`` [B,S] (no BOS/EOS), the same on every rank. Collective over the
    pipeline group; every rank passes the same arguments. ``beam_size=1`` is greedy decoding.
    ``groups``: see :func:`pipelined_search_hypotheses` (``groups=1``: exactly ``beam_search``
    on the whole batch). ``vocab_size`` is the model's (unused: the last stage's projection
    has it; kept for the callers).
    """
    del vocab_size
    hypotheses = pipelined_search_hypotheses(pipe, src_ids, pad_id=pad_id, bos_id=bos_id,
                                             eos_id=eos_id, beam_size=beam_size, alpha=alpha,
                                             max_len=max_len, groups=groups)
    return [hypothesis.tokens for hypothesis in hypotheses]


# ---------------------------------------------------------------------------------------------
# The search of ``apps.nmt.decoding.translate``


class PipelineSearch:
    """The search of ``apps.nmt.decoding.translate`` through a pipeline (greedy for
    ``beam_size=1``); every rank of the pipeline must call it alike.

    ``search(src_ids, max_len)`` decodes one batch in ``groups`` groups of sentences
    (:func:`pipelined_beam_search`); ``search.batches([(src_ids, max_len), ...])`` decodes
    several batches, each its own group, several at a time (:func:`pipelined_search_batches`):
    ``translate`` hands it all its batches, so that the hypotheses are the one-process ones
    (each batch is decoded as a batch, as in one process) and the stages still overlap.
    """

    def __init__(self, pipe: gp.DistributedGPipe, config: NMTConfig, *, beam_size: int,
                 alpha: float, groups: int | None = None) -> None:
        self.pipe, self.config, self.groups = pipe, config, groups
        self.options = dict(pad_id=config.pad_id, bos_id=config.bos_id, eos_id=config.eos_id,
                            beam_size=beam_size, alpha=alpha)

    def __call__(self, src_ids: Tensor, max_len: int) -> list[list[int]]:
        return pipelined_beam_search(self.pipe, src_ids, vocab_size=self.config.vocab_size,
                                     max_len=max_len, groups=self.groups,
                                     **self.options)  # type: ignore[arg-type]

    def batches(self, batches: Sequence[tuple[Tensor, int]]) -> list[list[list[int]]]:
        per_batch = pipelined_search_batches(self.pipe, batches, in_flight=self.groups,
                                             **self.options)  # type: ignore[arg-type]
        return [[hypothesis.tokens for hypothesis in batch] for batch in per_batch]


def pipeline_search(pipe: gp.DistributedGPipe, config: NMTConfig, *, beam_size: int,
                    alpha: float, groups: int | None = None) -> PipelineSearch:
    """The search through ``pipe`` for ``apps.nmt.decoding.translate`` (:class:`PipelineSearch`:
    ``search(src_ids, max_len)``, and ``search.batches`` for several batches at a time)."""
    return PipelineSearch(pipe, config, beam_size=beam_size, alpha=alpha, groups=groups)
