"""A small UNet-style model holding every layer the repair rules cover that the zoo lacks.

GroupNorm, InstanceNorm2d (affine and not), reflection and replication padding,
PixelUnshuffle/PixelShuffle, ConvTranspose2d, bilinear and bicubic upsampling, and skip
connections joined by ``cat``. The output has twice the input's resolution.

Example:
    >>> import torch
    >>> UNet()(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 3, 64, 64])
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ['UNet']


def _conv_block(in_channels: int, out_channels: int, groups: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.GroupNorm(groups, out_channels),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """Encoder (stride 4) and decoder with skips; ``width`` channels at full resolution."""

    def __init__(self, in_channels: int = 3, out_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            nn.ReflectionPad2d(1),
            nn.Conv2d(in_channels, w, 3),
            nn.GroupNorm(4, w),
            nn.ReLU(),
        )
        self.down1 = nn.Sequential(
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1),
            nn.InstanceNorm2d(2 * w, affine=True),
            nn.ReLU(),
        )
        self.down2 = nn.Sequential(
            nn.PixelUnshuffle(2),
            nn.Conv2d(8 * w, 4 * w, 1),
            nn.GroupNorm(8, 4 * w),
            nn.ReLU(),
        )
        self.middle = nn.Sequential(
            nn.ReplicationPad2d(1),
            nn.Conv2d(4 * w, 4 * w, 3),
            nn.InstanceNorm2d(4 * w),
            nn.ReLU(),
        )
        self.up2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2)
        self.fuse2 = _conv_block(4 * w, 2 * w, 4)
        self.up1 = nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False)
        self.side = nn.Sequential(
            nn.Upsample(scale_factor=4, mode='bicubic', align_corners=False),
            nn.Conv2d(4 * w, w, 1),
        )
        self.fuse1 = _conv_block(2 * w + w, w, 4)
        self.head = nn.Sequential(
            nn.Conv2d(w, 4 * out_channels, 3, padding=1),
            nn.PixelShuffle(2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.stem(x)
        half = self.down1(full)
        middle = self.middle(self.down2(half))
        half = self.fuse2(torch.cat((self.up2(middle), half), dim=1))
        full = torch.cat((self.up1(half), full), dim=1)
        full = self.fuse1(full) + self.side(middle)
        return self.head(full)
