"""Per-step stability measurements of a pipelined run, gathered from every stage (issue 21).

``apps.nmt.model.stability_stats`` reads one partition's records; ``gather_stability`` puts the
partitions together on every rank, so rank 0 can write them to ``log.jsonl``:

- ``attn_logit_enc`` [L], ``attn_logit_dec_self`` [L], ``attn_logit_dec_cross`` [L]: the
  largest attention logit q.k / sqrt(head_dim) of each encoder self-attention and each decoder
  self- and cross-attention in the step (over real queries and the keys they may see);
  ``max_attention_logit``: the largest of them;
- ``mean_log_z``: mean log Z of the output softmax over the step's target tokens (of the
  clipped logits: the softmax the loss sees), ``mean_log_z_sq``: mean (log Z)^2;
- with a z-loss of weight w, ``z_loss_term`` = w * mean (log Z)^2: the part of the logged loss
  that is z-loss, so that ``loss - z_loss_term`` is the cross entropy.

The largest |logit| before clipping and the clipped fraction come from ``train.step_stats``.
Two small all-reduces per step (a max for the attention logits, a sum for log Z).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

import gpipe_core as gp
from apps.nmt.model import stability_stats

_ATTENTION = re.compile(r"(encoder|decoder)_(\d+)\.(self_attn|cross_attn)$")


def attention_index(name: str, num_layers: int) -> int | None:
    """Slot of an attention module in the vector [enc self x L, dec self x L, dec cross x L]
    from its module name (``...encoder_3.self_attn``), or None if the name is no attention's."""
    match = _ATTENTION.search(name.removesuffix("/max_attention_logit"))
    if match is None:
        return None
    kind, index, which = match.group(1), int(match.group(2)), match.group(3)
    if kind == "encoder":
        return index
    return (num_layers if which == "self_attn" else 2 * num_layers) + index


def split_stats(local: dict[str, float], num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One partition's ``stability_stats`` as (attention maxima [3L], -inf where absent;
    log Z sums [3])."""
    maxima = torch.full((3 * num_layers,), -math.inf, dtype=torch.float64)
    sums = torch.zeros(3, dtype=torch.float64)
    for key, value in local.items():
        if key.endswith("/max_attention_logit"):
            slot = attention_index(key, num_layers)
            if slot is None:
                raise ValueError(f"attention record {key!r} names no encoder_N/decoder_N layer")
            maxima[slot] = max(float(maxima[slot]), value)
        elif key.endswith("/log_z_sum"):
            sums[0] += value
        elif key.endswith("/log_z_sq_sum"):
            sums[1] += value
        elif key.endswith("/log_z_count"):
            sums[2] += value
    return maxima, sums


def combine(maxima: torch.Tensor, sums: torch.Tensor, num_layers: int, *, z_loss: float,
            record_attention: bool) -> dict[str, object]:
    """The log record from the reduced vectors (absent values as None)."""
    record: dict[str, object] = {}
    if record_attention:
        values = [float(v) if math.isfinite(float(v)) else None for v in maxima]
        layers = num_layers
        record["attn_logit_enc"] = values[:layers]
        record["attn_logit_dec_self"] = values[layers:2 * layers]
        record["attn_logit_dec_cross"] = values[2 * layers:]
        present = [v for v in values if v is not None]
        record["max_attention_logit"] = max(present) if present else None
    count = float(sums[2])
    if count > 0:
        record["mean_log_z"] = float(sums[0]) / count
        record["mean_log_z_sq"] = float(sums[1]) / count
        if z_loss:
            record["z_loss_term"] = z_loss * float(sums[1]) / count
    return record


def gather_stability(pipe: gp.DistributedGPipe, *, num_layers: int, device: torch.device,
                     z_loss: float, record_attention: bool) -> dict[str, object]:
    """This step's stability record on every rank (collective: every rank calls it)."""
    maxima, sums = split_stats(stability_stats(pipe), num_layers)
    maxima, sums = maxima.to(device), sums.to(device)
    with gp.collectives("stability statistics"):
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return combine(maxima.cpu(), sums.cpu(), num_layers, z_loss=z_loss,
                   record_attention=record_attention)
