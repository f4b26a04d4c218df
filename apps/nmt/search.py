"""Batched beam search and greedy decoding over the plain nn.Sequential NMT model."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from apps.nmt.model import decode, encode, new_decoder_cache

# step(prefix [N, t] starting with BOS, source [N], parent [N] or None) -> log-probs [N, V] of
# the next token. source: which input sentence each row translates. parent: the row of the
# previous call that each row extends (None at the first call), so a stateful step can reorder
# its cache; rows of finished sentences and pruned beams disappear between calls.
StepFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]


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
    outputs: list[list[int]] = [[] for _ in range(batch_size)]
    active = torch.arange(batch_size, device=device)
    prefix = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)
    parent: Tensor | None = None
    for _ in range(max_len):
        next_token = step(prefix, active, parent).argmax(dim=-1)
        prefix = torch.cat([prefix, next_token[:, None]], dim=1)
        ended = next_token.eq(eos_id)
        for row in ended.nonzero().flatten().tolist():
            outputs[int(active[row])] = prefix[row, 1:-1].tolist()
        parent = (~ended).nonzero().flatten()
        active, prefix = active[parent], prefix[parent]
        if active.numel() == 0:
            break
    for row, source in enumerate(active.tolist()):  # hit max_len without EOS
        outputs[source] = prefix[row, 1:].tolist()
    return outputs


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
    """Beam search with GNMT length normalisation; returns the best ids per source (no BOS/EOS).

    A hypothesis's score is its summed log-probability divided by ``length_penalty(len, alpha)``,
    where ``len`` counts generated tokens including EOS. At each step the top ``2 * beam_size``
    extensions are ranked: EOS extensions within the top ``beam_size`` become finished
    hypotheses, the best ``beam_size`` others stay alive. A source stops once it has
    ``beam_size`` finished hypotheses and no live one can still beat the worst of them; at
    ``max_len`` tokens live hypotheses are finished as they are.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1")
    k = beam_size
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch_size)]
    active = torch.arange(batch_size, device=device)
    prefix = torch.full((batch_size, k, 1), bos_id, dtype=torch.long, device=device)
    # only beam 0 is real at the start, so the first step does not pick k copies of one token
    scores = torch.full((batch_size, k), -math.inf, device=device)
    scores[:, 0] = 0.0
    parent: Tensor | None = None

    for length in range(1, max_len + 1):  # length = tokens generated after this step
        num_active = active.numel()
        log_probs = step(prefix.view(num_active * k, -1), active.repeat_interleave(k), parent)
        vocab = log_probs.shape[-1]
        candidates = (scores[:, :, None] + log_probs.view(num_active, k, vocab)).view(
            num_active, k * vocab
        )
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)
        top_beam, top_token = top_index // vocab, top_index % vocab
        penalty = length_penalty(length, alpha)
        # the best normalised score a live hypothesis could still reach: raw scores only fall,
        # and the penalty is monotone in length, so the extremes are at the next or last length
        future = [length_penalty(n, alpha) for n in (min(length + 1, max_len), max_len)]

        keep_rows: list[int] = []
        keep_beams: list[list[int]] = []
        keep_tokens: list[list[int]] = []
        keep_scores: list[list[float]] = []
        rows = zip(top_scores.tolist(), top_beam.tolist(), top_token.tolist(), strict=True)
        for row, (row_scores, row_beams, row_tokens) in enumerate(rows):
            source = int(active[row])
            alive: list[tuple[int, int, float]] = []
            for rank, (score, beam, token) in enumerate(
                zip(row_scores, row_beams, row_tokens, strict=True)
            ):
                if score == -math.inf:
                    break
                if token == eos_id:
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
            break
        row_index = torch.tensor(keep_rows, device=prefix.device)[:, None]
        beam_index = torch.tensor(keep_beams, device=prefix.device)
        new_tokens = torch.tensor(keep_tokens, device=prefix.device)
        prefix = torch.cat([prefix[row_index, beam_index], new_tokens[:, :, None]], dim=2)
        parent = (row_index * k + beam_index).flatten()  # rows were laid out as (row, beam)
        scores = torch.tensor(keep_scores, device=prefix.device, dtype=scores.dtype)
        active = active[row_index[:, 0]]

    return [max(hyps, key=lambda item: item[0])[1] if hyps else [] for hyps in finished]


@torch.no_grad()
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
) -> list[list[int]]:
    """Translate a padded batch ``src_ids`` [B,S]; returns token ids per sentence (no BOS/EOS).

    ``beam_size=1`` is greedy decoding. Runs the model in eval mode (restored afterwards) with the
    model's own layers, through ``apps.nmt.model.encode`` / ``decode``; ``use_cache=False``
    re-runs the decoder over the prefix at each step instead of caching keys and values.
    """
    was_training = model.training
    model.eval()
    try:
        step = model_step_fn(model, src_ids, use_cache=use_cache)
        common = dict(
            batch_size=src_ids.shape[0],
            bos_id=bos_id,
            eos_id=eos_id,
            max_len=max_len,
            device=src_ids.device,
        )
        if beam_size == 1:
            return greedy_decode(step, **common)  # type: ignore[arg-type]
        return beam_decode(step, beam_size=beam_size, alpha=alpha, **common)  # type: ignore[arg-type]
    finally:
        model.train(was_training)
