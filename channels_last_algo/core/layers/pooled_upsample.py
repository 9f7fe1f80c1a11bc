"""Upsampling a 1 x 1 pooled map in NHWC order (DeepLabV3's ASPP image-pooling branch).

An N x C x 1 x 1 tensor is both NCHW and NHWC, and its strides decide which one an op that
reads it writes: after a 1x1 convolution, batch norm and ReLU the pooled map has NCHW strides,
so ``F.interpolate`` back to H x W writes NCHW, and the ``cat`` with the NHWC branches (which
picks NCHW for mixed layouts) turns the whole ASPP output NCHW. Giving the pooled map its
channels-last strides first (a view of the same memory: its spatial size is 1) makes the
upsampling write NHWC. Same numbers.

Example:
    >>> import torch
    >>> pooled = torch.randn(2, 8, 1, 1)
    >>> up = torch.nn.functional.interpolate(as_channels_last_map(pooled), size=(4, 4), mode='bilinear')
    >>> up.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.models.segmentation.deeplabv3 import ASPPPooling

from channels_last_algo.core.swap import Replacement

__all__ = ['ChannelsLastASPPPooling', 'as_channels_last_map']


def as_channels_last_map(x: torch.Tensor) -> torch.Tensor:
    """A dense N x C x 1 x 1 tensor as a view with channels-last strides."""
    dense = x.contiguous()
    return dense.as_strided(dense.shape, (dense.shape[1], 1, dense.shape[1], dense.shape[1]))


class ChannelsLastASPPPooling(Replacement, ASPPPooling):
    """torchvision's ``ASPPPooling`` whose upsampled output is NHWC."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        for mod in self:
            x = mod(x)
        return F.interpolate(as_channels_last_map(x), size=size, mode='bilinear', align_corners=False)
