"""Greedy decoding and beam search through a ``DistributedGPipe`` of the NMT model, each rank
running only its own stage's layers, with a key/value cache per decoder layer on its stage.

Every rank of the pipeline calls :func:`pipelined_beam_search` with the same source batch. The
source is encoded once through the stages; each decoding step then carries the newest
tokens' decoder states through them, and the last stage broadcasts the step's log-probabilities
to every rank, so that all ranks run the same search (``apps.nmt.search.greedy_decode`` /
``beam_decode``, the one-process code) on the same numbers and agree on which rows survive::

    encode:  stage 0: embed, encoders --enc_state--> stage 1: encoders, prepare_memory
             --memory--> ... stage K-1          (memory kept by every stage with decoders)
    step t:  stage 0: embed token t, decoders (cache) --dec_state--> ... --> stage K-1:
             decoders (cache), project, log_softmax --broadcast log-probs--> every stage

The layers and the search are the plain model's, so the hypotheses equal
``apps.nmt.search.beam_search`` on the merged model (the tests check it token for token). The
messages are point to point between neighbouring stages, outside ``pipe.step``: call it between
steps, on every rank of the pipeline group, with the pipe in eval mode (it sets and restores it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

import gpipe_core as gp
from apps.nmt.model import DecoderLayer, Embed, EncoderLayer, LayerCache, Project
from apps.nmt.search import StepFn, beam_decode, greedy_decode

if TYPE_CHECKING:
    from apps.common import Run
    from apps.nmt.config import NMTConfig
    from apps.nmt.evaluate import LoadedCheckpoint

__all__ = ["load_pipeline", "pipeline_search", "pipelined_beam_search", "pipelined_step_fn"]


def pipelined_step_fn(pipe: gp.DistributedGPipe, src_ids: Tensor, *, vocab_size: int,
                      pad_id: int) -> StepFn:
    """Encode ``src_ids`` [B,S] (the same on every rank) through the pipeline; return the
    decoder step (``apps.nmt.search.StepFn``) that runs this rank's decoder layers with a cache.
    """
    layers = list(pipe)
    embed = next((layer for layer in layers if isinstance(layer, Embed)), None)
    encoders = [layer for layer in layers if isinstance(layer, EncoderLayer)]
    decoders = [layer for layer in layers if isinstance(layer, DecoderLayer)]
    project = next((layer for layer in layers if isinstance(layer, Project)), None)
    if pipe.is_first != (embed is not None) or pipe.is_last != (project is not None):
        raise TypeError("expected a pipeline of an apps.nmt transformer() model (embed on the "
                        "first stage, project on the last)")
    first_decoder_here = bool(decoders) and decoders[0].memory_norm is not None
    # the first decoder layer normalises the encoder's output: stages before it pass enc_state
    # on, stages from it on pass the memory
    stage, num_stages = pipe.stage_index, pipe.num_stages
    previous = pipe.stage_ranks[stage - 1] if stage > 0 else None
    following = pipe.stage_ranks[stage + 1] if stage + 1 < num_stages else None
    device = pipe.device
    dtype = next(pipe.parameters()).dtype
    src_ids = src_ids.to(device)
    batch, src_len = src_ids.shape
    width = _model_width(layers)

    # --- encode: once, through every stage -------------------------------------------------
    if embed is not None:
        state, src_pad = embed.embed_source(src_ids)
    else:
        state = torch.empty(batch, src_len, width, dtype=dtype, device=device)
        dist.recv(state, src=previous, group=pipe.group)
        src_pad = src_ids.eq(pad_id)
    for encoder in encoders:
        state = encoder.encode(state, src_pad)
    if first_decoder_here:
        state = decoders[0].prepare_memory(state)
    if following is not None:
        dist.send(state.contiguous(), dst=following, group=pipe.group)
    memory = state  # used only by stages that hold decoder layers (all after prepare_memory)
    caches = [LayerCache() for _ in decoders]
    length = 0  # target positions decoded so far

    def step(prefix: Tensor, source: Tensor, parent: Tensor | None) -> Tensor:
        nonlocal length, caches
        if parent is not None:
            for cache in caches:
                cache.select(parent)
        new_tokens = prefix[:, length:].to(device)
        if new_tokens.shape[1] != 1:
            raise ValueError(f"pipelined decoding expects one new token per step, got a prefix "
                             f"of {prefix.shape[1]} after {length} decoded positions")
        rows = new_tokens.shape[0]
        tgt_pad = new_tokens.eq(pad_id)
        if embed is not None:
            dec_state, tgt_pad = embed.embed_target(new_tokens, length)
        else:
            dec_state = torch.empty(rows, 1, width, dtype=dtype, device=device)
            dist.recv(dec_state, src=previous, group=pipe.group)
        source = source.to(device)
        for decoder, cache in zip(decoders, caches, strict=True):
            dec_state = decoder.decode(dec_state, memory[source], src_pad[source], tgt_pad,
                                       cache)
        length += 1
        log_probs = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        if following is not None:
            dist.send(dec_state.contiguous(), dst=following, group=pipe.group)
        else:
            assert project is not None
            log_probs = project.logits(dec_state[:, -1]).float().log_softmax(dim=-1)
        dist.broadcast(log_probs, src=pipe.stage_ranks[-1], group=pipe.group)
        return log_probs

    return step


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
) -> list[list[int]]:
    """``apps.nmt.search.beam_search`` through the pipeline: token ids per sentence of the
    padded batch ``src_ids`` [B,S] (no BOS/EOS), the same on every rank. Collective over the
    pipeline group; every rank passes the same arguments. ``beam_size=1`` is greedy decoding.
    """
    was_training = pipe.training
    pipe.eval()
    try:
        step = pipelined_step_fn(pipe, src_ids, vocab_size=vocab_size, pad_id=pad_id)
        common = dict(batch_size=src_ids.shape[0], bos_id=bos_id, eos_id=eos_id,
                      max_len=max_len, device=pipe.device)
        if beam_size == 1:
            return greedy_decode(step, **common)  # type: ignore[arg-type]
        return beam_decode(step, beam_size=beam_size, alpha=alpha, **common)  # type: ignore[arg-type]
    finally:
        pipe.train(was_training)


# ---------------------------------------------------------------------------------------------
# A checkpoint as a pipeline under torchrun


def saved_balance(checkpoint: Path, num_stages: int) -> list[int] | None:
    """The balance the checkpoint was trained with, if it had ``num_stages`` stages (its shards
    are then one per stage, and each rank reads only its own)."""
    try:
        state = torch.load(checkpoint / "train-state-rank000.pt", map_location="cpu",
                           weights_only=False, mmap=True)  # the balance, not the optimizer
        balance = [int(n) for n in state.get("balance") or []]
    except Exception:  # noqa: BLE001 - no usable train state: split by parameters
        return None
    return balance if len(balance) == num_stages else None


def _no_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    raise TypeError("decoding runs no training step")


def load_pipeline(loaded: LoadedCheckpoint, *, device: str = "cpu",
                  num_stages: int | None = None) -> tuple[gp.DistributedGPipe, Run]:
    """Under torchrun: process groups and this rank's stage of the checkpoint's model, one
    pipeline of ``num_stages`` (default: the world size). Built on the ``meta`` device; only
    this stage's weights are loaded: its own shard when the checkpoint's balance has
    ``num_stages`` stages, else the layers are split by parameters and read from every shard.
    """
    from apps.common import setup_run
    from apps.nmt.config import build_model

    config = loaded.config
    num_stages = num_stages or int(os.environ["WORLD_SIZE"])
    run = setup_run(num_stages=num_stages, device=device, timeout_s=config.timeout_s)
    model = build_model(config, device="meta")
    balance = saved_balance(loaded.path, num_stages) or gp.balance_by_params(model, num_stages)
    pipe = gp.DistributedGPipe(model, balance, chunks=1, loss_fn=_no_loss, device=run.device,
                               group=run.pipeline_group, seed=config.seed,
                               timeout_s=config.timeout_s)
    pipe.load_checkpoint(loaded.path)
    return pipe, run


def pipeline_search(pipe: gp.DistributedGPipe, config: NMTConfig, *, beam_size: int,
                    alpha: float) -> Callable[[Tensor, int], list[list[int]]]:
    """``search(src_ids, max_len)`` for ``apps.nmt.evaluate.translate``: beam search (greedy
    for ``beam_size=1``) through ``pipe``; every rank of the pipeline must call it alike."""

    def search(src_ids: Tensor, max_len: int) -> list[list[int]]:
        return pipelined_beam_search(pipe, src_ids, vocab_size=config.vocab_size,
                                     pad_id=config.pad_id, bos_id=config.bos_id,
                                     eos_id=config.eos_id, beam_size=beam_size, alpha=alpha,
                                     max_len=max_len)

    return search
