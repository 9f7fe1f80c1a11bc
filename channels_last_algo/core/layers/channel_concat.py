"""Channel concatenation and slicing on the channels-last view (GhostNet's ghost modules).

``torch.cat(..., dim=1)`` of NHWC tensors returns NHWC, but slicing channels off the result
(``out[:, :c]``) makes its backward (``slice_backward``, up to torch 2.13) allocate a zero
gradient in the default, NCHW order, and an in-place residual add into the slice (a view:
GhostNet's ``x += shortcut``) makes autograd copy the whole concatenation's gradient NCHW
(``CopySlices``, on every torch version); the ``add`` that accumulates it with the other
gradient of the same tensor then turns NCHW too, and so does everything before it in backward. Concatenating and
slicing on the (..., H, W, C) view instead keeps both passes NHWC: the slice's zero gradient
is allocated in the order of the view, which is NHWC memory. The slice is taken before the
concatenation, whose result is then a new NHWC tensor, not a view (an in-place residual add
on a view would copy the whole concatenation in backward). Same numbers, no extra copy.

The ghost modules of timm (GhostNet, GhostNetV2) are the layers with this pattern that the
rule table knows; this module imports timm and is loaded only for models that hold them.

Example:
    >>> import torch
    >>> a = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    >>> out = concat_channels_nhwc(a, a * 2, 5)
    >>> out.shape, out.is_contiguous(memory_format=torch.channels_last)
    (torch.Size([2, 5, 4, 4]), True)
    >>> out.sum().backward()
    >>> a.grad.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.ghostnet import GhostModule, GhostModuleV2

from channels_last_algo.core.swap import Replacement

__all__ = ['ChannelsLastGhostModule', 'ChannelsLastGhostModuleV2', 'concat_channels_nhwc']


def concat_channels_nhwc(first: torch.Tensor, second: torch.Tensor, channels: int) -> torch.Tensor:
    """``torch.cat((first, second), dim=1)[:, :channels]`` for ``channels`` at least ``first``'s,
    computed on the channels-last views; the result is a new tensor, not a view (an in-place add
    to it, as in a residual block, then needs no copy of the whole concatenation in backward)."""
    kept = second.permute(0, 2, 3, 1)[..., : channels - first.shape[1]].permute(0, 3, 1, 2)
    return torch.cat((first, kept), dim=1)


class ChannelsLastGhostModule(Replacement, GhostModule):
    """timm's ``GhostModule`` concatenating and slicing its two branches in NHWC order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.primary_conv(x)
        return concat_channels_nhwc(x1, self.cheap_operation(x1), self.out_chs)


class ChannelsLastGhostModuleV2(Replacement, GhostModuleV2):
    """timm's ``GhostModuleV2`` (attention gate) concatenating and slicing in NHWC order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = self.short_conv(F.avg_pool2d(x, kernel_size=2, stride=2))
        x1 = self.primary_conv(x)
        out = concat_channels_nhwc(x1, self.cheap_operation(x1), self.out_chs)
        return out * F.interpolate(self.gate_fn(res), size=(out.shape[-2], out.shape[-1]), mode='nearest')
