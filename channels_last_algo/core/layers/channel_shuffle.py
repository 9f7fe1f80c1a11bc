"""ShuffleNetV2's concatenate-and-shuffle as one NHWC interleave.

torchvision's ``InvertedResidual`` concatenates its two branches along channels, then
``channel_shuffle`` views the result as N x 2 x C/2 x H x W, transposes and calls
``.contiguous()``: a 5D copy that is channels-first, so every block hands NCHW to the next and
the following ``cat`` returns NCHW in forward and backward. With two groups the shuffle only
interleaves the two halves (output channel 2i + g is channel i of half g), which is a
``stack`` on the last axis of the (N, H, W, C) views: one write instead of two, in NHWC order.

Example:
    >>> import torch
    >>> a = torch.zeros(1, 2, 1, 1); b = torch.ones(1, 2, 1, 1)
    >>> interleave_channels(a, b).flatten().tolist()
    [0.0, 1.0, 0.0, 1.0]
"""

from __future__ import annotations

import torch
from torchvision.models.shufflenetv2 import InvertedResidual

from channels_last_algo.core.swap import Replacement

__all__ = ['ChannelsLastInvertedResidual', 'interleave_channels']


def interleave_channels(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``channel_shuffle(cat((first, second), 1), 2)`` of two N x C x H x W tensors, as NHWC."""
    stacked = torch.stack((first.permute(0, 2, 3, 1), second.permute(0, 2, 3, 1)), dim=-1)
    return stacked.flatten(-2).permute(0, 3, 1, 2)


class ChannelsLastInvertedResidual(Replacement, InvertedResidual):
    """ShuffleNetV2 block computing concatenation and channel shuffle as one NHWC interleave."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            return interleave_channels(x1, self.branch2(x2))
        return interleave_channels(self.branch1(x), self.branch2(x))
