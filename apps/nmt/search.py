"""Batched beam search and greedy decoding over the plain nn.Sequential NMT model.

The searches are step-wise objects (:class:`GreedySearch`, :class:`BeamSearch`): each holds
the state of one batch of sentences, says which rows the next decoder step must compute
(``prefix_rows``, ``source_rows``, ``parent``) and takes that step's log-probabilities in
:meth:`~GreedySearch.advance`, until ``done``. One process can so interleave several
independent searches (the pipelined decoder, ``apps.nmt.pipelined_search``, runs one per group
of sentences). :func:`greedy_decode` and :func:`beam_decode` drive one search with a
:data:`StepFn`; :func:`beam_search` decodes a batch with the plain model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from apps.nmt.model import decode, encode, new_decoder_cache

# step(prefix [N, t] starting with BOS, source [N], parent [N] or None) -> log-probs [N, V] of
# the next token. source: which input sentence each row translates. parent: the row of the
# previous call that each row extends (None at the first call), so a stateful step can reorder
# its cache; rows of finished sentences and pruned beams disappear between calls.
StepFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]


class Hypothesis(NamedTuple):
    """A sentence's decoded token ids (no BOS/EOS) and its score: the summed log-probability
    divided by the length penalty (beam search), or the summed log-probability (greedy)."""

    tokens: list[int]
    score: float


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha``; scores are divided by it."""
    return ((5.0 + length) / 6.0) ** alpha


def model_step_fn(model: nn.Sequential, src_ids: Tensor, *, use_cache: bool = True) -> StepFn:
    """Encode ``src_ids`` [B,S] once with the model's own layers; return the decoder step.

    With ``use_cache`` each step feeds only the newest token and reuses the decoder's keys and
    values (``apps.nmt.model.DecoderCache``); without it each step re-runs the decoder over the
    whole prefix. Both give the same log-probabilities.
    """
    memory, src_pad = encode(model, src_ids)
    cache = new_decoder_cache(model) if use_cache else None

    def step(prefix: Tensor, source: Tensor, parent: Tensor | None) -> Tensor:
        new_tokens = prefix
        if cache is not None:
            if parent is not None:
                cache.select(parent)
                new_tokens = prefix[:, cache.length :]
            if new_tokens.shape[1] != 1:
                raise ValueError(
                    f"cached decoding expects one new token per step, got a prefix of "
                    f"{prefix.shape[1]} after {cache.length} cached positions"
                )
        logits = decode(
            model, memory[source], src_pad[source], new_tokens, last_only=True, cache=cache
        )
        return logits.float().log_softmax(dim=-1)

    return step


class GreedySearch:
    """Arg-max decoding of ``batch_size`` sources, one step per :meth:`advance`.

    Before each step, ``prefix_rows`` [N, t] (BOS and the tokens so far), ``source_rows`` [N]
    and ``parent`` [N] (rows of the previous step that the rows extend; None at the first)
    describe the N rows to compute; ``new_tokens`` [N] are their newest tokens.
    """

    def __init__(self, *, batch_size: int, bos_id: int, eos_id: int, max_len: int,
                 device: torch.device | str | None = None) -> None:
        self.eos_id, self.max_len = eos_id, max_len
        self.outputs: list[Hypothesis] = [Hypothesis([], 0.0) for _ in range(batch_size)]
        self.active = torch.arange(batch_size, device=device)
        self.prefix = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)
        self.parent: Tensor | None = None
        self.length = 0  # tokens generated so far
        self.scores: list[float] = [0.0] * batch_size  # summed log-probability per row
        self.done = batch_size == 0 or max_len < 1

    @property
    def prefix_rows(self) -> Tensor:
        return self.prefix

    @property
    def source_rows(self) -> Tensor:
        return self.active

    @property
    def new_tokens(self) -> Tensor:
        return self.prefix[:, -1]

    def advance(self, log_probs: Tensor) -> None:
        """Take the step's log-probabilities [N, V] of the rows described before it."""
        next_token = log_probs.argmax(dim=-1)
        chosen = log_probs.gather(1, next_token[:, None])[:, 0].tolist()
        scores = [score + logp for score, logp in zip(self.scores, chosen, strict=True)]
        self.prefix = torch.cat([self.prefix, next_token[:, None]], dim=1)
        self.length += 1
        ended = next_token.eq(self.eos_id)
        for row in ended.nonzero().flatten().tolist():
            self.outputs[int(self.active[row])] = Hypothesis(self.prefix[row, 1:-1].tolist(),
                                                             scores[row])
        self.parent = (~ended).nonzero().flatten()
        self.active, self.prefix = self.active[self.parent], self.prefix[self.parent]
        self.scores = [scores[row] for row in self.parent.tolist()]
        self.done = self.active.numel() == 0 or self.length == self.max_len

    def hypotheses(self) -> list[Hypothesis]:
        """The result once ``done``: per source, its tokens (without BOS and EOS) and score."""
        outputs = list(self.outputs)
        for row, source in enumerate(self.active.tolist()):  # hit max_len without EOS
            outputs[source] = Hypothesis(self.prefix[row, 1:].tolist(), self.scores[row])
        return outputs


class BeamSearch:
    """Beam search with GNMT length normalisation, one step per :meth:`advance`.

    A hypothesis's score is its summed log-probability divided by ``length_penalty(len,
    alpha)``, where ``len`` counts generated tokens including EOS. At each step the top
    ``2 * beam_size`` extensions are ranked: EOS extensions within the top ``beam_size`` become
    finished hypotheses, the best ``beam_size`` others stay alive. A source stops once it has
    ``beam_size`` finished hypotheses and no live one can still beat the worst of them; at
    ``max_len`` tokens live hypotheses are finished as they are. Rows are laid out as
    (source, beam); see :class:`GreedySearch` for the row attributes.
    """

    def __init__(self, *, batch_size: int, beam_size: int, bos_id: int, eos_id: int,
                 max_len: int, alpha: float = 0.0,
                 device: torch.device | str | None = None) -> None:
        if beam_size < 1:
            raise ValueError(f"beam_size={beam_size} must be >= 1")
        if max_len < 1:
            raise ValueError(f"max_len={max_len} must be >= 1")
        self.k, self.eos_id, self.max_len, self.alpha = beam_size, eos_id, max_len, alpha
        self.finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch_size)]
        self.active = torch.arange(batch_size, device=device)
        self.prefix = torch.full((batch_size, beam_size, 1), bos_id, dtype=torch.long,
                                 device=device)
        # only beam 0 is real at the start, so the first step does not pick k copies of one token
        self.scores = torch.full((batch_size, beam_size), -math.inf, device=device)
        self.scores[:, 0] = 0.0
        self.parent: Tensor | None = None
        self.length = 0  # tokens generated so far
        self.done = batch_size == 0

    @property
    def prefix_rows(self) -> Tensor:
        return self.prefix.view(self.active.numel() * self.k, -1)

    @property
    def source_rows(self) -> Tensor:
        return self.active.repeat_interleave(self.k)

    @property
    def new_tokens(self) -> Tensor:
        return self.prefix[:, :, -1].reshape(-1)

    def advance(self, log_probs: Tensor) -> None:
        """Take the step's log-probabilities [N, V] of the rows described before it."""
        k, max_len, prefix, active = self.k, self.max_len, self.prefix, self.active
        self.length += 1
        length = self.length  # tokens generated after this step
        num_active = active.numel()
        vocab = log_probs.shape[-1]
        candidates = (self.scores[:, :, None] + log_probs.view(num_active, k, vocab)).view(
            num_active, k * vocab
        )
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)
        top_beam, top_token = top_index // vocab, top_index % vocab
        penalty = length_penalty(length, self.alpha)
        # the best normalised score a live hypothesis could still reach: raw scores only fall,
        # and the penalty is monotone in length, so the extremes are at the next or last length
        future = [length_penalty(n, self.alpha) for n in (min(length + 1, max_len), max_len)]

        keep_rows: list[int] = []
        keep_beams: list[list[int]] = []
        keep_tokens: list[list[int]] = []
        keep_scores: list[list[float]] = []
        finished = self.finished
        rows = zip(top_scores.tolist(), top_beam.tolist(), top_token.tolist(), strict=True)
        for row, (row_scores, row_beams, row_tokens) in enumerate(rows):
            source = int(active[row])
            alive: list[tuple[int, int, float]] = []
            for rank, (score, beam, token) in enumerate(
                zip(row_scores, row_beams, row_tokens, strict=True)
            ):
                if score == -math.inf:
                    break
                if token == self.eos_id:
                    if rank < k:
                        hypothesis = prefix[row, beam, 1:].tolist()
                        finished[source].append((score / penalty, hypothesis))
                elif len(alive) < k:
                    alive.append((beam, token, score))
            finished[source] = sorted(finished[source], key=lambda item: -item[0])[:k]
            done = not alive or length == max_len
            if not done and len(finished[source]) >= k:
                best_possible = max(alive[0][2] / p for p in future)
                done = best_possible <= finished[source][-1][0]
            if done:
                if length == max_len:
                    for beam, token, score in alive:
                        hypothesis = prefix[row, beam, 1:].tolist() + [token]
                        finished[source].append((score / penalty, hypothesis))
                continue
            while len(alive) < k:  # too few valid extensions (tiny vocabulary): pad dead beams
                alive.append((alive[0][0], alive[0][1], -math.inf))
            keep_rows.append(row)
            keep_beams.append([beam for beam, _, _ in alive])
            keep_tokens.append([token for _, token, _ in alive])
            keep_scores.append([score for _, _, score in alive])

        if not keep_rows:
            self.done = True
            self.active = active[:0]
            self.parent = torch.zeros(0, dtype=torch.long, device=prefix.device)
            return
        row_index = torch.tensor(keep_rows, device=prefix.device)[:, None]
        beam_index = torch.tensor(keep_beams, device=prefix.device)
        new_tokens = torch.tensor(keep_tokens, device=prefix.device)
        self.prefix = torch.cat([prefix[row_index, beam_index], new_tokens[:, :, None]], dim=2)
        self.parent = (row_index * k + beam_index).flatten()  # rows were laid out as (row, beam)
        self.scores = torch.tensor(keep_scores, device=prefix.device, dtype=self.scores.dtype)
        self.active = active[row_index[:, 0]]

    def hypotheses(self) -> list[Hypothesis]:
        """The result once ``done``: per source, the best finished hypothesis (no BOS/EOS)."""
        best = [max(hyps, key=lambda item: item[0]) if hyps else (-math.inf, [])
                for hyps in self.finished]
        return [Hypothesis(tokens, score) for score, tokens in best]


Search = GreedySearch | BeamSearch


def new_search(*, batch_size: int, beam_size: int, bos_id: int, eos_id: int, max_len: int,
               alpha: float = 0.0, device: torch.device | str | None = None) -> Search:
    """A :class:`GreedySearch` for ``beam_size=1``, else a :class:`BeamSearch`."""
    common = dict(batch_size=batch_size, bos_id=bos_id, eos_id=eos_id, max_len=max_len,
                  device=device)
    if beam_size == 1:
        return GreedySearch(**common)  # type: ignore[arg-type]
    return BeamSearch(beam_size=beam_size, alpha=alpha, **common)  # type: ignore[arg-type]


def run_search(search: Search, step: StepFn) -> list[Hypothesis]:
    """Drive ``search`` with ``step`` until it is done; its hypotheses."""
    while not search.done:
        search.advance(step(search.prefix_rows, search.source_rows, search.parent))
    return search.hypotheses()


def greedy_decode(
    step: StepFn,
    *,
    batch_size: int,
    bos_id: int,
    eos_id: int,
    max_len: int,
    device: torch.device | str | None = None,
) -> list[list[int]]:
    """Arg-max decoding; returns the generated ids per source, without BOS and EOS."""
    search = GreedySearch(batch_size=batch_size, bos_id=bos_id, eos_id=eos_id, max_len=max_len,
                          device=device)
    return [hypothesis.tokens for hypothesis in run_search(search, step)]


def beam_decode(
    step: StepFn,
    *,
    batch_size: int,
    beam_size: int,
    bos_id: int,
    eos_id: int,
    max_len: int,
    alpha: float = 0.0,
    device: torch.device | str | None = None,
) -> list[list[int]]:
    """Beam search (:class:`BeamSearch`); returns the best ids per source (no BOS/EOS)."""
    search = BeamSearch(batch_size=batch_size, beam_size=beam_size, bos_id=bos_id,
                        eos_id=eos_id, max_len=max_len, alpha=alpha, device=device)
    return [hypothesis.tokens for hypothesis in run_search(search, step)]


def split_groups(batch_size: int, groups: int) -> list[Tensor]:
    """Indices of the sentences of each of ``groups`` consecutive groups of a batch (sizes
    differ by at most one; never more groups than sentences, nor fewer than one)."""
    if groups < 1:
        raise ValueError(f"groups={groups} must be >= 1")
    return list(torch.arange(batch_size).tensor_split(max(1, min(groups, batch_size))))


@torch.no_grad()
def search_hypotheses(
    model: nn.Sequential,
    src_ids: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int = 64,
    use_cache: bool = True,
    groups: int = 1,
) -> list[Hypothesis]:
    """:func:`beam_search` with each sentence's score (:class:`Hypothesis`).

    ``groups``: decode the batch as that many consecutive groups of sentences, each its own
    batch (what the pipelined decoder overlaps; it gives exactly these hypotheses). A matrix
    product's last bits can depend on how many rows it has, so a grouped batch may differ from
    the whole batch in the last bits of the scores, and, on a near tie, in a token.
    """
    was_training = model.training
    model.eval()
    try:
        hypotheses: list[Hypothesis] = []
        for rows in split_groups(src_ids.shape[0], groups):
            part = src_ids[rows.to(src_ids.device)] if groups > 1 else src_ids
            step = model_step_fn(model, part, use_cache=use_cache)
            search = new_search(batch_size=part.shape[0], beam_size=beam_size, bos_id=bos_id,
                                eos_id=eos_id, max_len=max_len, alpha=alpha,
                                device=src_ids.device)
            hypotheses += run_search(search, step)
        return hypotheses
    finally:
        model.train(was_training)


def beam_search(
    model: nn.Sequential,
    src_ids: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int = 64,
    use_cache: bool = True,
    groups: int = 1,
) -> list[list[int]]:
    """Translate a padded batch ``src_ids`` [B,S]; returns token ids per sentence (no BOS/EOS).

    ``beam_size=1`` is greedy decoding. Runs the model in eval mode (restored afterwards) with the
    model's own layers, through ``apps.nmt.model.encode`` / ``decode``; ``use_cache=False``
    re-runs the decoder over the prefix at each step instead of caching keys and values.
    ``groups``: see :func:`search_hypotheses`.
    """
    hypotheses = search_hypotheses(model, src_ids, bos_id=bos_id, eos_id=eos_id,
                                   beam_size=beam_size, alpha=alpha, max_len=max_len,
                                   use_cache=use_cache, groups=groups)
    return [hypothesis.tokens for hypothesis in hypotheses]
