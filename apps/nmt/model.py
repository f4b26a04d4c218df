"""The multilingual Transformer T(L, H, A) as one nn.Sequential of tuple-passing layers.

Layout (``transformer()`` builds it; the names are the keys of the ``nn.Sequential``)::

    embed        (src_ids [B,S] int64, tgt_in_ids [B,T] int64) -> State
    encoder_0    State -> State        updates enc_state (self-attention + feed-forward)
    ...
    encoder_{L-1}
    decoder_0    State -> State        first normalises enc_state (final encoder LayerNorm),
    ...                                then updates dec_state (causal self-attention,
    decoder_{L-1}                      cross-attention on enc_state, feed-forward)
    project      State -> logits [B,T,V]   final LayerNorm, output projection, logit clipping

    State = (enc_state [B,S,D], dec_state [B,T,D], src_pad [B,S] bool, tgt_pad [B,T] bool)

Every tensor is batch-first, each layer takes one argument and returns one value, and nothing is
kept between layers outside the tuple, so a pipeline may cut the sequence at any layer boundary
and split a batch into micro-batches along dim 0 without changing the result. ``src_pad`` /
``tgt_pad`` are True at padding positions; padded keys are masked out of every attention, so
padding never changes the outputs at real positions.

Choices, stated once:

- Pre-norm residual blocks (the default; ``norm="post"`` below), ``x + dropout(sublayer(LayerNorm(x)))``: the variant that trains
  deep stacks without a learning-rate warmup cliff, which is what the 128-layer configs need.
  Because of pre-norm, the encoder output gets a final LayerNorm (applied by ``decoder_0`` so the
  encoder layers stay identical) and the decoder output gets one (applied by ``project``).
- Attention has A heads of ``head_dim`` (64 in the paper) channels, so its width ``A * head_dim``
  may differ from the model width D: widening T(L, H, A) widens attention as in the paper.
- Sinusoidal positions computed on the fly (no parameters, no buffers, so building on the
  ``meta`` device and materialising a partition needs no special care); ``max_positions`` bounds
  the sequence length with a clear error.
- Vocabulary tables: ``share_embeddings`` uses one table for source and target tokens (one
  SentencePiece vocabulary is shared by all languages); ``tie_output`` makes the output
  projection reuse the target table. The paper's parameter counts (about 0.41B, 1.24B, 1.24B,
  3.08B, 6.04B at D=1024 and a 64k vocabulary) hold exactly two V x D tables: either separate
  source and target embeddings with the output projection tied to the target one (the paper's
  reading), or one shared embedding plus an untied output projection (our default). Both give the
  same count; the default is the one a pipeline can hold, because a tied table would be one
  parameter on the first and the last stage. Linear layers have biases, LayerNorms have weight
  and bias; together they are under 0.1% of the count.
- Stability fixes from the paper, each switchable: ``scaled_init`` multiplies the init std of
  both linear layers of every feed-forward block by ``(2L)^-1/2``, where 2L is the number of
  encoder plus decoder layers (Fixup's ``L^(-1/(2m-2))`` for a branch of m=2 layers; the paper
  gives no exponent); ``logits_abs_max`` hard-clamps the logits to ``[-max, max]``. The clamp is
  applied in training *and* evaluation, as in the framework the paper used (Lingvo's
  ``logits_abs_max``), so the evaluated function is the trained one.
- Monitoring: in training, every layer records the largest absolute value of the state it
  produced (``max_abs_activation``, a detached 0-dim tensor, so no host sync); for ``project``
  that is the largest absolute logit before clipping (also as ``max_abs_logit``), and with
  clipping on, the fraction of logits (at non-padding positions) beyond the bound
  (``clipped_fraction``). The record is a running maximum (and sum) over forwards (all
  micro-batches of a step) until ``activation_stats`` reads and resets it. For issue 21's
  stability sweep, ``stability_stats`` reads (and resets) two more records: the largest
  attention logit q.k / sqrt(head_dim) of every attention (``record_attention``, off by default; one extra
  [B,A,Lq,Lk] product per attention in training, nothing in evaluation) and the sums of
  log Z of the output softmax at non-padding positions.
- ``norm="post"`` builds the original Transformer's post-norm blocks,
  ``LayerNorm(x + dropout(sublayer(x)))``, with no final encoder or decoder LayerNorm (their
  outputs are already normalised); ``qk_norm`` adds a LayerNorm over each head's channels of the
  queries and keys; ``token_cross_entropy_sum(..., z_loss=w)`` adds ``w * (log Z)^2`` per
  token. These are the comparators of issue 21, off by default.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (enc_state [B,S,D], dec_state [B,T,D], src_pad [B,S] bool, tgt_pad [B,T] bool)
State = tuple[Tensor, Tensor, Tensor, Tensor]


def sinusoidal_positions(
    length: int, dim: int, *, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Sinusoidal position encodings ``[length, dim]`` (Vaswani et al.): sin on even, cos on odd."""
    position = torch.arange(length, device=device, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float64) * (-math.log(10000.0) / dim)
    )
    table = torch.zeros(length, dim, device=device, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return table.to(dtype)


def _allow_some_key(allowed: Tensor) -> Tensor:
    """Unmask every key of a row that would otherwise attend to nothing (an all-padding row).

    Such a row belongs to a padded query or an empty sequence; its output is never used, but a
    softmax over no keys is NaN, which would leak into gradients.
    """
    return allowed | ~allowed.any(dim=-1, keepdim=True)


class _RecordsActivation(nn.Module):
    """A layer that keeps the running max |activation| of its training forwards since last read."""

    max_abs_activation: Tensor | None

    def __init__(self) -> None:
        super().__init__()
        # a plain attribute, not a buffer: monitoring only, never saved in a state_dict
        self.max_abs_activation = None

    def _record(self, *tensors: Tensor) -> None:
        if not self.training:
            return
        with torch.no_grad():
            current = torch.stack([t.detach().abs().amax().float() for t in tensors]).amax()
            previous = self.max_abs_activation
            if previous is not None and previous.device == current.device:
                current = torch.maximum(previous, current)
            self.max_abs_activation = current


class MultiHeadAttention(nn.Module):
    """Multi-head attention with ``num_heads`` heads of ``head_dim`` channels, batch-first."""

    # the largest attention logit q.k / sqrt(head_dim) of training forwards since last read
    max_logit: Tensor | None

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int,
        head_dim: int,
        attention_dropout: float,
        qk_norm: bool = False,
        record_logits: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attention_dropout = attention_dropout
        self.record_logits = record_logits
        self.max_logit = None
        width = num_heads * head_dim
        self.query = nn.Linear(d_model, width)
        self.key = nn.Linear(d_model, width)
        self.value = nn.Linear(d_model, width)
        self.out = nn.Linear(width, d_model)
        # qk-layernorm (Dehghani et al. 2023): LayerNorm over each head's channels of the
        # queries and keys, so the logits cannot grow with the weights' norm
        self.query_norm = nn.LayerNorm(head_dim) if qk_norm else None
        self.key_norm = nn.LayerNorm(head_dim) if qk_norm else None

    def reset_parameters(self) -> None:
        for linear in (self.query, self.key, self.value, self.out):
            _init_linear(linear)
        for norm in (self.query_norm, self.key_norm):
            if norm is not None:
                norm.reset_parameters()

    def _heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def keys_values(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [B,A,Lk,head_dim] of ``memory`` [B,Lk,D] (cacheable when decoding)."""
        keys = self._heads(self.key(memory))
        if self.key_norm is not None:
            keys = self.key_norm(keys)
        return keys, self._heads(self.value(memory))

    def attend(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        allowed: Tensor,
        query_pad: Tensor | None = None,
    ) -> Tensor:
        """``query`` [B,Lq,D] attends to ``keys``/``values`` [B,A,Lk,head_dim]; ``allowed``
        [B,1,Lq|1,Lk] is True where a query may see a key. ``query_pad`` [B,Lq] (True at
        padding) only keeps padded queries out of the recorded largest logit."""
        dropout_p = self.attention_dropout if self.training else 0.0
        queries = self._heads(self.query(query))
        if self.query_norm is not None:
            queries = self.query_norm(queries)
        if self.training and self.record_logits:
            self._record_logits(queries, keys, allowed, query_pad)
        context = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=allowed, dropout_p=dropout_p
        )
        batch, _, length, _ = context.shape
        return self.out(context.transpose(1, 2).reshape(batch, length, -1))

    def _record_logits(
        self, queries: Tensor, keys: Tensor, allowed: Tensor, query_pad: Tensor | None
    ) -> None:
        """Running max of q.k / sqrt(head_dim) (the softmax's input, as scaled_dot_product_
        attention scales it) over the (query, key) pairs the mask lets through, real queries
        only. One extra [B,A,Lq,Lk] product per attention, under no_grad."""
        with torch.no_grad():
            logits = queries.detach() @ keys.detach().transpose(-2, -1) / math.sqrt(self.head_dim)
            mask = allowed.expand_as(logits)
            if query_pad is not None:
                mask = mask & ~query_pad[:, None, :, None]
            # -inf if the mask lets nothing through (read as "no value"); no host sync here
            current = logits.masked_fill(~mask, -math.inf).amax().float()
            previous = self.max_logit
            if previous is not None and previous.device == current.device:
                current = torch.maximum(previous, current)
            self.max_logit = current

    def forward(
        self, query: Tensor, memory: Tensor, allowed: Tensor, query_pad: Tensor | None = None
    ) -> Tensor:
        return self.attend(query, *self.keys_values(memory), allowed, query_pad)


class FeedForward(nn.Module):
    """Position-wise feed-forward block ``Linear(D, H) -> ReLU -> Linear(H, D)``."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, ffn_dim)
        self.down = nn.Linear(ffn_dim, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.relu(self.up(x)))


def _init_linear(linear: nn.Linear, scale: float = 1.0) -> None:
    """Normal init with std ``scale / sqrt(fan_in)`` (unit-variance outputs for unit inputs)."""
    nn.init.normal_(linear.weight, std=scale / math.sqrt(linear.in_features))
    nn.init.zeros_(linear.bias)


class Embed(_RecordsActivation):
    """Token embedding (scaled by sqrt(D)) plus sinusoidal positions for source and target.

    Takes ``(src_ids [B,S], tgt_in_ids [B,T])`` and returns the first ``State``.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        share_embeddings: bool,
        pad_id: int,
        dropout: float,
        max_positions: int,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.pad_id = pad_id
        self.max_positions = max_positions
        if share_embeddings:
            self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        else:
            self.src_tokens = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
            self.tgt_tokens = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    @property
    def source_table(self) -> nn.Embedding:
        return self.tokens if hasattr(self, "tokens") else self.src_tokens

    @property
    def target_table(self) -> nn.Embedding:
        return self.tokens if hasattr(self, "tokens") else self.tgt_tokens

    def reset_parameters(self) -> None:
        for table in {id(t): t for t in (self.source_table, self.target_table)}.values():
            # std D^-1/2 times the sqrt(D) scale below: unit-variance embeddings, and the same
            # std as an untied output projection, so a tied table suits both uses
            nn.init.normal_(table.weight, std=self.d_model**-0.5)
            with torch.no_grad():
                table.weight[self.pad_id].zero_()

    def _embed(
        self, table: nn.Embedding, ids: Tensor, side: str, offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        if ids.dim() != 2:
            raise ValueError(f"{side}_ids must be [batch, length], got shape {tuple(ids.shape)}")
        length = offset + ids.shape[1]
        if length > self.max_positions:
            raise ValueError(
                f"{side} length {length} exceeds max_positions={self.max_positions}; "
                f"filter longer sentences or raise max_positions"
            )
        weight = table.weight
        positions = sinusoidal_positions(
            length, self.d_model, device=weight.device, dtype=weight.dtype
        )[offset:]
        state = self.dropout(table(ids) * math.sqrt(self.d_model) + positions)
        return state, ids.eq(self.pad_id)

    def embed_source(self, src_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``src_ids`` [B,S] -> (enc_state [B,S,D], src_pad [B,S])."""
        return self._embed(self.source_table, src_ids, "src")

    def embed_target(self, tgt_in_ids: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """``tgt_in_ids`` [B,T] at positions ``offset...`` -> (dec_state [B,T,D], tgt_pad [B,T])."""
        return self._embed(self.target_table, tgt_in_ids, "tgt_in", offset)

    def forward(self, ids: tuple[Tensor, Tensor]) -> State:
        if not isinstance(ids, tuple | list) or len(ids) != 2:
            raise TypeError(
                "the first layer takes a tuple (src_ids [B,S], tgt_in_ids [B,T]), "
                f"got {type(ids).__name__}"
            )
        src_ids, tgt_in_ids = ids
        enc_state, src_pad = self.embed_source(src_ids)
        dec_state, tgt_pad = self.embed_target(tgt_in_ids)
        self._record(enc_state, dec_state)
        return enc_state, dec_state, src_pad, tgt_pad


NORMS = ("pre", "post")


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r} is not one of {list(NORMS)}")


class EncoderLayer(_RecordsActivation):
    """Encoder layer: self-attention then feed-forward; updates enc_state only.

    ``norm="pre"``: ``x + dropout(f(LayerNorm(x)))``; ``norm="post"`` (the original
    Transformer): ``LayerNorm(x + dropout(f(x)))``, the same LayerNorm modules in both.
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        *,
        num_heads: int,
        head_dim: int,
        dropout: float,
        attention_dropout: float,
        ffn_init_scale: float,
        norm: str = "pre",
        qk_norm: bool = False,
        record_attention: bool = False,
    ) -> None:
        super().__init__()
        _check_norm(norm)
        self.post_norm = norm == "post"
        self.ffn_init_scale = ffn_init_scale
        self.self_attn_norm = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(
            d_model, num_heads=num_heads, head_dim=head_dim, attention_dropout=attention_dropout,
            qk_norm=qk_norm, record_logits=record_attention,
        )
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for norm in (self.self_attn_norm, self.ffn_norm):
            norm.reset_parameters()
        self.self_attn.reset_parameters()
        _init_linear(self.ffn.up, self.ffn_init_scale)
        _init_linear(self.ffn.down, self.ffn_init_scale)

    def encode(self, enc_state: Tensor, src_pad: Tensor) -> Tensor:
        """One encoder layer on ``enc_state`` [B,S,D] with padding mask ``src_pad`` [B,S]."""
        allowed = _allow_some_key(~src_pad[:, None, None, :])
        if self.post_norm:
            attended = self.self_attn(enc_state, enc_state, allowed, src_pad)
            enc_state = self.self_attn_norm(enc_state + self.dropout(attended))
            return self.ffn_norm(enc_state + self.dropout(self.ffn(enc_state)))
        normed = self.self_attn_norm(enc_state)
        enc_state = enc_state + self.dropout(self.self_attn(normed, normed, allowed, src_pad))
        return enc_state + self.dropout(self.ffn(self.ffn_norm(enc_state)))

    def forward(self, state: State) -> State:
        enc_state, dec_state, src_pad, tgt_pad = state
        enc_state = self.encode(enc_state, src_pad)
        self._record(enc_state)
        return enc_state, dec_state, src_pad, tgt_pad


class LayerCache:
    """One decoder layer's state for incremental decoding: self-attention keys, values and key
    padding of the prefix so far, and the cross-attention keys and values of the memory."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.key_pad: Tensor | None = None
        self.memory_keys: Tensor | None = None
        self.memory_values: Tensor | None = None

    def extend(self, keys: Tensor, values: Tensor, key_pad: Tensor) -> tuple[Tensor, ...]:
        if self.keys is not None and self.values is not None and self.key_pad is not None:
            keys = torch.cat([self.keys, keys], dim=2)
            values = torch.cat([self.values, values], dim=2)
            key_pad = torch.cat([self.key_pad, key_pad], dim=1)
        self.keys, self.values, self.key_pad = keys, values, key_pad
        return keys, values, key_pad

    def memory_keys_values(
        self, attention: MultiHeadAttention, memory: Tensor
    ) -> tuple[Tensor, Tensor]:
        if self.memory_keys is None or self.memory_values is None:
            self.memory_keys, self.memory_values = attention.keys_values(memory)
        return self.memory_keys, self.memory_values

    def select(self, rows: Tensor) -> None:
        """Keep only ``rows`` (dim 0), in that order: beams that survived, sources still open."""
        for name in ("keys", "values", "key_pad", "memory_keys", "memory_values"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, rows))


@dataclass
class DecoderCache:
    """Incremental-decoding state of all decoder layers (``decode(..., cache=...)``)."""

    layers: list[LayerCache]
    length: int = 0  # target positions decoded so far

    def select(self, rows: Tensor) -> None:
        """Reorder / drop rows of every layer's cache (see ``LayerCache.select``)."""
        for layer in self.layers:
            layer.select(rows)


class DecoderLayer(_RecordsActivation):
    """Decoder layer: causal self-attention, cross-attention, feed-forward (``norm`` as in
    ``EncoderLayer``).

    The first decoder layer (``normalize_memory=True``) also applies the encoder's final
    LayerNorm to enc_state and passes the normalised memory on to the later decoder layers
    (pre-norm only: a post-norm encoder's output is already normalised).
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        *,
        num_heads: int,
        head_dim: int,
        dropout: float,
        attention_dropout: float,
        ffn_init_scale: float,
        normalize_memory: bool,
        norm: str = "pre",
        qk_norm: bool = False,
        record_attention: bool = False,
    ) -> None:
        super().__init__()
        _check_norm(norm)
        self.post_norm = norm == "post"
        if normalize_memory and self.post_norm:
            raise ValueError("normalize_memory=True is the pre-norm encoder's final LayerNorm; "
                             "a post-norm decoder layer takes normalize_memory=False")
        self.ffn_init_scale = ffn_init_scale
        self.memory_norm = nn.LayerNorm(d_model) if normalize_memory else None
        attention_args: dict[str, Any] = dict(
            num_heads=num_heads, head_dim=head_dim, attention_dropout=attention_dropout,
            qk_norm=qk_norm, record_logits=record_attention,
        )
        self.self_attn_norm = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, **attention_args)
        self.cross_attn_norm = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, **attention_args)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        norms = [self.self_attn_norm, self.cross_attn_norm, self.ffn_norm]
        if self.memory_norm is not None:
            norms.append(self.memory_norm)
        for norm in norms:
            norm.reset_parameters()
        for attn in (self.self_attn, self.cross_attn):
            attn.reset_parameters()
        _init_linear(self.ffn.up, self.ffn_init_scale)
        _init_linear(self.ffn.down, self.ffn_init_scale)

    def prepare_memory(self, enc_state: Tensor) -> Tensor:
        """The encoder's final LayerNorm if this is the first decoder layer, else identity."""
        return enc_state if self.memory_norm is None else self.memory_norm(enc_state)

    def decode(
        self,
        dec_state: Tensor,
        memory: Tensor,
        src_pad: Tensor,
        tgt_pad: Tensor,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """One decoder layer on ``dec_state`` [B,T,D] attending to normalised ``memory`` [B,S,D].

        With ``cache`` (incremental decoding), ``dec_state``/``tgt_pad`` hold only the new
        positions; the cache supplies the earlier positions' self-attention keys and values and
        the memory's keys and values, and is extended in place.
        """
        new_length = dec_state.shape[1]
        post = self.post_norm
        # the sub-layers' input: the state itself (post-norm) or its LayerNorm (pre-norm)
        normed = dec_state if post else self.self_attn_norm(dec_state)
        keys, values = self.self_attn.keys_values(normed)
        key_pad = tgt_pad
        if cache is not None:
            keys, values, key_pad = cache.extend(keys, values, tgt_pad)
        # query i (absolute position offset + i) sees keys 0 .. offset + i
        offset = keys.shape[2] - new_length
        causal = torch.ones(
            new_length, keys.shape[2], dtype=torch.bool, device=dec_state.device
        ).tril(diagonal=offset)
        self_allowed = _allow_some_key(causal[None, None] & ~key_pad[:, None, None, :])
        dec_state = dec_state + self.dropout(
            self.self_attn.attend(normed, keys, values, self_allowed, tgt_pad)
        )
        if post:
            dec_state = self.self_attn_norm(dec_state)
        if cache is None:
            memory_keys, memory_values = self.cross_attn.keys_values(memory)
        else:
            memory_keys, memory_values = cache.memory_keys_values(self.cross_attn, memory)
        cross_allowed = _allow_some_key(~src_pad[:, None, None, :])
        normed = dec_state if post else self.cross_attn_norm(dec_state)
        dec_state = dec_state + self.dropout(
            self.cross_attn.attend(normed, memory_keys, memory_values, cross_allowed, tgt_pad)
        )
        if post:
            dec_state = self.cross_attn_norm(dec_state)
            return self.ffn_norm(dec_state + self.dropout(self.ffn(dec_state)))
        return dec_state + self.dropout(self.ffn(self.ffn_norm(dec_state)))

    def forward(self, state: State) -> State:
        enc_state, dec_state, src_pad, tgt_pad = state
        memory = self.prepare_memory(enc_state)
        dec_state = self.decode(dec_state, memory, src_pad, tgt_pad)
        self._record(dec_state)
        return memory, dec_state, src_pad, tgt_pad


class Project(_RecordsActivation):
    """Final decoder LayerNorm, output projection to the vocabulary, and logit clipping.

    Returns logits [B,T,V] only. With ``tied_weight`` the projection reuses the target embedding
    table (one parameter in two layers: keep ``embed`` and ``project`` on the same stage).
    """

    max_abs_logit: Tensor | None
    # logits beyond the clip bound and all logits, at non-padding positions, since last read
    clipped_logits: Tensor | None
    counted_logits: Tensor | None
    # sum of log Z and of (log Z)^2 of the output softmax (of the clipped logits, the
    # softmax's input) and the count of positions, non-padding ones, since last read
    log_z_sums: Tensor | None

    def __init__(
        self,
        d_model: int,
        vocab_size: int,
        *,
        logits_abs_max: float | None,
        tied_weight: Tensor | None = None,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        self.logits_abs_max = logits_abs_max
        self.max_abs_logit = None
        self.clipped_logits = self.counted_logits = None
        self.log_z_sums = None
        # a pre-norm decoder's output needs a final LayerNorm; a post-norm one is normalised
        self.norm: nn.Module = nn.LayerNorm(d_model) if final_norm else nn.Identity()
        if tied_weight is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
            self.tied = False
        else:
            if not isinstance(tied_weight, nn.Parameter):
                raise TypeError("tied_weight must be the target embedding's nn.Parameter")
            self.weight = tied_weight
            self.tied = True
        self.bias = nn.Parameter(torch.empty(vocab_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if isinstance(self.norm, nn.LayerNorm):
            self.norm.reset_parameters()
        if not self.tied:  # a tied table is initialised by its owner, Embed
            nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)
        nn.init.zeros_(self.bias)

    def logits(self, dec_state: Tensor, tgt_pad: Tensor | None = None) -> Tensor:
        """``dec_state`` [..., D] -> (clipped) logits [..., V]. In training, ``tgt_pad`` [...]
        (True at padding) restricts the count of clipped logits to real target positions."""
        logits = F.linear(self.norm(dec_state), self.weight, self.bias)
        # the output layer's "activation" is its logits, recorded before clipping
        self._record(logits)
        if self.training:
            self.max_abs_logit = self.max_abs_activation
            if self.logits_abs_max is not None:
                self._count_clipped(logits, tgt_pad)
        if self.logits_abs_max is not None:
            logits = logits.clamp(-self.logits_abs_max, self.logits_abs_max)
        if self.training:
            self._sum_log_z(logits, tgt_pad)
        return logits

    def _sum_log_z(self, logits: Tensor, tgt_pad: Tensor | None) -> None:
        with torch.no_grad():
            log_z = torch.logsumexp(_loss_precision(logits.detach()), dim=-1)
            if tgt_pad is not None:
                log_z = log_z[~tgt_pad]
            sums = torch.stack([log_z.sum(), log_z.square().sum(),
                                torch.tensor(float(log_z.numel()), device=log_z.device,
                                             dtype=log_z.dtype)]).double()
            if self.log_z_sums is not None and self.log_z_sums.device == sums.device:
                sums = sums + self.log_z_sums
            self.log_z_sums = sums

    def _count_clipped(self, logits: Tensor, tgt_pad: Tensor | None) -> None:
        assert self.logits_abs_max is not None
        with torch.no_grad():
            beyond = logits.detach().abs() > self.logits_abs_max
            if tgt_pad is not None:
                beyond = beyond[~tgt_pad]
            clipped = beyond.sum()
            counted = torch.tensor(beyond.numel(), device=logits.device)
            if self.clipped_logits is not None and self.clipped_logits.device == clipped.device:
                clipped, counted = clipped + self.clipped_logits, counted + self.counted_logits
            self.clipped_logits, self.counted_logits = clipped, counted

    def forward(self, state: State) -> Tensor:
        _, dec_state, _, tgt_pad = state
        return self.logits(dec_state, tgt_pad)


def transformer(
    *,
    num_layers: int,
    d_model: int,
    ffn_dim: int,
    num_heads: int,
    head_dim: int = 64,
    vocab_size: int,
    dropout: float = 0.1,
    attention_dropout: float = 0.0,
    share_embeddings: bool = True,
    tie_output: bool = False,
    scaled_init: bool = True,
    logits_abs_max: float | None = 20.0,
    max_positions: int = 256,
    pad_id: int = 0,
    norm: str = "pre",
    qk_norm: bool = False,
    record_attention: bool = False,
) -> nn.Sequential:
    """T(num_layers, ffn_dim, num_heads) at width ``d_model`` as one ``nn.Sequential``.

    Build it under ``with torch.device("meta"):`` to count parameters without memory; call each
    layer's ``reset_parameters()`` after materialising it (``to_empty``) to initialise it.
    """
    _check_norm(norm)
    ffn_init_scale = (2 * num_layers) ** -0.5 if scaled_init else 1.0
    layer_args: dict[str, Any] = dict(
        num_heads=num_heads,
        head_dim=head_dim,
        dropout=dropout,
        attention_dropout=attention_dropout,
        ffn_init_scale=ffn_init_scale,
        norm=norm,
        qk_norm=qk_norm,
        record_attention=record_attention,
    )
    embed = Embed(
        vocab_size,
        d_model,
        share_embeddings=share_embeddings,
        pad_id=pad_id,
        dropout=dropout,
        max_positions=max_positions,
    )
    layers: list[tuple[str, nn.Module]] = [("embed", embed)]
    for index in range(num_layers):
        layers.append((f"encoder_{index}", EncoderLayer(d_model, ffn_dim, **layer_args)))
    for index in range(num_layers):
        layers.append(
            (
                f"decoder_{index}",
                DecoderLayer(d_model, ffn_dim, normalize_memory=index == 0 and norm == "pre",
                             **layer_args),
            )
        )
    tied = embed.target_table.weight if tie_output else None
    project = Project(d_model, vocab_size, logits_abs_max=logits_abs_max, tied_weight=tied,
                      final_norm=norm == "pre")
    layers.append(("project", project))
    return nn.Sequential(OrderedDict(layers))


@dataclass(frozen=True)
class Parts:
    """The model's layers grouped by role (the same module objects, not copies)."""

    embed: Embed
    encoders: list[EncoderLayer]
    decoders: list[DecoderLayer]
    project: Project


def parts(model: nn.Sequential) -> Parts:
    """Group the layers of a ``transformer()`` model by role, checking the expected order."""
    layers = list(model)
    num_encoders = sum(isinstance(layer, EncoderLayer) for layer in layers)
    num_decoders = sum(isinstance(layer, DecoderLayer) for layer in layers)
    expected = [Embed] + [EncoderLayer] * num_encoders + [DecoderLayer] * num_decoders + [Project]
    if [type(layer) for layer in layers] != expected or num_decoders == 0:
        found = [type(layer).__name__ for layer in layers]
        raise TypeError(
            f"expected a whole transformer() model (embed, encoders, decoders, project), got "
            f"layers {found}; pass the complete nn.Sequential, not a pipeline partition"
        )
    return Parts(
        embed=layers[0],  # type: ignore[arg-type]
        encoders=layers[1 : 1 + num_encoders],  # type: ignore[arg-type]
        decoders=layers[1 + num_encoders : -1],  # type: ignore[arg-type]
        project=layers[-1],  # type: ignore[arg-type]
    )


def encode(model: nn.Sequential, src_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Run embed + encoder layers: ``src_ids`` [B,S] -> (memory [B,S,D], src_pad [B,S]).

    ``memory`` is already normalised by the first decoder layer's ``prepare_memory``, so
    ``decode`` can reuse it at every step; the result equals what ``model`` computes internally.
    """
    roles = parts(model)
    enc_state, src_pad = roles.embed.embed_source(src_ids)
    for layer in roles.encoders:
        enc_state = layer.encode(enc_state, src_pad)
    return roles.decoders[0].prepare_memory(enc_state), src_pad


def new_decoder_cache(model: nn.Sequential) -> DecoderCache:
    """An empty key/value cache for incremental ``decode`` with ``model``."""
    return DecoderCache([LayerCache() for _ in parts(model).decoders])


def decode(
    model: nn.Sequential,
    memory: Tensor,
    src_pad: Tensor,
    tgt_in_ids: Tensor,
    *,
    last_only: bool = False,
    cache: DecoderCache | None = None,
) -> Tensor:
    """Run decoder layers + project on a target prefix: -> logits [B,T,V] (or [B,V] if last_only).

    Without ``cache`` the decoder runs over the whole prefix ``tgt_in_ids``. With a cache from
    ``new_decoder_cache`` (inference), pass only the tokens not decoded yet; their positions
    continue after ``cache.length`` and the cache grows by them. Both paths run the same layer
    code and give the same logits.
    """
    roles = parts(model)
    offset = cache.length if cache is not None else 0
    dec_state, tgt_pad = roles.embed.embed_target(tgt_in_ids, offset)
    for index, layer in enumerate(roles.decoders):
        layer_cache = cache.layers[index] if cache is not None else None
        dec_state = layer.decode(dec_state, memory, src_pad, tgt_pad, layer_cache)
    if cache is not None:
        cache.length += tgt_in_ids.shape[1]
    if last_only:
        dec_state = dec_state[:, -1]
    return roles.project.logits(dec_state)


def _loss_precision(logits: Tensor) -> Tensor:
    """At least float32 for the softmax (bf16/fp16 logits are upcast; float64 stays float64)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def z_loss_sum(logits: Tensor, target_ids: Tensor, *, pad_id: int) -> Tensor:
    """Sum of (log Z)^2 over the non-padding target positions, Z the output softmax's
    normaliser (the z-loss of Mesh TensorFlow / PaLM, before its weight)."""
    log_z = torch.logsumexp(_loss_precision(logits), dim=-1)
    return log_z.square()[target_ids.ne(pad_id)].sum()


def token_cross_entropy(
    logits: Tensor,
    target_ids: Tensor,
    *,
    pad_id: int,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> Tensor:
    """Mean label-smoothed cross entropy over the non-padding target tokens, plus ``z_loss``
    times the mean (log Z)^2 over them when ``z_loss`` > 0.

    ``logits`` [B,T,V], ``target_ids`` [B,T] (the target shifted left: predictions of
    ``tgt_in_ids``). Micro-batches hold different token counts, so the mean of their means is
    not the batch mean: for pipelines use ``token_cross_entropy_sum`` and divide by the batch's
    token count.
    """
    loss = F.cross_entropy(
        _loss_precision(logits.flatten(0, 1)),
        target_ids.flatten(),
        ignore_index=pad_id,
        label_smoothing=label_smoothing,
    )
    if z_loss:
        tokens = target_ids.ne(pad_id).sum().clamp(min=1)
        loss = loss + z_loss * z_loss_sum(logits, target_ids, pad_id=pad_id) / tokens
    return loss


def token_cross_entropy_sum(
    logits: Tensor,
    target_ids: Tensor,
    *,
    pad_id: int,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> Tensor:
    """Summed label-smoothed cross entropy over the non-padding target tokens, plus ``z_loss``
    times the summed (log Z)^2 (divide by the mini-batch's token count yourself, so
    micro-batches add up to the full-batch mean)."""
    loss = F.cross_entropy(
        _loss_precision(logits.flatten(0, 1)),
        target_ids.flatten(),
        ignore_index=pad_id,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    if z_loss:
        loss = loss + z_loss * z_loss_sum(logits, target_ids, pad_id=pad_id)
    return loss


def _recording_layers(module: nn.Module) -> Iterator[tuple[str, _RecordsActivation]]:
    for name, layer in module.named_modules():
        if isinstance(layer, _RecordsActivation):
            yield name, layer


def activation_stats(module: nn.Module, *, reset: bool = True) -> dict[str, float]:
    """Largest |activation| per layer (and |logit| before clipping) since the last read.

    Works on the whole model or on one pipeline partition. Keys are
    ``"<layer>/max_abs_activation"`` and ``"project/max_abs_logit"``; layers that have not run a
    training forward since the last read are left out. Reading syncs with the device, so call it
    at logging time only.
    """
    stats: dict[str, float] = {}
    for name, layer in _recording_layers(module):
        if layer.max_abs_activation is not None:
            # the output layer's activation is its pre-clip logits: name it as such
            kind = "max_abs_logit" if isinstance(layer, Project) else "max_abs_activation"
            stats[f"{name}/{kind}"] = float(layer.max_abs_activation)
        if isinstance(layer, Project) and layer.counted_logits is not None:
            assert layer.clipped_logits is not None
            fraction = float(layer.clipped_logits) / max(int(layer.counted_logits), 1)
            stats[f"{name}/clipped_fraction"] = fraction
        if reset:
            layer.max_abs_activation = None
            if isinstance(layer, Project):
                layer.max_abs_logit = layer.clipped_logits = layer.counted_logits = None
    return stats


def stability_stats(module: nn.Module, *, reset: bool = True) -> dict[str, float]:
    """What issue 21's stability sweep measures, since the last read (training forwards only):

    - ``"<layer>.<self_attn|cross_attn>/max_attention_logit"``: the largest q.k / sqrt(head_dim)
      over real queries and the keys they may see (the softmax's input);
    - ``"<project>/log_z_sum"``, ``"/log_z_sq_sum"``, ``"/log_z_count"``: sums of log Z and
      (log Z)^2 of the output softmax (of the clipped logits) over non-padding target positions,
      and their count: sums, so that stages, micro-batches and replicas add up.

    Works on the whole model or one partition; keys use its module names. ``activation_stats``
    keeps the largest |logit| and the clipped fraction. Reading syncs with the device.
    """
    stats: dict[str, float] = {}
    for name, layer in module.named_modules():
        if isinstance(layer, MultiHeadAttention):
            if layer.max_logit is not None and math.isfinite(float(layer.max_logit)):
                stats[f"{name}/max_attention_logit"] = float(layer.max_logit)
            if reset:
                layer.max_logit = None
        elif isinstance(layer, Project):
            if layer.log_z_sums is not None:
                total, squares, count = (float(v) for v in layer.log_z_sums)
                stats[f"{name}/log_z_sum"] = total
                stats[f"{name}/log_z_sq_sum"] = squares
                stats[f"{name}/log_z_count"] = count
            if reset:
                layer.log_z_sums = None
    return stats


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied table counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())
