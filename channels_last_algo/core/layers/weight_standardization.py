"""Weight standardisation over the channels-last view of the weight (timm's StdConv2d family).

Weight-standardised convolutions (BiT's ``StdConv2d``, NFNet's ``ScaledStdConv2d``)
normalise each output channel of the weight with ``batch_norm`` over
``weight.reshape(1, out_channels, -1)``. For a channels-last weight that reshape is a copy
into NCHW order every step, the convolution gets an NCHW weight, and the weight gradient is
copied back into the parameter's NHWC layout in backward. Reshaping the (O, kh, kw, I)
permutation instead is a view of an NHWC weight, so the standardised weight comes out NHWC
and no copy is made. The statistics are over the same elements (in another order).

The ``Same`` layers pad with timm's ``pad_same``, whose padding depends on the input's size;
it is a ``torch.fx.wrap`` leaf here, so ``torch.fx.symbolic_trace`` records one call to it.

This module imports timm and is loaded only for models that hold these layers.

Example:
    >>> import torch
    >>> w = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
    >>> std = standardized_weight_nhwc(w, None, 1e-6)
    >>> std.is_contiguous(memory_format=torch.channels_last)
    True
    >>> torch.allclose(std.mean((1, 2, 3)), torch.zeros(8), atol=1e-6)
    True
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers.padding import pad_same
from timm.layers.std_conv import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame

from channels_last_algo.core.swap import Replacement

__all__ = [
    'ChannelsLastScaledStdConv2d',
    'ChannelsLastScaledStdConv2dSame',
    'ChannelsLastStdConv2d',
    'ChannelsLastStdConv2dSame',
    'standardized_weight_nhwc',
]


def standardized_weight_nhwc(weight: torch.Tensor, gain: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Each output channel of ``weight`` standardised (times ``gain``), as timm's ``batch_norm``
    form computes it, over the channels-last view: an NHWC weight gives an NHWC result."""
    moved = weight.permute(0, 2, 3, 1)  # (O, kh, kw, I)
    flat = moved.reshape(1, weight.shape[0], -1)
    standardized = F.batch_norm(flat, None, None, weight=gain, training=True, momentum=0.0, eps=eps)
    return standardized.view(moved.shape).permute(0, 3, 1, 2)


torch.fx.wrap('pad_same')


class ChannelsLastStdConv2d(Replacement, StdConv2d):
    """timm's ``StdConv2d``, its weight standardised in channels-last order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = standardized_weight_nhwc(self.weight, None, self.eps)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ChannelsLastStdConv2dSame(Replacement, StdConv2dSame):
    """timm's ``StdConv2dSame``, its weight standardised in channels-last order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.same_pad:
            x = pad_same(x, self.kernel_size, self.stride, self.dilation)
        weight = standardized_weight_nhwc(self.weight, None, self.eps)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ChannelsLastScaledStdConv2d(Replacement, ScaledStdConv2d):
    """timm's ``ScaledStdConv2d`` (NFNets), its weight standardised in channels-last order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = standardized_weight_nhwc(self.weight, (self.gain * self.scale).view(-1), self.eps)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ChannelsLastScaledStdConv2dSame(Replacement, ScaledStdConv2dSame):
    """timm's ``ScaledStdConv2dSame``, its weight standardised in channels-last order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.same_pad:
            x = pad_same(x, self.kernel_size, self.stride, self.dilation)
        weight = standardized_weight_nhwc(self.weight, (self.gain * self.scale).view(-1), self.eps)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
