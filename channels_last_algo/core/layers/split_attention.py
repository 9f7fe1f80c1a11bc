"""Split attention (ResNeSt) computed on the channels-last view.

timm's ``SplitAttn`` reshapes its N x (R*C) x H x W activation to N x R x C x H x W, sums
over the R radix groups, weights them with the attention and returns ``out.contiguous()``.
On an NHWC activation the 5D view is in no standard order, the weighted sum comes out NCHW,
and ``.contiguous()`` keeps it so: the layer hands NCHW to the next one (the audit sees it
as ``avg_pool2d_backward`` turning NCHW in the pool after it, in backward). Splitting the
channel axis of the (N, H, W, R*C) view instead gives N x H x W x R x C, whose sums over R
are NHWC in forward and backward; the global pool of the attention is taken as in
:func:`~channels_last_algo.core.layers.global_avg_pool.global_avg_pool_nhwc`. Same numbers.

This module imports timm and is loaded only for models that hold the layer.

Example:
    >>> import torch
    >>> x = torch.randn(2, 6, 3, 3).to(memory_format=torch.channels_last)
    >>> radix_sum_nhwc(x, 2).is_contiguous(memory_format=torch.channels_last)
    True
    >>> torch.allclose(radix_sum_nhwc(x, 2), x.reshape(2, 2, 3, 3, 3).sum(1))
    True
"""

from __future__ import annotations

import torch
from timm.layers.split_attn import SplitAttn

from channels_last_algo.core.layers.global_avg_pool import global_avg_pool_nhwc
from channels_last_algo.core.swap import Replacement

torch.fx.wrap('global_avg_pool_nhwc')  # reads strides: a leaf of fx traces here too

__all__ = ['ChannelsLastSplitAttn', 'radix_sum_nhwc']


def _radix_view(x: torch.Tensor, radix: int) -> torch.Tensor:
    """The N x (R*C) x H x W tensor as N x H x W x R x C (a view of an NHWC tensor)."""
    return x.permute(0, 2, 3, 1).unflatten(3, (radix, -1))


def radix_sum_nhwc(x: torch.Tensor, radix: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over the ``radix`` channel groups of an N x (R*C) x H x W tensor (each group times its
    N x (R*C) x 1 x 1 ``weights``, if given): N x C x H x W, computed in NHWC order."""
    groups = _radix_view(x, radix)
    if weights is not None:
        groups = groups * _radix_view(weights, radix)
    return groups.sum(dim=3).permute(0, 3, 1, 2)


class ChannelsLastSplitAttn(Replacement, SplitAttn):
    """timm's ``SplitAttn`` with its radix sums over the channels-last view; output NHWC."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act0(self.drop(self.bn0(self.conv(x))))
        x_gap = radix_sum_nhwc(x, self.radix) if self.radix > 1 else x
        x_gap = self.act1(self.bn1(self.fc1(global_avg_pool_nhwc(x_gap))))
        x_attn = self.rsoftmax(self.fc2(x_gap)).view(x.shape[0], -1, 1, 1)
        if self.radix > 1:
            return radix_sum_nhwc(x, self.radix, x_attn)
        return x * x_attn
