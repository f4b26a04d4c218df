"""Small models for the sequentialize tests, built locally from configs (no downloaded weights).

Shared by tests/test_sequentialize.py, tests/distributed/test_sequentialize.py and
scripts/bench_sequentialize.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 101
PAD = 0


def gpt2(p: float = 0.0, *, layers: int = 4, width: int = 64) -> nn.Module:
    """Hugging Face GPT-2 with its output projection tied to the token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0,
                        eos_token_id=0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def llama(p: float = 0.0) -> nn.Module:
    """Hugging Face Llama: rotary position embeddings computed once, used by every layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attention_dropout=p, bos_token_id=0,
                         eos_token_id=0, pad_token_id=PAD)
    return LlamaForCausalLM(config)


def token_batch(batch: int = 8, length: int = 16, *, seed: int = 0) -> dict[str, Tensor]:
    """Token ids and an attention mask with left padding on some rows."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(0, batch, 3):
        mask[row, : 1 + row % 5] = 0
    return {"input_ids": ids, "attention_mask": mask}


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, p: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(2, cout)
        self.drop = nn.Dropout2d(p)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(F.relu(self.norm(self.conv(x))))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int, p: float) -> None:
        super().__init__()
        self.block = ConvBlock(cin + cout, cout, p)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.block(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    """A small U-Net: each level's input is a long skip to the matching decoder level."""

    def __init__(self, channels: tuple[int, ...] = (4, 8, 16), p: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels[0], 3, padding=1)
        levels = list(zip(channels[:-1], channels[1:], strict=True))
        self.down = nn.ModuleList(ConvBlock(a, b, p) for a, b in levels)
        self.mid = ConvBlock(channels[-1], channels[-1], p)
        self.up = nn.ModuleList(Up(b, a, p) for a, b in reversed(levels))
        self.head = nn.Conv2d(channels[0], 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        skips = []
        for block in self.down:
            skips.append(x)
            x = F.avg_pool2d(block(x), 2)
        x = self.mid(x)
        for block in self.up:
            x = block(x, skips.pop())
        return self.head(x)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.p = p
        self.query = nn.Linear(width, width)
        self.key_value = nn.Linear(width, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor) -> Tensor:
        batch, length, width = x.shape
        q = self.query(x).view(batch, length, self.heads, -1).transpose(1, 2)
        k, v = self.key_value(memory).view(batch, memory.shape[1], 2, self.heads, -1).unbind(2)
        y = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, dropout_p=self.p if self.training
                                           else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class EncoderLayer(nn.Module):
    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = Attention(width, heads, p)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(p),
                                 nn.Linear(2 * width, width))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, mask)
        return x + self.mlp(self.norm2(x))


class DecoderLayer(nn.Module):
    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(3))
        self.self_attention = Attention(width, heads, p)
        self.cross_attention = Attention(width, heads, p)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(p),
                                 nn.Linear(2 * width, width))

    def forward(self, y: Tensor, memory: Tensor, causal: Tensor, source_mask: Tensor) -> Tensor:
        h = self.norms[0](y)
        y = y + self.self_attention(h, h, causal)
        y = y + self.cross_attention(self.norms[1](y), memory, source_mask)
        return y + self.mlp(self.norms[2](y))


class Translator(nn.Module):
    """An encoder-decoder in the spirit of apps/nmt, written as an ordinary module: two inputs
    (source and target tokens), padding and causal masks, the encoder's output read by every
    decoder layer; returns (logits, encoder output).

    Source and target embeddings are separate modules whose weights are tied (a shared
    vocabulary, as in apps/nmt): the weight is used in the encoder's first layer and again in
    the decoder's.
    """

    def __init__(self, *, vocab: int = 37, width: int = 32, heads: int = 4, layers: int = 2,
                 p: float = 0.0) -> None:
        super().__init__()
        self.source_embed = nn.Embedding(vocab, width)
        self.target_embed = nn.Embedding(vocab, width)
        self.target_embed.weight = self.source_embed.weight
        self.source_position = nn.Embedding(64, width)
        self.target_position = nn.Embedding(64, width)
        self.encoder = nn.ModuleList(EncoderLayer(width, heads, p) for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(width, heads, p) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.project = nn.Linear(width, vocab)

    def forward(self, source: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        source_mask = (source != PAD)[:, None, None, :]
        positions = torch.arange(source.shape[1], device=source.device)
        x = self.source_embed(source) + self.source_position(positions)
        for layer in self.encoder:
            x = layer(x, source_mask)
        length = target.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=target.device).tril()
        y = self.target_embed(target) + self.target_position(
            torch.arange(length, device=target.device))
        for layer in self.decoder:
            y = layer(y, x, causal, source_mask)
        return self.project(self.norm(y)), x


def translation_batch(batch: int = 8, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(1, 37, (batch, 10), generator=generator)
    for row in range(0, batch, 2):
        source[row, 7 + row % 3:] = PAD
    target = torch.randint(1, 37, (batch, 9), generator=generator)
    return source, target
