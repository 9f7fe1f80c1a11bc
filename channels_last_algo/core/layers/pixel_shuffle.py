"""Pixel shuffle and unshuffle as one NHWC copy, for CUDA.

On CPU ``pixel_shuffle``/``pixel_unshuffle`` have channels-last kernels; elsewhere they run a
reshape-permute-``clone(contiguous)`` that returns NCHW. The same rearrangement on the
(N, H, W, C) view, with the channel axis split last, copies once into NHWC order, and its
backward (a reshape of the NHWC gradient) stays NHWC too.

The functions check the input's shape, so they are ``torch.fx.wrap`` leaves; under
``torch.jit.script`` the layers run the native kernels (the same numbers).

Example:
    >>> import torch
    >>> x = torch.randn(1, 8, 3, 3).to(memory_format=torch.channels_last)
    >>> torch.equal(pixel_shuffle_nhwc(x, 2), torch.nn.functional.pixel_shuffle(x, 2))
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from channels_last_algo.core.swap import Replacement

__all__ = ['ChannelsLastPixelShuffle', 'ChannelsLastPixelUnshuffle', 'pixel_shuffle_nhwc', 'pixel_unshuffle_nhwc']


def pixel_shuffle_nhwc(x: torch.Tensor, upscale_factor: int) -> torch.Tensor:
    """``F.pixel_shuffle`` of a 4D tensor, computed in NHWC order."""
    n, c, h, w = x.shape
    r = upscale_factor
    if c % (r * r):
        raise ValueError(
            f'pixel_shuffle needs channels divisible by upscale_factor**2; got {c} channels and factor {r}'
        )
    blocks = x.permute(0, 2, 3, 1).reshape(n, h, w, c // (r * r), r, r)
    out = blocks.permute(0, 1, 4, 2, 5, 3).reshape(n, h * r, w * r, c // (r * r))
    return out.permute(0, 3, 1, 2)


def pixel_unshuffle_nhwc(x: torch.Tensor, downscale_factor: int) -> torch.Tensor:
    """``F.pixel_unshuffle`` of a 4D tensor, computed in NHWC order."""
    n, c, h, w = x.shape
    r = downscale_factor
    if h % r or w % r:
        raise ValueError(
            f'pixel_unshuffle needs height and width divisible by downscale_factor; got {h}x{w} and factor {r}'
        )
    blocks = x.permute(0, 2, 3, 1).reshape(n, h // r, r, w // r, r, c)
    out = blocks.permute(0, 1, 3, 5, 2, 4).reshape(n, h // r, w // r, c * r * r)
    return out.permute(0, 3, 1, 2)


def pixel_shuffle(x: torch.Tensor, upscale_factor: int) -> torch.Tensor:
    """``F.pixel_shuffle``: :func:`pixel_shuffle_nhwc` for 4D inputs, the native op otherwise."""
    return pixel_shuffle_nhwc(x, upscale_factor) if x.dim() == 4 else F.pixel_shuffle(x, upscale_factor)


def pixel_unshuffle(x: torch.Tensor, downscale_factor: int) -> torch.Tensor:
    """``F.pixel_unshuffle``: :func:`pixel_unshuffle_nhwc` for 4D inputs, the native op otherwise."""
    return pixel_unshuffle_nhwc(x, downscale_factor) if x.dim() == 4 else F.pixel_unshuffle(x, downscale_factor)


torch.fx.wrap('pixel_shuffle')
torch.fx.wrap('pixel_unshuffle')


class ChannelsLastPixelShuffle(Replacement, nn.PixelShuffle):
    """``nn.PixelShuffle`` that returns NHWC on every device."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return F.pixel_shuffle(input, self.upscale_factor)
        return pixel_shuffle(input, self.upscale_factor)


class ChannelsLastPixelUnshuffle(Replacement, nn.PixelUnshuffle):
    """``nn.PixelUnshuffle`` that returns NHWC on every device."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return F.pixel_unshuffle(input, self.downscale_factor)
        return pixel_unshuffle(input, self.downscale_factor)
