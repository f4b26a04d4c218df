"""Decoding NMT evaluation sentences: the held-out pairs of a split (:func:`load_eval_sentences`),
their translations by batched beam search or greedy decoding (:func:`translate`), and the mean
token loss over a split (:func:`mean_token_loss`).

``translate`` runs ``apps.nmt.search.beam_search`` on the plain ``nn.Sequential`` in one
process, or any ``search`` it is given instead (through a pipeline:
``apps.nmt.pipelined_search.PipelineSearch``); ``mean_token_loss`` takes the plain model or a
``DistributedGPipe`` of it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

import gpipe_core as gp
from apps.nmt.config import NMTConfig
from apps.nmt.data import CorpusError, Tokenizer, eval_batches, language_counts
from apps.nmt.search import beam_search

__all__ = ["Sentence", "batches_by_length", "load_eval_sentences", "mean_token_loss",
           "pad_batch", "train_languages", "translate"]


@dataclass
class Sentence:
    """One evaluation pair: its language, source ids (tag first), raw source and reference."""

    lang: str
    src_ids: list[int]
    source: str
    reference: str



def train_languages(config: NMTConfig) -> list[str]:
    """The languages a run of ``config`` trains on: its ``languages``, or all with train data."""
    counts = language_counts(config.data_dir, "train")
    if config.languages:
        return list(config.languages)
    return sorted(lang for lang, n in counts.items() if n > 0)


def load_eval_sentences(
    data_dir: str | Path,
    split: str,
    languages: Sequence[str],
    *,
    max_per_lang: int | None,
    pad_id: int,
    strict: bool = True,
    max_src_len: int | None = None,
) -> tuple[list[Sentence], list[str]]:
    """The first ``max_per_lang`` pairs of each language of ``split``; returns (pairs, skipped).

    ``strict``: a language without ``split`` data is an error (naming the languages that have
    data); otherwise it is skipped and returned in ``skipped``. ``max_src_len`` (the model's
    ``max_positions``): a longer source is cut to its first ``max_src_len`` tokens, which is all
    the model can read, with one warning saying how many were (held-out pairs are not filtered
    by length as training pairs are, and a catalog may hold a paragraph).
    """
    counts = language_counts(data_dir, split)
    skipped = [lang for lang in languages if counts.get(lang, 0) == 0]
    if skipped and strict:
        have = " ".join(sorted(lang for lang, n in counts.items() if n > 0))
        raise CorpusError(
            f"no {split} data for language(s) {skipped} in {data_dir}; "
            f"languages with {split} data: {have}"
        )
    chosen = [lang for lang in languages if lang not in skipped]
    if not chosen:
        raise CorpusError(f"none of the languages {list(languages)} has {split} data in {data_dir}")
    sentences: list[Sentence] = []
    # one batch per pair would be slow; big batches, then unpadded rows
    for batch in eval_batches(
        data_dir, split, max_tokens=1 << 16, languages=chosen, max_per_lang=max_per_lang
    ):
        assert batch.sources is not None and batch.references is not None
        for row in range(len(batch)):
            ids = batch.src[row]
            sentences.append(
                Sentence(
                    batch.langs[row],
                    ids[ids.ne(pad_id)].tolist(),
                    batch.sources[row],
                    batch.references[row],
                )
            )
    long = [s for s in sentences if max_src_len is not None and len(s.src_ids) > max_src_len]
    if long:
        print(f"warning: {len(long)} of {len(sentences)} {split} sources have more than "
              f"max_positions={max_src_len} tokens (the longest {max(len(s.src_ids) for s in long)}"
              f"); they are cut to their first {max_src_len}", file=sys.stderr, flush=True)
        for sentence in long:
            del sentence.src_ids[max_src_len:]
    return sentences, skipped



def batches_by_length(
    sentences: Sequence[Sentence], *, max_src_tokens: int, max_sentences: int
) -> list[list[int]]:
    """Indices of ``sentences`` grouped into batches of similar source length (little padding)."""
    order = sorted(range(len(sentences)), key=lambda i: (len(sentences[i].src_ids), i))
    groups: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = len(sentences[index].src_ids)
        if current and (
            len(current) >= max_sentences or (len(current) + 1) * width > max_src_tokens
        ):
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> Tensor:
    """``rows`` of token ids as one [len(rows), longest] batch, padded with ``pad_id``."""
    width = max(len(row) for row in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def translate(
    model: nn.Sequential | None,
    sentences: Sequence[Sentence],
    tokenizer: Tokenizer,
    *,
    beam_size: int,
    alpha: float,
    max_decode_len: int,
    device: torch.device,
    max_src_tokens: int = 2048,
    max_sentences: int = 64,
    search: Callable[[Tensor, int], list[list[int]]] | None = None,
) -> list[str]:
    """Detokenized beam-search translations of ``sentences`` (in their order), in batches of
    similar length. Output length is bounded by ``max_decode_len`` and by twice the source
    length plus 8. ``search(src_ids, max_len)``, when given, decodes a padded batch instead of
    ``beam_search`` on ``model`` (e.g. through a pipeline: ``apps.nmt.pipelined_search``); a
    search with a ``batches([(src_ids, max_len), ...])`` method gets every batch at once (the
    pipeline decodes several at a time, each as its own batch, so the result is the same).
    """
    groups = batches_by_length(
        sentences, max_src_tokens=max_src_tokens, max_sentences=max_sentences
    )
    translations: dict[int, str] = {}
    batches = getattr(search, "batches", None)
    if batches is not None:
        padded = [pad_batch([sentences[i].src_ids for i in group], tokenizer.pad_id, device)
                  for group in groups]
        decoded = batches([(src, min(max_decode_len, 2 * src.shape[1] + 8)) for src in padded])
        for group, ids in zip(groups, decoded, strict=True):
            for index, hypothesis in zip(group, ids, strict=True):
                translations[index] = tokenizer.decode(hypothesis)
        return [translations[i] for i in range(len(sentences))]
    for group in groups:
        src = pad_batch([sentences[i].src_ids for i in group], tokenizer.pad_id, device)
        max_len = min(max_decode_len, 2 * src.shape[1] + 8)
        if search is not None:
            ids = search(src, max_len)
        else:
            assert model is not None, "translate needs a model or a search"
            ids = beam_search(
                model,
                src,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
                beam_size=beam_size,
                alpha=alpha,
                max_len=max_len,
            )
        for index, hypothesis in zip(group, ids, strict=True):
            translations[index] = tokenizer.decode(hypothesis)
    return [translations[i] for i in range(len(sentences))]


@torch.no_grad()
def mean_token_loss(
    model: nn.Sequential | gp.DistributedGPipe,
    config: NMTConfig,
    *,
    split: str = "dev",
    max_per_lang: int | None = None,
    device: torch.device | None = None,
) -> float:
    """Cross entropy per target token (nats, no label smoothing, the model in eval mode) over
    the first ``max_per_lang`` pairs of each trained language of ``split``.

    ``model`` is the plain model, or a ``DistributedGPipe`` of it: then every rank of its
    pipeline calls this alike (collective over the pipeline group), the batches go through
    ``pipe.evaluate`` (forward only), the last stage sums the loss of the logits and every rank
    gets the mean. The pipeline's batches hold ``config.max_tokens`` tokens (the training
    mini-batch the pipeline is sized for) instead of 4096: the mean is the same, up to float
    rounding.
    """
    from apps.nmt.model import token_cross_entropy_sum

    pipe = model if isinstance(model, gp.DistributedGPipe) else None
    device = pipe.device if pipe is not None else device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in eval_batches(config.data_dir, split,
                              max_tokens=config.max_tokens if pipe is not None else 4096,
                              languages=train_languages(config), max_per_lang=max_per_lang):
        target = batch.tgt_out.to(device)
        tokens += int(target.ne(config.pad_id).sum())
        if pipe is None:
            logits = model((batch.src.to(device), batch.tgt_in.to(device)))
        else:  # logits on the last stage only; its loss is the one used (no label smoothing)
            _, logits = pipe.evaluate((batch.src, batch.tgt_in) if pipe.is_first else None,
                                      target if pipe.is_last else None, return_outputs=True)
            if not pipe.is_last:
                continue
        total += float(token_cross_entropy_sum(logits, target, pad_id=config.pad_id))
    model.train(was_training)
    if pipe is not None:
        summed = torch.tensor([total], dtype=torch.float64, device=device)
        dist.broadcast(summed, src=pipe.stage_ranks[-1], group=pipe.group)
        total = float(summed[0])
    return total / max(tokens, 1)

