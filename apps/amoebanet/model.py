"""AmoebaNet-D/-B as one ``nn.Sequential`` of named cells passing ``(x, skip)`` tuples."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext

import torch
from timm.layers import DropPath
from torch import Tensor, nn

from apps.amoebanet.genotype import CellGenotype, Genotype, get_genotype

# What flows between the layers of the sequence: (output of the previous cell, its input).
CellState = tuple[Tensor, Tensor]

# The paper's network: two reduction "stem cells", then normal cells with two reductions among
# them. Each reduction cell and a stride-2 stem conv halve the image (rounding up).
NUM_STEM_CELLS = 2
NUM_INNER_REDUCTIONS = 2


class ImageTooSmallError(ValueError):
    """The input image cannot go through every stride-2 reduction of the network."""


def num_reductions(stem_stride: int) -> int:
    """Stride-2 reductions on the way from the image to the classifier."""
    return NUM_STEM_CELLS + NUM_INNER_REDUCTIONS + (1 if stem_stride == 2 else 0)


def min_image_size(stem_stride: int) -> int:
    """Smallest image side that every reduction still halves.

    Each stride-2 reduction rounds up (``ceil(H / 2)``), so a reduction needs at least a 2x2 map
    to reduce anything: the last of ``n`` reductions sees ``2`` when the image is
    ``2 ** (n - 1) + 1`` (e.g. 17 with a stride-2 stem, 9 with a stride-1 stem; 28x28
    Fashion-MNIST works with both).
    """
    return 2 ** (num_reductions(stem_stride) - 1) + 1


def check_image_size(height: int, width: int, stem_stride: int) -> None:
    """Raise ImageTooSmallError naming the size, the reductions and the minimum size."""
    smallest = min_image_size(stem_stride)
    if min(height, width) < smallest:
        count = num_reductions(stem_stride)
        raise ImageTooSmallError(
            f"image size {height}x{width} is too small for this AmoebaNet: it has {count} "
            f"stride-2 reductions (stem_stride={stem_stride}), which need images of at least "
            f"{smallest}x{smallest}; resize the images up or use stem_stride=1"
        )


def relu_conv_bn(
    in_channels: int,
    out_channels: int,
    kernel_size: int | tuple[int, int] = 1,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
) -> nn.Sequential:
    """ReLU -> conv (no bias) -> BatchNorm, the unit every AmoebaNet conv op is made of."""
    return nn.Sequential(
        nn.ReLU(inplace=False),  # inplace would overwrite a state another op still reads
        nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                  bias=False),
        nn.BatchNorm2d(out_channels),
    )


class FactorizedReduce(nn.Module):
    """Halve the spatial size without losing every other pixel: two offset 1x1 stride-2 convs.

    As in the reference: path 1 reads the even pixels, path 2 the odd ones (input shifted by one,
    zero-padded at the end); their outputs are concatenated and batch-normalised. The output is
    ``ceil(H / 2) x ceil(W / 2)``, the same as every other stride-2 op here.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        half = out_channels // 2
        self.relu = nn.ReLU(inplace=False)
        self.path1 = nn.Conv2d(in_channels, half, 1, bias=False)
        self.path2 = nn.Conv2d(in_channels, out_channels - half, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        path1 = self.path1(x[:, :, ::2, ::2])
        shifted = nn.functional.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        path2 = self.path2(shifted[:, :, ::2, ::2])
        return self.bn(torch.cat([path1, path2], dim=1))


def separable_stack(
    channels: int, kernel_size: int, *, stride: int, num_layers: int, dilation: int = 1
) -> nn.Sequential:
    """``num_layers`` x (ReLU, depthwise k x k, pointwise 1x1, BN); only the first is strided."""
    layers: list[nn.Module] = []
    for index in range(num_layers):
        layers += [
            nn.ReLU(inplace=False),
            nn.Conv2d(channels, channels, kernel_size, stride=stride if index == 0 else 1,
                      padding=dilation * (kernel_size - 1) // 2, dilation=dilation,
                      groups=channels, bias=False),
            nn.Conv2d(channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        ]
    return nn.Sequential(*layers)


def make_op(name: str, channels: int, stride: int) -> nn.Module:
    """Build one genotype op on ``channels`` channels; ``stride`` is 1 or 2.

    Every op keeps the channel count and maps H to ``ceil(H / stride)``. ``3x3`` and ``1x7_7x1``
    use a bottleneck of a quarter of the channels, as the AmoebaNet reference does.
    """
    bottleneck = max(1, channels // 4)
    if name == "none":
        return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)
    if name == "1x1":
        return relu_conv_bn(channels, channels, 1, stride=stride)
    if name == "3x3":
        return nn.Sequential(
            relu_conv_bn(channels, bottleneck, 1),
            relu_conv_bn(bottleneck, bottleneck, 3, stride=stride, padding=1),
            relu_conv_bn(bottleneck, channels, 1),
        )
    if name == "1x7_7x1":
        return nn.Sequential(
            relu_conv_bn(channels, bottleneck, 1),
            relu_conv_bn(bottleneck, bottleneck, (1, 7), stride=(1, stride), padding=(0, 3)),
            relu_conv_bn(bottleneck, bottleneck, (7, 1), stride=(stride, 1), padding=(3, 0)),
            relu_conv_bn(bottleneck, channels, 1),
        )
    if name == "max_pool_2x2":
        # ceil_mode gives ceil(H / 2) like TF's SAME padding and the other stride-2 ops
        return nn.MaxPool2d(2, stride=stride, ceil_mode=True)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if name == "avg_pool_3x3":
        # TF's SAME average pooling does not count the padding
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if name == "separable_3x3_2":
        return separable_stack(channels, 3, stride=stride, num_layers=2)
    if name == "dil_2_separable_5x5_2":
        return separable_stack(channels, 5, stride=stride, num_layers=2, dilation=2)
    raise ValueError(f"unknown AmoebaNet op {name!r}")


class Cell(nn.Module):
    """A normal or reduction cell: ``(x, skip) -> (cell(x, skip), x)``.

    ``x`` becomes state 0 through ReLU-1x1-BN to ``channels``; ``skip`` (the previous cell's
    input) becomes state 1, matched to state 0's shape: a factorized reduce when the previous
    cell was a reduction (skip is twice as large), a ReLU-1x1-BN when only the channels differ.
    Returning ``x`` as the next skip keeps everything the next cell needs inside the tuple.
    """

    def __init__(
        self,
        genotype: CellGenotype,
        *,
        in_channels: int,
        skip_channels: int,
        channels: int,
        reduction: bool,
        skip_is_larger: bool,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.reduction = reduction
        self.inputs = genotype.inputs
        self.concat = genotype.concat
        self.out_channels = channels * len(genotype.concat)
        self.preprocess_x = relu_conv_bn(in_channels, channels, 1)
        self.preprocess_skip: nn.Module
        if skip_is_larger:
            self.preprocess_skip = FactorizedReduce(skip_channels, channels)
        elif skip_channels != channels:
            self.preprocess_skip = relu_conv_bn(skip_channels, channels, 1)
        else:
            self.preprocess_skip = nn.Identity()
        self.ops = nn.ModuleList(
            # in a reduction cell only the ops reading the cell's inputs (states 0, 1) stride
            make_op(name, channels, 2 if reduction and state < 2 else 1)
            for name, state in zip(genotype.ops, genotype.inputs, strict=True)
        )
        # identity ops are not dropped, as in the reference's drop path
        self.droppable = tuple(name != "none" for name in genotype.ops)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, inputs: CellState) -> CellState:
        x, skip = inputs
        states = [self.preprocess_x(x), self.preprocess_skip(skip)]
        for pair in range(0, len(self.ops), 2):
            total: Tensor | None = None
            for position in (pair, pair + 1):
                out = self.ops[position](states[self.inputs[position]])
                if self.droppable[position]:
                    out = self.drop_path(out)
                total = out if total is None else total + out
            assert total is not None
            states.append(total)
        return torch.cat([states[index] for index in self.concat], dim=1), x


class Stem(nn.Module):
    """3x3 conv (stride 2, or 1 for tiny images) + BN; returns ``(x, x)`` to start the tuple."""

    def __init__(self, in_chans: int, channels: int, *, stride: int) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stem_stride={stride} is not supported; use 1 or 2")
        self.stride = stride
        self.conv = nn.Conv2d(in_chans, channels, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, image: Tensor) -> CellState:
        if image.dim() != 4:
            raise ValueError(
                f"AmoebaNet expects images of shape [batch, channels, height, width], "
                f"got {tuple(image.shape)}"
            )
        check_image_size(image.shape[-2], image.shape[-1], self.stride)
        x = self.bn(self.conv(image))
        # the first stem cell has no previous cell: its skip is the stem output itself
        return x, x


class Classify(nn.Module):
    """Head: ReLU, global average pool (any spatial size), dropout, linear -> logits."""

    def __init__(self, in_channels: int, num_classes: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, inputs: CellState) -> Tensor:
        x, _skip = inputs
        x = self.pool(self.relu(x)).flatten(1)
        return self.fc(self.dropout(x))


def cell_layout(num_normal_cells: int) -> list[str]:
    """Kinds of the cells after the stem, in order: ``"reduction"`` or ``"normal"``.

    Two stem reduction cells, then ``L`` normal cells with a reduction cell inserted before
    normal cell ``L // 3`` and ``2L // 3`` (after the first and second third, as the reference's
    ``calc_reduction_layers``).
    """
    if num_normal_cells < 0:
        raise ValueError(f"num_normal_cells={num_normal_cells} must be >= 0")
    reduce_before = [num_normal_cells * k // 3 for k in (1, 2)]
    kinds = ["reduction"] * NUM_STEM_CELLS
    for index in range(num_normal_cells):
        kinds += ["reduction"] * reduce_before.count(index)
        kinds.append("normal")
    kinds += ["reduction"] * sum(1 for p in reduce_before if p >= num_normal_cells)
    return kinds


def amoebanet(
    genotype: Genotype | str = "D",
    *,
    num_normal_cells: int = 18,
    filters: int = 208,
    num_classes: int = 1000,
    in_chans: int = 3,
    stem_stride: int = 2,
    drop_path: float = 0.0,
    dropout: float = 0.0,
) -> nn.Sequential:
    """AmoebaNet(L=num_normal_cells, D=filters) as ``nn.Sequential`` of named cells.

    Cells are numbered 1, 2, ... in network order, the two stem cells included, and named
    ``cell<number>_<kind>``; with L normal cells there are L + 6 layers (example L=6)::

        stem             [B,C,H,W] -> (x, x)            3x3 conv, D/4 filters
        cell1_reduction  (x, skip) -> (x', x)           stem cell, D/4 filters
        cell2_reduction                                 stem cell, D/2 filters
        cell3_normal, cell4_normal                      D filters
        cell5_reduction                                 2D filters
        cell6_normal, cell7_normal                      2D filters
        cell8_reduction                                 4D filters
        cell9_normal, cell10_normal                     4D filters
        classify         (x, skip) -> [B, num_classes]

    Each layer takes one argument and returns one value, and nothing outside the tuple is
    shared, so the sequence can be cut anywhere by a pipeline. Drop-path probability grows
    linearly with depth up to ``drop_path`` at the last cell.
    """
    if isinstance(genotype, str):
        genotype = get_genotype(genotype)
    if filters < 4:
        raise ValueError(f"filters={filters} must be >= 4 (the stem cells use filters / 4)")
    if num_classes < 1 or in_chans < 1:
        raise ValueError(f"num_classes={num_classes} and in_chans={in_chans} must be >= 1")
    if not 0.0 <= drop_path < 1.0 or not 0.0 <= dropout < 1.0:
        raise ValueError(f"drop_path={drop_path} and dropout={dropout} must be in [0, 1)")

    kinds = cell_layout(num_normal_cells)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    # filters in quarters of D: the stem cells use D/4 and D/2 (doubling after each, as the
    # reference's stem does), normal cells start at D, and each inner reduction doubles first
    stem_channels = filters // 4
    layers["stem"] = Stem(in_chans, stem_channels, stride=stem_stride)

    in_channels = skip_channels = stem_channels
    skip_is_larger = False  # the stem's skip is its output itself
    quarters = 4
    for index, kind in enumerate(kinds, start=1):
        reduction = kind == "reduction"
        if index <= NUM_STEM_CELLS:
            cell_quarters = 2 ** (index - 1)
        else:
            quarters *= 2 if reduction else 1
            cell_quarters = quarters
        cell = Cell(
            genotype.reduction if reduction else genotype.normal,
            in_channels=in_channels,
            skip_channels=skip_channels,
            channels=filters * cell_quarters // 4,
            reduction=reduction,
            skip_is_larger=skip_is_larger,
            drop_path=drop_path * index / len(kinds),
        )
        layers[f"cell{index}_{kind}"] = cell
        skip_channels, in_channels = in_channels, cell.out_channels
        skip_is_larger = reduction

    layers["classify"] = Classify(in_channels, num_classes, dropout=dropout)
    return nn.Sequential(layers)


def build_amoebanet(device: torch.device | str | None = None, **kwargs: object) -> nn.Sequential:
    """``amoebanet(**kwargs)`` with parameters created directly on ``device`` (e.g. "meta").

    On "meta" nothing is allocated, so even AmoebaNet-D(72,512) builds in about a second; a
    pipeline stage then materializes only its own partition.
    """
    with torch.device(device) if device is not None else nullcontext():
        return amoebanet(**kwargs)  # type: ignore[arg-type]


def count_parameters(module: nn.Module) -> int:
    """Number of parameters (works on the meta device)."""
    return sum(p.numel() for p in module.parameters())
