"""The paper's two model families at CPU scale, shared by the systems reproduction scripts.

Table 1 grows AmoebaNet-D in (L, D) and the Transformer in depth at fixed width; Table 2 runs
one AmoebaNet-D and one deep Transformer. Both come from the apps (``apps.amoebanet``,
``apps.nmt``), built on the ``meta`` device so that a process allocates only what it trains.
A :class:`Family` bundles what an experiment needs: the size ladder, a builder, a fixed batch,
the loss and the paper's optimiser (RMSProp for AmoebaNet, Adam for the Transformer).

The CPU scale: AmoebaNet-D on 32x32 RGB images with a stride-1 stem (its normal cells then
run at 8x8, 4x4 and 2x2, as the paper's 224-pixel input with a stride-2 stem runs at 28, 14
and 7 after its own stem), batch 32; the same on 56x56 images (``amoebanet_56px``, cells at
14x14, 7x7 and 4x4), whose activations outweigh its parameters as the paper's do (6.8:1 in
memory for the naive model near Table 1's budget, AmoebaNet-D(6, 80): 426 MB of live
activation tensors against 63 MB of parameter memory; about 1.6:1 at 32x32); the
Transformer at d_model 256, feed-forward 1024, 4 heads, vocabulary 8000, batch 16 sentence
pairs of 32 tokens each side.

:func:`layer_sizes` measures, without allocating anything, what each layer keeps for backward
(autograd's saved tensors, counted on ``meta``), its input and its parameters: the sizes the
memory-aware balance, ``gp.simulate`` and ``gp.plan`` take.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental import _config as fx_config

from apps.amoebanet.model import build_amoebanet
from apps.nmt.model import token_cross_entropy, transformer
from gpipe_core.microbatch import flatten, map_tensors
from scripts.harness import LiveTensorBytes

Size = dict[str, int]
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Family:
    """One model family of the paper at CPU scale."""

    name: str
    ladder: list[Size]  # sizes in growing order: each entry grows one dimension of the last
    build: Callable[[Size], nn.Sequential]  # on the meta device
    batch: Callable[[int], tuple[Any, Tensor]]  # batch size -> (inputs, targets), seeded
    loss_fn: Callable[[Any, Tensor], Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    batch_size: int
    # the step of each dimension on the fine ladder between two adjacent ladder entries
    # (reproduce_memory's brackets); a dimension not named is not refined
    fine_steps: Mapping[str, int] = field(default_factory=dict)

    def describe(self, size: Size) -> str:
        return ", ".join(f"{k}={v}" for k, v in size.items())


# --- AmoebaNet-D ----------------------------------------------------------------------------

AMOEBA_IMAGE = 32
AMOEBA_LARGE_IMAGE = 56  # the activation-heavy input of Table 1


def build_amoeba(size: Size) -> nn.Sequential:
    return build_amoebanet("meta", genotype="D", num_normal_cells=size["L"], filters=size["D"],
                           num_classes=10, in_chans=3, stem_stride=1)


def amoeba_batch(batch_size: int, image: int = AMOEBA_IMAGE) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, image, image, generator=g)
    return images, torch.randint(0, 10, (batch_size,), generator=g)


def amoeba_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)


def rmsprop(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # The AmoebaNet reference: decay 0.9, momentum 0.9, epsilon 1.0 (two state tensors/param).
    return torch.optim.RMSprop(params, lr=1e-3, alpha=0.9, momentum=0.9, eps=1.0,
                               weight_decay=4e-5)


def amoeba_ladder(filters: list[int], depths: list[int]) -> list[Size]:
    """Grow D at the first depth, then L at the last width: every step grows one dimension,
    so the memory a step needs grows along the ladder (what the search's bisection needs)."""
    ladder = [{"L": depths[0], "D": d} for d in filters]
    ladder += [{"L": n, "D": filters[-1]} for n in depths[1:]]
    return ladder


# --- Transformer ----------------------------------------------------------------------------

NMT_WIDTH = {"d_model": 256, "ffn_dim": 1024, "num_heads": 4, "vocab_size": 8000}
SMALL_NMT_WIDTH = {"d_model": 128, "ffn_dim": 512, "num_heads": 2, "vocab_size": 4000}  # the app's CPU default
TINY_NMT_WIDTH = {"d_model": 32, "ffn_dim": 64, "num_heads": 2, "vocab_size": 500}
NMT_SEQ = 32


def build_nmt(size: Size, width: dict[str, int] = NMT_WIDTH) -> nn.Sequential:
    with torch.device("meta"):
        return transformer(num_layers=size["L"], head_dim=width["d_model"] // width["num_heads"],
                           d_model=width["d_model"], ffn_dim=width["ffn_dim"],
                           num_heads=width["num_heads"], vocab_size=width["vocab_size"],
                           dropout=0.1, max_positions=NMT_SEQ + 1)


def nmt_batch(batch_size: int, vocab: int = NMT_WIDTH["vocab_size"], seq: int = NMT_SEQ
              ) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (batch_size, seq), generator=g)
    tgt = torch.randint(4, vocab, (batch_size, seq + 1), generator=g)
    return (src, tgt[:, :-1]), tgt[:, 1:]


def nmt_loss(logits: Tensor, target_ids: Tensor) -> Tensor:
    return token_cross_entropy(logits, target_ids, pad_id=0, label_smoothing=0.1)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98))  # two state tensors/param


AMOEBA_LADDER = amoeba_ladder([8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256],
                              [6, 9, 12, 18, 24, 36, 48])
AMOEBA_FINE_STEPS = {"D": 16, "L": 1}
FAMILIES: dict[str, Family] = {
    "amoebanet": Family("amoebanet", AMOEBA_LADDER, build_amoeba, amoeba_batch, amoeba_loss,
                        rmsprop, batch_size=32, fine_steps=AMOEBA_FINE_STEPS),
    "amoebanet_56px": Family("amoebanet_56px", AMOEBA_LADDER, build_amoeba,
                             partial(amoeba_batch, image=AMOEBA_LARGE_IMAGE), amoeba_loss,
                             rmsprop, batch_size=32, fine_steps=AMOEBA_FINE_STEPS),
    "transformer": Family(
        "transformer",
        [{"L": n} for n in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)],
        build_nmt, nmt_batch, nmt_loss, adam, batch_size=16, fine_steps={"L": 1}),
}

# Tiny families for the tests: the same code paths on models that build and step in a second.
TINY_AMOEBA_LADDER = amoeba_ladder([4, 8, 16], [3, 6, 9, 12])
TINY_FAMILIES: dict[str, Family] = {
    "amoebanet": Family("amoebanet", TINY_AMOEBA_LADDER, build_amoeba, amoeba_batch, amoeba_loss,
                        rmsprop, batch_size=8, fine_steps={"D": 4, "L": 1}),
    "amoebanet_56px": Family("amoebanet_56px", TINY_AMOEBA_LADDER, build_amoeba,
                             partial(amoeba_batch, image=AMOEBA_LARGE_IMAGE), amoeba_loss,
                             rmsprop, batch_size=8, fine_steps={"D": 4, "L": 1}),
    "transformer": Family("transformer", [{"L": n} for n in (1, 2, 3, 4, 6, 8)],
                          partial(build_nmt, width=TINY_NMT_WIDTH),
                          partial(nmt_batch, vocab=TINY_NMT_WIDTH["vocab_size"]), nmt_loss, adam,
                          batch_size=4, fine_steps={"L": 1}),
}


# Table 2's models: AmoebaNet-D(12, 24), batch 32, and a deep Transformer (12 encoder + 12 decoder
# layers at the NMT app's CPU width), batch 32 pairs of 16 tokens; under a second a step on a core.
THROUGHPUT_FAMILIES: dict[str, tuple[Family, Size]] = {
    "amoebanet": (FAMILIES["amoebanet"], {"L": 12, "D": 24}),
    "transformer": (Family("transformer", [{"L": 12}], partial(build_nmt, width=SMALL_NMT_WIDTH),
                           partial(nmt_batch, vocab=SMALL_NMT_WIDTH["vocab_size"], seq=16),
                           nmt_loss, adam, batch_size=32), {"L": 12}),
}
TINY_THROUGHPUT_FAMILIES: dict[str, tuple[Family, Size]] = {
    "amoebanet": (TINY_FAMILIES["amoebanet"], {"L": 3, "D": 4}),
    "transformer": (TINY_FAMILIES["transformer"], {"L": 2}),
}


# --- the apps' own CPU defaults (`make train-nmt`, `make train-amoebanet`) ------------------


def _app_nmt_config() -> Any:
    from apps.nmt.config import load_nmt_config

    return load_nmt_config(["--config=cpu_default"])


def build_app_nmt(size: Size) -> nn.Sequential:
    from apps.nmt.config import build_model

    return build_model(_app_nmt_config(), device="meta")


def app_nmt_batch(batch_size: int, seq: int = 20) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """A batch shaped like the default's: ``max_tokens`` 1024 of short UI strings is about 48
    sentence pairs of 20 tokens (random ids: speed does not depend on the words)."""
    return nmt_batch(batch_size, vocab=_app_nmt_config().vocab_size, seq=seq)


def app_nmt_loss(logits: Tensor, target_ids: Tensor) -> Tensor:
    config = _app_nmt_config()
    return token_cross_entropy(logits, target_ids, pad_id=config.pad_id,
                               label_smoothing=config.label_smoothing)


def _app_amoeba_config() -> Any:
    from apps.amoebanet.config import load_amoebanet_config

    path = ROOT / "apps" / "amoebanet" / "configs" / "cpu_fashion_mnist.yaml"
    return load_amoebanet_config([f"--config={path}"])


def build_app_amoeba(size: Size) -> nn.Sequential:
    from apps.amoebanet.config import build_model

    return build_model(_app_amoeba_config(), device="meta")


def app_amoeba_batch(batch_size: int) -> tuple[Tensor, Tensor]:
    config = _app_amoeba_config()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, config.in_chans, config.image_size, config.image_size,
                         generator=g)
    return images, torch.randint(0, config.num_classes, (batch_size,), generator=g)


# The apps' defaults as `make train-nmt` and `make train-amoebanet` build them (read from their
# configs: today NMT 3+3 at d=128 and AmoebaNet-D(4, 24) on 28x28 Fashion-MNIST, batch 128;
# docs/reproduction/throughput_apps_*.json were measured on the defaults before 2026-12, NMT
# 6+6 and AmoebaNet-D(6, 32)), for the pipeline-efficiency measurements of the apps.
APP_FAMILIES: dict[str, tuple[Family, Size]] = {
    "nmt_app": (Family("nmt_app", [{}], build_app_nmt, app_nmt_batch, app_nmt_loss, adam,
                       batch_size=48), {}),
    "amoebanet_app": (Family("amoebanet_app", [{}], build_app_amoeba, app_amoeba_batch,
                             amoeba_loss, rmsprop, batch_size=128), {}),
}


# --- a held-out family: torch's own Transformer encoder layer ------------------------------


class EncoderBlock(nn.Module):
    """``nn.TransformerEncoderLayer`` as torch builds it by default (post-norm, batch first, no
    dropout), a layer no part of the simulator, the profiler or the schedules was tuned on.
    (With ``norm_first=True`` torch.distributed.pipelining's zero-bubble schedules fail in
    their input backward: "Can't detach views in-place", torch 2.14.)"""

    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True)

    def reset_parameters(self) -> None:
        """Attention's input projection has no public reset (torch's own init, on meta)."""
        self.layer.self_attn._reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)  # type: ignore[no-any-return]


def build_encoder(size: Size, d: int = 192, heads: int = 4, ffn: int = 768,
                  classes: int = 16) -> nn.Sequential:
    with torch.device("meta"):
        layers: list[nn.Module] = [EncoderBlock(d, heads, ffn) for _ in range(size["L"])]
        return nn.Sequential(*layers, nn.Linear(d, classes))


def encoder_batch(batch_size: int, seq: int = 48, d: int = 192, classes: int = 16
                  ) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, seq, d, generator=g),
            torch.randint(0, classes, (batch_size, seq), generator=g))


def encoder_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


# 8 encoder layers at d=192 (4 heads, FFN 768) and a linear head; batch 32 x 48 tokens.
ENCODER = Family("encoder", [{"L": 8}], build_encoder, encoder_batch, encoder_loss, adam,
                 batch_size=32)
TINY_ENCODER = Family("encoder", [{"L": 3}], partial(build_encoder, d=16, heads=2, ffn=32,
                                                     classes=4),
                      partial(encoder_batch, seq=6, d=16, classes=4), encoder_loss, adam,
                      batch_size=8)


# --- sizes without memory -------------------------------------------------------------------


@dataclass
class LayerSizes:
    """Per layer of a model, for a given batch: bytes kept for backward, input, parameters."""

    saved: list[float]  # autograd's saved tensors (each counted once per tensor)
    inputs: list[float]  # the layer's input: all a re-materialized layer keeps
    params: list[float]  # parameter bytes
    outputs: list[float]  # the layer's output: what a stage sends downstream


def nbytes(value: Any) -> float:
    leaves, _ = flatten(value)
    return float(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, Tensor)))


class _SavedTensorBytes:
    """Bytes of the tensors autograd saves, each tensor once (meta tensors have no storage to
    tell views apart; the graph keeps saved tensors alive, so their ids stay unique)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._seen: set[int] = set()

    def pack(self, tensor: Tensor) -> Tensor:
        # Parameters (and views of them, e.g. a Linear's transposed weight) are not activations.
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return tensor
        if id(tensor) not in self._seen:
            self._seen.add(id(tensor))
            self.total += tensor.numel() * tensor.element_size()
        return tensor


def layer_sizes(model: nn.Sequential, inputs: Any) -> LayerSizes:
    """Run ``inputs`` through ``model`` on the meta device and count each layer's sizes.

    Works on a model built on ``meta`` (nothing is allocated). Saved tensors are counted by
    their own size, so two views of one storage count twice: an upper bound, a close one for
    these models (views are rare among the tensors autograd saves here).
    """
    x = map_tensors(inputs, lambda t: t.to("meta"))
    sizes = LayerSizes([], [], [], [])
    for layer in model:
        x = map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        saved = _SavedTensorBytes()
        # Data-dependent indexing (e.g. counting clipped logits) has no meta kernel unless told
        # to assume every element is selected: an upper bound again.
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
                fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            y = layer(x)
        sizes.saved.append(saved.total)
        sizes.inputs.append(nbytes(x))
        sizes.params.append(float(sum(p.numel() * p.element_size() for p in layer.parameters())))
        sizes.outputs.append(nbytes(y))
        x = y
    return sizes


# --- tensor memory per layer, measured ----------------------------------------------------------------


@dataclass
class LayerMemory:
    """Per layer, measured on real tensors for one micro-batch: bytes autograd keeps for the
    backward (distinct storages, parameters excluded) and the transient peak above them while
    the layer's forward and backward run (temporaries, output and input gradients)."""

    saved: list[float]
    transient: list[float]


def layer_memory(model: nn.Sequential, inputs: Any, targets: Any, loss_fn: Any) -> LayerMemory:
    """Measure :class:`LayerMemory` layer by layer on real activations (the loss with the
    last layer), each layer's backward given a gradient of ones' shape as a stage receives.
    A storage saved by several layers (a layer's output saved again as the next one's input)
    counts with the first; the input's own storages do not count (``loss_fn=None``: no loss,
    for a stage that is not the last)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {t.untyped_storage().data_ptr() for t in flatten(inputs)[0] if isinstance(t, Tensor)}
    alive: list[Tensor] = []  # saved tensors held to the end, so no address is reused
    result = LayerMemory([], [])
    x = inputs
    n = len(model)
    for i, layer in enumerate(model):
        x = map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        storages: dict[int, int] = {}

        def pack(tensor: Tensor, storages: dict[int, int] = storages) -> Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params and storage.data_ptr() not in seen:
                storages[storage.data_ptr()] = storage.nbytes()
                alive.append(tensor)
            return tensor

        def forward_backward(x: Any = x, layer: nn.Module = layer, i: int = i) -> Any:
            y = layer(x)
            out = loss_fn(y, targets) if i == n - 1 and loss_fn is not None else y
            leaves = [t for t in flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
            if leaves:
                torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
            return y

        # A first pass creates the parameters' gradients, which a step holds anyway (counted
        # apart); the measured pass accumulates into them, as every backward after a stage's
        # first does.
        forward_backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        tracker = LiveTensorBytes([x, targets, list(model.parameters()), list(model.buffers()),
                                   grads])
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = forward_backward()
        layer.zero_grad(set_to_none=True)
        seen.update(storages)
        saved = float(sum(storages.values()))
        result.saved.append(saved)
        result.transient.append(max(tracker.peak - saved, 0.0))
        x = y
    return result
