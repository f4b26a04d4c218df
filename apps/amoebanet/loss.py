"""The AmoebaNet training loss, chosen to match the training loader's targets."""

from __future__ import annotations

from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn

from apps.amoebanet.config import AmoebaNetConfig, soft_targets


def build_train_loss(config: AmoebaNetConfig) -> nn.Module:
    """Training loss matching the loader's targets.

    Soft targets (mixup/cutmix) -> ``SoftTargetCrossEntropy``; else label smoothing ->
    ``LabelSmoothingCrossEntropy``; else plain cross-entropy. Evaluation uses plain
    ``nn.CrossEntropyLoss`` on the eval loader's integer labels.
    """
    if soft_targets(config):
        return SoftTargetCrossEntropy()
    if config.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=config.label_smoothing)
    return nn.CrossEntropyLoss()
