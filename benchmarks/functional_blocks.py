"""The pieces the functional-break nets (:mod:`functional_models`, :mod:`functional_attention`) are built
of: a conv, BatchNorm and ReLU; the pooled Linear head; and a net of a stride-2 stem, blocks and that head.

Example:
    >>> import torch
    >>> net = BlocksNet([conv_bn(8, 8)], width=8, num_classes=10)
    >>> net(torch.randn(2, 3, 16, 16)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ['BlocksNet', 'conv_bn', 'pooled_head']


def conv_bn(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


def pooled_head(width: int, num_classes: int) -> nn.Sequential:
    """Global average pooling (a module: the repair rule keeps its gradient NHWC) and a Linear."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(width, num_classes))


class BlocksNet(nn.Module):
    """A stride-2 stem, ``blocks``, a 1x1 conv and the pooled head."""

    def __init__(self, blocks: list[nn.Module], width: int, num_classes: int) -> None:
        super().__init__()
        self.stem = conv_bn(3, width, stride=2)
        self.blocks = nn.Sequential(*blocks)
        self.mix = conv_bn(width, width, kernel=1)
        self.head = pooled_head(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.blocks(self.stem(x))))
