"""Step time of a sequentialized GPT-2 against the same model written by hand as a Sequential.

Both run through ``gp.GPipe`` with the same weights, balance, micro-batches and checkpoint mode;
the hand-written one is what a user would write without ``gp.sequentialize``: an embedding
layer (token and position embeddings, Hugging Face's own causal mask), one layer per
``GPT2Block``, and a head, passing (hidden, mask, positions, tied weight) between layers (the
tied output projection rides along, as the sequentialized model's does, since GPipe keeps a
shared parameter in one partition). Before timing, the two are checked to give the same
output.

Paired rounds: each round times one training step (forward, loss, backward) of each, in
alternating order; the result is the median over rounds of (sequentialized / hand-written).
Writes the rounds, the median ratio and ``scripts.harness.provenance`` (commit, machine, load
average before and after) to ``--json`` (default docs/reproduction/bench_sequentialize.json).

    python scripts/bench_sequentialize.py [--rounds 30] [--stages 2] [--chunks 4] [--draft]
                                          [--tiny]   # a tiny model, for tests
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gpipe_core as gp
from scripts.harness import PUBLISHED, add_draft_argument, provenance, set_draft, write_json


def build_gpt2(*, layers: int, width: int, vocab: int, length: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab,
                        n_positions=length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Embed(nn.Module):
    """Token and position embeddings and the attention mask, as GPT2Model.forward makes them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.wte = model.transformer.wte
        self.wpe = model.transformer.wpe
        self.drop = model.transformer.drop
        self.config = model.config

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Any, ...]:
        from transformers.masking_utils import create_causal_mask

        ids, attention_mask = batch
        embeds = self.wte(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        hidden = self.drop(embeds + self.wpe(positions))
        mask = create_causal_mask(config=self.config, inputs_embeds=embeds,
                                  attention_mask=attention_mask, cache=None,
                                  position_ids=positions)
        return hidden, mask, positions, self.wte.weight


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, state: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, mask, positions, weight = state
        hidden = self.block(hidden, None, mask, None, use_cache=False, position_ids=positions)
        return hidden, mask, positions, weight


class Head(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f = model.transformer.ln_f

    def forward(self, state: tuple[Any, ...]) -> dict[str, Tensor]:
        hidden, _, _, weight = state
        return {"logits": F.linear(self.ln_f(hidden), weight)}


def hand_written(model: nn.Module) -> nn.Sequential:
    return nn.Sequential(Embed(model), *(Block(b) for b in model.transformer.h), Head(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for tests")
    parser.add_argument("--json", default=str(PUBLISHED / "bench_sequentialize.json"))
    add_draft_argument(parser)
    options = parser.parse_args()
    set_draft(options.draft)
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = (dict(layers=2, width=32, vocab=50, length=16) if options.tiny else
             dict(layers=6, width=256, vocab=2048, length=128))
    model = build_gpt2(**shape)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, shape["vocab"], (options.batch, shape["length"]), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # one row with left padding: the mask is a real input
    targets = torch.roll(ids, -1, dims=1)
    seq = gp.sequentialize(model, (), {"input_ids": ids, "attention_mask": mask,
                                       "use_cache": False})
    hand = hand_written(model)
    assert len(seq) == len(hand), (len(seq), len(hand))
    balance = gp.balance_by_params(seq, options.stages)
    pipes = {
        "sequentialized": (gp.GPipe(seq, balance, chunks=options.chunks),
                           seq.inputs(input_ids=ids, attention_mask=mask)),
        "hand_written": (gp.GPipe(hand, balance, chunks=options.chunks), (ids, mask)),
    }
    with torch.no_grad():
        outputs = [pipe(inputs)["logits"] for pipe, inputs in pipes.values()]
    difference = (outputs[0] - outputs[1]).abs().max().item()
    assert difference <= 1e-5, f"the two models differ by {difference}"

    def step(name: str) -> float:
        pipe, inputs = pipes[name]
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = pipe(inputs)["logits"]
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        return time.perf_counter() - start

    for _ in range(options.warmup):
        step("sequentialized")
        step("hand_written")
    rounds = []
    for index in range(options.rounds):
        order = ["sequentialized", "hand_written"][:: 1 if index % 2 == 0 else -1]
        times = {name: step(name) for name in order}
        rounds.append({**times, "ratio": times["sequentialized"] / times["hand_written"]})
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "what": "training-step time of gp.sequentialize(GPT2LMHeadModel) vs the same model "
                "hand-written as an nn.Sequential, both through gp.GPipe; paired rounds",
        "model": {**shape, "batch": options.batch, "dtype": "float32", "tied_head": True},
        "stages": options.stages, "chunks": options.chunks, "balance": list(balance),
        "layers": len(seq), "threads": 1, "max_output_difference": difference,
        "median_seconds": {name: statistics.median(r[name] for r in rounds)
                           for name in pipes},
        "median_ratio": ratio,
        "overhead_percent": 100 * (ratio - 1),
        "shared_machine": "the 2 CPU cores were shared with other jobs while this ran; see "
                          "the load averages in provenance",
        "rounds": rounds,
        "provenance": provenance(load_before),
    }
    path = write_json(options.json, result)
    print(f"sequentialized / hand-written: median ratio {ratio:.4f} over {len(rounds)} rounds "
          f"({100 * (ratio - 1):+.2f}%); wrote {path}")


if __name__ == "__main__":
    main()
